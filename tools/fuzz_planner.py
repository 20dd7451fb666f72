"""A random search for planner bugs beyond CI's fixed examples (issue 36).

    python tools/fuzz_planner.py [--budget-s 540] [--kind all] [--seed S] [--cases N]

Draws random cases until the time budget is spent (or ``--cases`` are run), cycling through
the kinds, and checks each against a reference written apart from the code under test:

- ``dag-sequence``: a random DAG of up to 8 operators, one topological order: the exact DP's
  contiguous split (``split_order``) against every contiguous split of that order;
- ``dag-planner``: the same DAGs, the default planner (``best_split``, every ordering and
  local moves): its split valid and never below the optimum over every valid split
  (``solve/brute.py``); its gap to that optimum is reported, not a failure (a heuristic);
- ``dag-exact``: the same DAGs, ``partition``'s exact pass (``exact_split``) from that split:
  never worse than it nor past the optimum, and "proven" only at the optimum (within its
  rounding); the splits it leaves unproven count as undecided, their gap reported;
- ``hybrid``: a random sequence of up to 5 positions on 1..16 devices, 1..16 micro-batches,
  inference or training, memory free or binding, per-count links: ``plan_hybrid``'s least
  period against brute force over every split and every replica count (and every plan it
  proposes within memory);
- ``judge``: up to 6 positions on up to 6 devices: ``plan_hybrid`` against the CP-SAT judge
  (``judge_hybrid``, its own formulas); a judge that runs out of time counts as undecided;
- ``fleet``: two GPU groups of up to 6 devices: ``fleet_dp`` against brute force over every
  split, group assignment and replica count.

The brute forces are the tests' (``tests/support/``). Every run draws a new base seed from the
OS unless ``--seed`` is given, and prints it; case ``k`` uses seed ``base + k``. A failure prints
the case and the line that replays it alone (``--kind K --seed S --cases 1``). Exit code 1 when
any case failed. The default budget (540 s) fits 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.fleet_brute import brute_fleet
from support.hybrid_brute import brute_hybrid, plan_memory

from onnx_partition.cost.cluster import Fleet, GpuGroup, Link
from onnx_partition.errors import PartitionError
from onnx_partition.solve.brute import brute_force
from onnx_partition.solve.exact import exact_split
from onnx_partition.solve.fleet_dp import FleetSequence, fleet_dp
from onnx_partition.solve.hybrid import HybridConfig, SequenceCosts, plan_hybrid
from onnx_partition.solve.problem import DagProblem, topological_order
from onnx_partition.solve.scoring import RunSpec
from onnx_partition.solve.search import best_split, split_order

#: relative tolerance of "equal" periods (the DP's float32 period tables: about 1e-7)
REL = 1e-6


@dataclass
class Tally:
    """What one kind's cases came to."""

    cases: int = 0
    failures: int = 0
    undecided: int = 0
    gaps: list[float] = field(default_factory=list)  # dag-planner: heuristic over optimum
    seconds: float = 0.0
    seed: int = 0  # the case being run
    worst_seed: int = 0  # the case of the largest gap


def same(a: float, b: float) -> bool:
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-12)


def random_dag(rng: random.Random) -> tuple[DagProblem, int]:
    """A DAG of 2..8 operators, each making one tensor read by up to 3 later ones; a stage
    count of 1..min(n, 4)."""
    n = rng.randint(2, 8)
    consumers: list[list[int]] = [[0]]
    for i in range(n):
        later = list(range(i + 1, n))
        consumers.append(rng.sample(later, rng.randint(0, min(3, len(later)))))
    problem = DagProblem([rng.uniform(0.1, 5.0) for _ in range(n)], list(range(-1, n)),
                         consumers, [False] * n + [True],
                         [rng.choice([0.0, rng.uniform(0, 4e6)]) for _ in range(n + 1)],
                         bandwidth_bytes_per_ms=rng.choice([math.inf, 1e6]),
                         latency_ms=rng.choice([0.0, 0.05]))
    return problem, rng.randint(1, min(n, 4))


def check_dag_sequence(rng: random.Random, tally: Tally) -> str | None:
    problem, stages = random_dag(rng)
    order = topological_order(problem)
    n = len(order)
    got = problem.bottleneck_ms(split_order(problem, order, stages), stages)
    best = math.inf
    for inner in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *inner, n]
        stage_of = [0] * n
        for s, (i, j) in enumerate(itertools.pairwise(bounds)):
            for v in order[i:j]:
                stage_of[v] = s
        best = min(best, problem.bottleneck_ms(stage_of, stages))
    return None if same(got, best) else f"DP {got!r} != brute force {best!r}"


