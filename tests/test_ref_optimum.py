"""The operator-level judge (tools/ref_optimum.py) against brute force over every assignment of
a tiny DAG's nodes to stages, its stage windows never excluding a plan within the ceiling, links
free or not; and its Hugging Face zoo (tools/hf_zoo.py) exporting what it names."""

from __future__ import annotations

import importlib.util
import itertools
import random
import subprocess
import sys
from pathlib import Path

import onnx
from hypothesis import example, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str):  # a module loaded from tools/
    sys.path.insert(0, str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module
    spec.loader.exec_module(module)
    return module


ref = _tool("ref_optimum")


def _instance(seed: int, n: int, free: bool):
    """A random DAG of ``n`` nodes: tensor ``t`` made by node ``t - 1`` (tensor 0 the graph
    input), read by up to two later nodes, the last one the graph output."""
    rng = random.Random(seed)
    readers = [[0]] + [sorted(rng.sample(range(p + 1, n), min(rng.randint(1, 2), n - p - 1)))
                       for p in range(n - 1)] + [[]]
    return ref.Instance(
        compute=[rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]) for _ in range(n)],
        producer=list(range(-1, n)), readers=readers, is_output=[False] * n + [True],
        nbytes=[rng.uniform(1e4, 1e6) for _ in range(n + 1)],
        bytes_per_ms=float("inf") if free else 1e6, latency_ms=0.0 if free else 0.01,
        out_bytes=[0.0] * n, reads=[[] for _ in range(n)], init_bytes=[])


def _valid(inst, stages: int) -> list[tuple[int, ...]]:
    """Every assignment with each edge forward and no stage empty."""
    n = len(inst.compute)
    return [a for a in itertools.product(range(stages), repeat=n)
            if set(a) == set(range(stages))
            and all(a[p] <= a[c] for t, p in enumerate(inst.producer) if p >= 0
                    for c in inst.readers[t])]


@settings(max_examples=40, deadline=None)
@example(seed=105362, n=4, stages=2, free=False)  # a bound above the optimum at 2**40
@given(seed=st.integers(0, 10**6), n=st.integers(2, 7), stages=st.integers(1, 3),
       free=st.booleans())
def test_judge_is_brute_force_and_windows_keep_every_plan_within_the_ceiling(seed, n, stages,
                                                                              free):
    inst = _instance(seed, n, free)
    plans = _valid(inst, stages)
    if not plans:
        return
    times = {a: max(ref.stage_times(inst, a, stages)) for a in plans}
    best = min(times.values())
    hint = random.Random(seed).choice(plans)
    ceiling = times[hint]
    for a, bottleneck in times.items():  # the windows bound every plan no slower than the hint
        if bottleneck <= ceiling:
            for i, (lo, hi) in enumerate(ref.windows(inst, stages, ceiling)):
                assert lo <= a[i] <= hi, (a, i, lo, hi)
    for given_hint in (None, list(hint)):
        verdict = ref.judge(inst, stages, time_limit_s=10.0, hint=given_hint)
        assert verdict.optimal
        assert abs(verdict.bottleneck_ms - best) <= 1e-6 * best
        assert verdict.lower_bound_ms <= best * (1 + 1e-9)


def test_the_zoo_exports_a_model_that_loads(tmp_path):
    zoo = _tool("hf_zoo")
    path = zoo.export_zoo("regnet", tmp_path / "regnet.onnx")
    model = onnx.load(str(path))
    assert {n.op_type for n in model.graph.node} >= {"Conv", "Relu"}
    assert sorted(zoo.ZOO)[:2] == ["bert-6", "convnext"]


def test_an_unknown_zoo_model_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "ref_optimum.py"), "--recipes",
                           "--hf", "gpt5"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: no zoo model 'gpt5' (known: " + ", ".join(zoo_names()) + ")"]


def zoo_names() -> list[str]:
    return list(_tool("hf_zoo").ZOO)
