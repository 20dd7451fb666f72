"""The solvers: pure functions over plain arrays (a :class:`.problem.DagProblem`), never ONNX.

:mod:`.problem` (the problem and its relay cost model), :mod:`.dp` (exact split of a sequence),
:mod:`.search` (orderings, DP, polish: the pipeline planner), :mod:`.refine` (frontier moves),
:mod:`.ilp` (exact CP-SAT reference), :mod:`.brute` (brute force, tests), :mod:`.contract` (FX
units kept whole), :mod:`.hybrid` (stages x replicas DP: the bisection and the plans it
proposes, over :mod:`.hybrid_model`, :mod:`.hybrid_tables`, :mod:`.hybrid_dp` and
:mod:`.hybrid_memory`; judged by :mod:`.hybrid_judge`, proved by :mod:`.hybrid_proof`),
:mod:`.planner` (the hybrid planner), :mod:`.fleet` (planning on a mixed fleet, over
:mod:`.fleet_dp`, :mod:`.fleet_scoring` and :mod:`.fleet_baselines`), :mod:`.scoring` (placed
costs and simulation), :mod:`.order` (DAG to sequence), :mod:`.baselines` (the systems we
compete with). Names are used from those modules.
"""

__all__ = [
           "baselines",
           "brute",
           "contract",
           "dp",
           "fleet",
           "fleet_baselines",
           "fleet_dp",
           "fleet_scoring",
           "hybrid",
           "hybrid_dp",
           "hybrid_judge",
           "hybrid_memory",
           "hybrid_model",
           "hybrid_proof",
           "hybrid_tables",
           "ilp",
           "order",
           "planner",
           "problem",
           "refine",
           "scoring",
           "search",
]