def check_dag_planner(rng: random.Random, tally: Tally) -> str | None:
    problem, stages = random_dag(rng)
    chosen, _ = best_split(problem, stages)
    if not problem.is_valid(chosen.stage_of, stages):
        return f"invalid split {chosen.stage_of}"
    _, optimum = brute_force(problem, stages)
    got = problem.bottleneck_ms(chosen.stage_of, stages)
    if got < optimum * (1 - 1e-9) - 1e-12:
        return f"planner {got!r} below the optimum {optimum!r}"
    gap = got / optimum - 1 if optimum > 0 else 0.0
    if not tally.gaps or gap > max(tally.gaps):
        tally.worst_seed = tally.seed
    tally.gaps.append(gap)
    return None


def check_dag_exact(rng: random.Random, tally: Tally) -> str | None:
    """``partition``'s exact pass (``exact_split``, the default budget) from the default
    planner's split: valid, never above that split nor below the optimum over every valid
    split, its lower bound never above the optimum, and a split it calls proven the optimum
    (within its integer costs' rounding)."""
    problem, stages = random_dag(rng)
    chosen, _ = best_split(problem, stages)
    proof = exact_split(problem, stages, chosen.stage_of)
    if not problem.is_valid(proof.stage_of, stages):
        return f"invalid split {proof.stage_of}"
    _, optimum = brute_force(problem, stages)
    got = problem.bottleneck_ms(proof.stage_of, stages)
    slack = REL * optimum + proof.rounding_ms + 1e-12
    if not same(got, proof.bottleneck_ms):
        return f"reported {proof.bottleneck_ms!r}, its split is {got!r}"
    if got < optimum - slack or proof.lower_bound_ms > optimum + slack:
        return f"split {got!r} or bound {proof.lower_bound_ms!r} past the optimum {optimum!r}"
    if got > problem.bottleneck_ms(chosen.stage_of, stages) * (1 + REL):
        return f"exact pass {got!r} worse than the split it was given"
    if proof.proven and got > optimum + slack:
        return f"claims proven ({proof.by}) at {got!r}, the optimum is {optimum!r}"
    gap = got / optimum - 1 if optimum > 0 else 0.0
    if not tally.gaps or gap > max(tally.gaps):
        tally.worst_seed = tally.seed
    tally.gaps.append(gap)
    tally.undecided += not proof.proven
    return None


def random_sequence(rng: random.Random, n: int, devices: int, m: int) -> tuple[SequenceCosts,
                                                                               HybridConfig]:
    """Whole-number costs of ``n`` positions; inference, training with memory free, or under a
    limit that binds; sometimes per-count all-reduce links, a fixed depth."""
    costs = SequenceCosts([float(rng.randint(1, 20)) for _ in range(n)],
                          [float(rng.randint(0, 20)) for _ in range(n)],
                          [float(rng.randint(0, 30)) for _ in range(n)],
                          [float(rng.randint(0, 9)) for _ in range(n)],
                          [0.0, *(float(rng.randint(0, 9)) for _ in range(n - 1)), 0.0])
    kind = rng.choice(["infer", "train", "memory"])
    extra: dict[str, object] = {}
    if kind != "infer" and rng.random() < 0.4:
        extra["group_bytes_per_ms"] = [rng.choice([1.0, 2.0, 8.0]) for _ in range(devices + 1)]
        extra["group_latency_ms"] = [rng.choice([0.0, 0.1]) for _ in range(devices + 1)]
    if rng.random() < 0.2:
        extra["depth"] = rng.randint(1, min(n, devices))
    memory = math.inf
    if kind == "memory":
        memory = 4.0 * sum(costs.param_bytes) / n + rng.uniform(10.0, 60.0)
    config = HybridConfig(devices=devices, microbatches=m, train=kind != "infer",
                          memory_bytes=memory, link_bytes_per_ms=rng.choice([math.inf, 4.0]),
                          link_latency_ms=rng.choice([0.0, 0.2]), **extra)  # type: ignore[arg-type]
    return costs, config


def dp_least(costs: SequenceCosts, config: HybridConfig) -> tuple[float, list]:
    try:
        plans = plan_hybrid(costs, config)
    except PartitionError as error:
        if "no plan fits" not in str(error):
            raise
        return math.inf, []
    return max(s.period_ms for s in plans[0]), plans


def check_hybrid(rng: random.Random, tally: Tally) -> str | None:
    costs, config = random_sequence(rng, rng.randint(1, 5), rng.randint(1, 16),
                                    rng.randint(1, 16))
    got, plans = dp_least(costs, config)
    expected, plan = brute_hybrid(costs, config)
    if not same(got, expected):
        return f"DP {got!r} != brute force {expected!r} (a plan: {plan}); {costs}, {config}"
    for stages in plans:
        bounds = [s.start for s in stages] + [len(costs.forward_ms)]
        memory = plan_memory(costs, config, bounds, tuple(s.replicas for s in stages))
        if max(memory) > config.memory_bytes or sum(s.replicas for s in stages) > config.devices:
            return f"a proposed plan over memory or devices: {stages}; {costs}, {config}"
    return None


