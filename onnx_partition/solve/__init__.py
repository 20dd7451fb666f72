"""The solvers: pure functions over plain arrays (a :class:`.problem.DagProblem`), never ONNX.

:mod:`.problem` (the problem and its relay cost model), :mod:`.dp` (exact split of a sequence),
:mod:`.search` (orderings, DP, polish: the pipeline planner), :mod:`.refine` (frontier moves),
:mod:`.ilp` (exact CP-SAT reference), :mod:`.brute` (brute force, tests), :mod:`.contract` (FX
units kept whole), :mod:`.hybrid` (stages x replicas DP), :mod:`.planner` (the hybrid planner),
:mod:`.scoring` (placed costs and simulation), :mod:`.order` (DAG to sequence),
:mod:`.baselines` (the systems we compete with). Names are used from those modules.
"""

__all__ = [
           "baselines",
           "brute",
           "contract",
           "dp",
           "hybrid",
           "ilp",
           "order",
           "planner",
           "problem",
           "refine",
           "scoring",
           "search",
]