def check_judge(rng: random.Random, tally: Tally) -> str | None:
    from onnx_partition.solve.hybrid_judge import judge_hybrid

    costs, config = random_sequence(rng, rng.randint(1, 6), rng.randint(1, 6),
                                    rng.choice([1, 2, 3, 4, 8]))
    got, _ = dp_least(costs, config)
    judged = judge_hybrid(costs, config, time_limit_s=20.0)
    if not judged.optimal:
        tally.undecided += 1
        return None
    if math.isinf(got) or math.isinf(judged.period_ms):
        ok = got == judged.period_ms
    else:
        ok = abs(got - judged.period_ms) <= 1e-9 + judged.tolerance_ms + REL * got
    return None if ok else f"DP {got!r} != judge {judged}; {costs}, {config}"


def check_fleet(rng: random.Random, tally: Tally) -> str | None:
    n = rng.randint(1, 4)
    memory = [rng.choice([None, rng.uniform(2e-6, 4e-5)]) for _ in range(2)]
    fleet = Fleet(groups=(
        GpuGroup("a100-80gb", 1, rng.randint(1, 6), memory[0], Link(rng.uniform(1, 9), 0.01)),
        GpuGroup("v100", 1, rng.randint(1, 4), memory[1], Link(rng.uniform(1, 9), 0.01))),
        inter=Link(rng.choice([0.001, 1.0]), 0.02))
    run = RunSpec(fleet.clusters[0], train=rng.random() < 0.5, microbatches=rng.randint(1, 16))
    fwd = [rng.uniform(0.1, 3.0) for _ in range(n)]
    seq = FleetSequence([fwd, [f * rng.uniform(0.5, 3.0) for f in fwd]],
                        [[2 * f for f in fwd], [4 * f for f in fwd]],
                        [rng.uniform(0, 4e3) for _ in range(n)],
                        [rng.uniform(0, 4e3) for _ in range(n)],
                        [0.0, *(rng.uniform(0, 5e3) for _ in range(n - 1)), 0.0])
    for ordering in [(0, 1), (1, 0)]:
        got, _ = fleet_dp(seq, fleet, run, ordering)
        expected = brute_fleet(seq, fleet, run, ordering)
        if not same(got, expected):
            return f"ordering {ordering}: DP {got!r} != brute force {expected!r}; {seq}, {fleet}"
    return None


KINDS: dict[str, Callable[[random.Random, Tally], str | None]] = {
    "dag-sequence": check_dag_sequence, "dag-planner": check_dag_planner,
    "dag-exact": check_dag_exact, "hybrid": check_hybrid, "judge": check_judge,
    "fleet": check_fleet}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="stop drawing cases after this many seconds (default 540)")
    parser.add_argument("--kind", choices=["all", *KINDS], default="all")
    parser.add_argument("--seed", type=int, default=None,
                        help="base seed (default: a new one from the OS, printed)")
    parser.add_argument("--cases", type=int, default=None, help="stop after this many cases")
    args = parser.parse_args(argv)
    base = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    kinds = list(KINDS) if args.kind == "all" else [args.kind]
    print(f"fuzz_planner: base seed {base}, kinds {', '.join(kinds)}, budget {args.budget_s} s",
          flush=True)
    tallies = {k: Tally() for k in kinds}
    started = time.perf_counter()
    case = 0
    while time.perf_counter() - started < args.budget_s and (args.cases is None
                                                              or case < args.cases):
        kind, seed = kinds[case % len(kinds)], base + case
        tally = tallies[kind]
        tally.seed = seed
        began = time.perf_counter()
        try:
            failure = KINDS[kind](random.Random(seed), tally)
        except Exception as error:
            failure = f"raised {type(error).__name__}: {error}"
        tally.seconds += time.perf_counter() - began
        tally.cases += 1
        if failure:
            tally.failures += 1
            print(f"FAIL {kind} seed {seed}: {failure}\n  replay: python tools/fuzz_planner.py "
                  f"--kind {kind} --seed {seed} --cases 1", flush=True)
        case += 1
    print(f"\n{case} cases in {time.perf_counter() - started:.1f} s (base seed {base})\n")
    print("| kind | cases | failures | undecided | seconds | note |")
    print("|---|---|---|---|---|---|")
    for kind, t in tallies.items():
        note = ""
        if t.gaps:
            worst = max(t.gaps)
            note = (f"planner at the optimum in {sum(g <= 1e-9 for g in t.gaps)} of "
                    f"{len(t.gaps)}, worst gap {100 * worst:.2f}% (seed {t.worst_seed})")
        print(f"| {kind} | {t.cases} | {t.failures} | {t.undecided} | {t.seconds:.1f} | "
              f"{note} |")
    return 1 if any(t.failures for t in tallies.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
