"""The training engine's own work, priced beside the stages' compute: once per step, each
stage's optimizer step and the step's barriers; per hop, a micro-batch's tensors sent over the
process link.

What ``train`` runs besides the stage modules (:mod:`onnx_partition.runtime.train.rank`): after
its last action every rank awaits its sends, sums tied gradients, all-reduces the gradient norm
(a barrier over every rank), steps its optimizer, then all-reduces the step's figures (a second
barrier). So a step ends ``max_k(optimizer_k) + 2 barriers`` after the last rank's last action:
the simulator's per-stage ``step_ms`` (:class:`~onnx_partition.pipeline.simulate.StageCosts`,
plan.json ``simulator_costs.step_ms``). Each hop is a header and the tensors, sent by one process
and received by another (gloo over loopback on CPU): ``send_ms`` per boundary.

**Measured** (``profile --mode train``,
:func:`~onnx_partition.cost.profile.engine.measure_engine`, into the costs file's ``engine``;
``profile --plan``, per stage): the optimizer step (``sgd`` and ``adamw``, as ``train`` makes
them) on the program's parameters with gradients, median of repeats, then per stage in
proportion to its parameter bytes; a tiny all-reduce between two processes (the barrier); and a
ping-pong of a header and a payload between two processes at a few sizes (:data:`HOP_SIZES`),
which prices each hop at its bytes, piecewise linear between them (:func:`hop_ms`).

**Analytic** (nothing measured: a costs file without ``engine``, or the analytic cost model):
the optimizer step moves :data:`BYTES_PER_PARAMETER` bytes per fp32 parameter (read and
written: SGD reads the weight and its gradient and writes the weight, 12 B; AdamW also reads and
writes both moments, 28 B) at the device's memory bandwidth, the accumulation
:data:`ACCUMULATE_BYTES`, and each barrier costs the link's latency; the hops keep the link
model. Never zero in training.

**The engine probe** (``profile --mode train`` on CPU, ``engine.probe``): the engine itself
run on a small two-stage pipeline (:mod:`onnx_partition.runtime.train.probe`) for what the idle
figures above miss: its work per action outside compute and receives (``action_ms``), a barrier
as the step's all-reduces cost it inside the engine (``barrier_ms``) and what a hop costs beyond
the idle ping-pong while both cores compute (``hop_ms``).

**The split backward** (ZB-H1's ``I`` and ``W``, :mod:`onnx_partition.runtime.train.passes`): ``I +
W`` costs more than the whole backward ``B`` by a fixed amount per weight group, not per row: the
graph walk and one ``torch.autograd.backward`` call per group of parameters hanging from the same
nodes of the input path (a linear layer's weight and bias, a layer norm's). A ZB-H1 plan priced by
per-node profiles or analytically (whose ``I`` and ``W`` add up to ``B``) gets ``split_ms`` per
stage but the first (whose ``W`` is one whole backward): :func:`split_groups` of its trainable
tensors times a per-group cost, measured by ``profile --mode train`` (``engine.split_call_ms``:
``(I + W - B) / groups`` on a small stage run as the engine runs it, where the calls are all there
is) or :data:`SPLIT_CALL_MS`; the simulator adds half to each ``I`` and ``W``. ``profile --plan``
times the stages' ``I`` and ``W`` themselves and drops the term.

**The work per action** (:func:`action_ms`): around each action (``F``, ``B``, ``I``, ``W``) a
rank receives headers, copies and posts its sends, stashes and frees graphs, outside the compute
and outside the time blocked in receives (``runtime.train.overheads`` reads it from a run's
spans). Every train plan gets ``simulator_costs.action_ms`` per stage, which the simulator adds
to each action and counts busy: measured where the costs file's ``engine`` has a ``probe`` with
``action_ms`` (the probe's ``barrier_ms`` then prices the step's barriers and its ``hop_ms`` is
added to every hop), else :data:`ACTION_MS` on a CPU and 0 on CUDA (the kernels run
asynchronously: the host's work per action overlaps the device's compute unless the stages are
tiny; not measured here).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onnx_partition.errors import PartitionError
from onnx_partition.plan.extras import EngineCosts

if TYPE_CHECKING:

    from onnx_partition.cost.analytic import DeviceSpec
    from onnx_partition.cost.annotate import CostsFile
    from onnx_partition.plan import Plan
    from onnx_partition.plan.contracts import Link

__all__ = [
    "ACCUMULATE_BYTES",
    "ACTION_MS",
    "BARRIERS_PER_STEP",
    "BYTES_PER_PARAMETER",
    "HOP_SIZES",
    "SPLIT_CALL_MS",
    "EnginePrice",
    "EngineTerms",
    "FleetEngine",
    "action_call_ms",
    "action_ms",
    "analytic_accumulate_ms",
    "analytic_step_ms",
    "engine_price",
    "engine_terms",
    "fit_link",
    "hop_ms",
    "measured_step_ms",
    "on_cuda",
    "price_engine",
    "probe_of",
    "shared_out",
    "split_call_ms",
    "split_groups",
    "split_ms",
    "tied_bytes",
]

#: fp32 bytes an optimizer step reads and writes per parameter (the analytic estimate).
BYTES_PER_PARAMETER = {"sgd": 12.0, "adamw": 28.0}
#: fp32 bytes adding one micro-batch's gradient to the accumulated one moves per parameter
#: (read both, write one: autograd's in-place accumulation).
ACCUMULATE_BYTES = 12.0
#: Collectives every training step ends with: the gradient norm's and the step figures'.
BARRIERS_PER_STEP = 2
#: Payload bytes of the ping-pong (:func:`~onnx_partition.cost.profile.engine.measure_hops`).
HOP_SIZES = (4_096, 65_536, 524_288, 2_097_152, 8_388_608)


#: ms the split backward adds per weight group (one more autograd call and its share of the
#: walk): ``(I + W - B) / groups`` of gpt tiny's middle stages, where compute is negligible
#: (0.035-0.055, ``tools/bench_split_backward.py --size tiny --clock cpu``; the small stage of
#: ``runtime.train.passes.split_call_ms``: 0.031-0.032), one torch thread, the 2-core CPU VM.
SPLIT_CALL_MS = 0.04

#: ms of the engine's own work per action (F, B, I, W) on a CPU rank, outside compute and outside
#: receives ("other action work" + "between actions" over the rank's actions a step,
#: ``tools/bench_train_predicted.py --breakdown --steps 6``, 2 stages, 4 micro-batches x 2 rows):
#: hf-gpt2 under ZB-H1 (12 actions) 0.23 and 0.30, inception under 1F1B (8) 0.25 and 0.26, one
#: torch thread per rank, the 2-core CPU VM quiet but for the run (load 1.8); 0.2-0.4 in the
#: quiet run of docs/benchmarks.md's "Train measured against predicted on a quiet machine".
ACTION_MS = 0.25


def split_groups(tensors: int) -> int:
    """The weight groups of a stage with ``tensors`` trainable tensors, estimated: a weight and
    its bias hang from one node (linear, convolution, layer and batch norm), so half,
    rounded up."""
    return (max(tensors, 0) + 1) // 2


def split_call_ms(costs: CostsFile | None) -> float:
    """ms per weight group of the split backward: the costs file's measured
    ``engine.split_call_ms``, else :data:`SPLIT_CALL_MS`."""
    call = ((costs.body.get("engine") if costs is not None else None) or {}).get("split_call_ms")
    return float(call) if call is not None else SPLIT_CALL_MS


def split_ms(tensors: Sequence[int], per_group_ms: float) -> list[float]:
    """Each stage's split overhead: :func:`split_groups` of its trainable tensors times
    ``per_group_ms``; none for the first stage, which receives no tensor needing a gradient
    (the model's inputs): its ``I`` is empty and its ``W`` one whole backward."""
    return [0.0 if k == 0 else split_groups(n) * per_group_ms for k, n in enumerate(tensors)]


def probe_of(engine: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """A costs file ``engine``'s ``probe`` (the engine's own work timed as ``train`` runs it:
    ``action_ms`` per action, ``barrier_ms`` per barrier, ``hop_ms`` per hop beyond the
    ping-pong), where it is an object with an ``action_ms`` number; else None."""
    probe = (engine or {}).get("probe")
    return probe if isinstance(probe, Mapping) and _number(probe, "action_ms") is not None \
        else None


def _number(probe: Mapping[str, Any] | None, key: str) -> float | None:
    """``probe[key]`` as a float where it is a number, else None."""
    value = (probe or {}).get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def action_ms(engine: Mapping[str, Any] | None, *, cuda: bool) -> tuple[float, str]:
    """(ms of the engine's work per action of every stage, how it was priced): the costs
    file's measured ``engine.probe.action_ms`` (:func:`probe_of`); else :data:`ACTION_MS` on a
    CPU, 0 on CUDA, whose kernels run asynchronously: the host's per-action work (headers,
    posting sends, stashing) overlaps the device's compute unless the stages are tiny (not
    measured here)."""
    probe = probe_of(engine)
    if probe is not None:
        return max(float(probe["action_ms"]), 0.0), (
            "measured: the engine's work per action outside compute and receives "
            "(profile --mode train's probe)")
    if cuda:
        return 0.0, ("analytic: 0 on CUDA, the host's work per action overlapping the "
                     "asynchronous kernels")
    return ACTION_MS, (f"analytic: {ACTION_MS:g} ms per action on a CPU rank (receive "
                       "headers, send copies and posts, stashing, freeing graphs)")


def on_cuda(costs: CostsFile | None, device: DeviceSpec | None) -> bool:
    """Whether a plan is priced for CUDA: ``device``'s kind, else the costs file's device."""
    if device is not None:
        return device.kind == "cuda"
    return costs is not None and str(costs.device or "").startswith("cuda")


def action_call_ms(costs: CostsFile | None, device: DeviceSpec | None) -> float:
    """ms per action the plan will be priced with (:func:`action_ms`), for the planner's choice
    of schedule before :func:`price_engine` writes it."""
    engine = costs.body.get("engine") if costs is not None else None
    return action_ms(engine, cuda=on_cuda(costs, device))[0]


def analytic_step_ms(weights_bytes: Sequence[float], optimizer: str, mem_gbps: float,
                     barrier_ms: float) -> list[float]:
    """Each stage's per-step work with nothing measured: its parameters' optimizer traffic
    (``weights_bytes / 4 x`` :data:`BYTES_PER_PARAMETER`) at ``mem_gbps`` (GB/s, 1e9), plus
    :data:`BARRIERS_PER_STEP` barriers of ``barrier_ms``."""
    if optimizer not in BYTES_PER_PARAMETER:
        raise PartitionError(f"unknown optimizer {optimizer!r}; choose one of "
                             f"{', '.join(BYTES_PER_PARAMETER)}")
    per_byte = BYTES_PER_PARAMETER[optimizer] / 4.0 / (mem_gbps * 1e6)  # ms per weight byte
    return [w * per_byte + BARRIERS_PER_STEP * barrier_ms for w in weights_bytes]


def analytic_accumulate_ms(weights_bytes: Sequence[float], mem_gbps: float) -> list[float]:
    """Each stage's gradient accumulation per micro-batch with nothing measured:
    ``weights_bytes / 4 x`` :data:`ACCUMULATE_BYTES` at ``mem_gbps``."""
    return [w / 4.0 * ACCUMULATE_BYTES / (mem_gbps * 1e6) for w in weights_bytes]


def shared_out(total_ms: float, weights_bytes: Sequence[float], total_bytes: float
               ) -> list[float]:
    """A time measured over ``total_bytes`` of parameters, shared out by each stage's bytes."""
    return [total_ms * w / total_bytes if total_bytes > 0 else 0.0 for w in weights_bytes]


def measured_step_ms(weights_bytes: Sequence[float], optimizer: str,
                     engine: Mapping[str, Any]) -> list[float] | None:
    """Each stage's per-step work from a costs file's ``engine``
    (:func:`~onnx_partition.cost.profile.engine.measure_engine`): the optimizer's measured step
    on ``parameter_bytes`` scaled to the stage's bytes, plus the barriers (each the probe's
    ``barrier_ms`` where :func:`probe_of` finds one: the collective as ``train`` meets it, else
    the two-process ``barrier_ms``); None when the file did not measure ``optimizer``."""
    total = float(engine.get("parameter_bytes") or 0.0)
    step = (engine.get("optimizer_ms") or {}).get(optimizer)
    if step is None or total <= 0:
        return None
    probed = _number(probe_of(engine), "barrier_ms")
    barrier = probed if probed is not None else float(engine.get("barrier_ms") or 0.0)
    return [t + BARRIERS_PER_STEP * barrier
            for t in shared_out(float(step), weights_bytes, total)]


def fit_link(sizes: Sequence[float], one_way_ms: Sequence[float]) -> tuple[float, float]:
    """(latency ms, bandwidth GB/s) summarising a ping-pong: the smallest payload's time, and
    the bytes per ms of the largest step between measured sizes (0, unlimited, where the time
    does not grow); what plan.json and the summary print. Hops are priced by
    :func:`hop_ms`."""
    points = _points(sizes, one_way_ms)
    (x0, y0), (x1, y1) = points[0], points[-1]
    if len(points) > 1:
        x0, y0 = points[-2]
    slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
    return points[0][1], (1.0 / slope / 1e6 if slope > 0 else 0.0)


def hop_ms(nbytes: float, sizes: Sequence[float], one_way_ms: Sequence[float]) -> float:
    """One hop of ``nbytes`` from a ping-pong's one-way times: piecewise linear between the
    measured sizes (the smallest size's time below it, and with one size; the last segment's
    slope beyond the largest), never below 0. A line fitted through all the sizes would let the
    large payloads set the small hops' latency."""
    points = _points(sizes, one_way_ms)
    if nbytes <= points[0][0] or len(points) == 1:
        return points[0][1]
    segment = next((pair for pair in itertools.pairwise(points) if nbytes <= pair[1][0]),
                   (points[-2], points[-1]))
    (x0, y0), (x1, y1) = segment
    return max(y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0), 0.0)


def _points(sizes: Sequence[float], one_way_ms: Sequence[float]) -> list[tuple[float, float]]:
    """The ping-pong's (bytes, ms) by size, one point per size (the later one kept), each time
    at most that of any larger size: more bytes never arrive sooner, so a small payload timed
    slower than a larger one was held up by something else (a busy machine's scheduler)."""
    if not sizes or len(sizes) != len(one_way_ms):
        raise PartitionError("a ping-pong needs as many times as sizes, at least one")
    points = sorted(dict(zip(map(float, sizes), map(float, one_way_ms))).items())
    out: list[tuple[float, float]] = []
    for x, y in reversed(points):
        out.append((x, min(y, out[-1][1]) if out else y))
    return out[::-1]


#: The engine terms each GPU kind prices on its own (a fleet's ``engine_costs`` says each).
_KIND_TERMS = ("step_ms", "accumulate_ms", "action_ms")


@dataclass(frozen=True)
class EngineTerms:
    """The engine work :func:`price_engine` writes into a train plan, as plain numbers a planner
    prices candidate plans with before any plan is written (:func:`engine_terms`): each stage's
    ``step_ms`` and ``accumulate_ms`` are linear in its parameter bytes, ``action_ms`` is per
    action and ``hop_ms`` (the probe's) is added to every hop. ``said``: how each was priced,
    plan.json's ``engine_costs``."""

    step_per_byte: float  # ms of the optimizer step per parameter byte
    step_fixed_ms: float  # ms of the step's barriers
    accumulate_per_byte: float  # ms of a micro-batch's gradient accumulation per byte
    action_ms: float
    hop_ms: float
    said: Mapping[str, str]
    #: ZB-H1's split backward per weight group (:func:`split_ms`)
    split_call_ms: float = SPLIT_CALL_MS
    #: a hop of tied parameters' all-reduce: the measured ping-pong (sizes, one-way ms) where
    #: fitted, else the link's latency and bandwidth
    link_sizes: tuple[float, ...] = ()
    link_one_way_ms: tuple[float, ...] = ()
    link_latency_ms: float = 0.0
    link_gbps: float = 0.0

    def tied_ms(self, nbytes: float) -> float:
        """One hop of ``nbytes`` tied parameters (their all-reduce, added to the step of each
        stage holding them): :func:`hop_ms` of the measured link, else the link model."""
        if not nbytes:
            return 0.0
        if self.link_sizes:
            return hop_ms(nbytes, self.link_sizes, self.link_one_way_ms)
        return self.link_latency_ms + (nbytes / (self.link_gbps * 1e6)
                                       if self.link_gbps > 0 else 0.0)

    def step_ms(self, weights_bytes: Sequence[float]) -> list[float]:
        """Each stage's per-step work: its optimizer step and the barriers."""
        return [w * self.step_per_byte + self.step_fixed_ms for w in weights_bytes]

    def accumulate_ms(self, weights_bytes: Sequence[float]) -> list[float]:
        """Each stage's gradient accumulation per micro-batch (but a replica's first)."""
        return [w * self.accumulate_per_byte for w in weights_bytes]


def engine_terms(costs: CostsFile | None, device: DeviceSpec | None, optimizer: str, *,
                 link: Link | None = None) -> EngineTerms:
    """The engine's terms for a train plan priced by ``costs`` on ``device`` with ``optimizer``
    (unknown: ``adamw``): the step measured (:func:`measured_step_ms`) where the costs file's
    ``engine`` timed the optimizer, else analytic (:func:`analytic_step_ms`, barriers of
    ``link``'s latency, plan.json's ``link``; none: 0.02 ms) on ``device``'s memory bandwidth
    (none: the default GPU's for a costs file measured on CUDA, else the CPU default);
    accumulation likewise; :func:`action_ms`; the probe's ``hop_ms`` (0 without a probe);
    :func:`split_call_ms`; the tied parameters' hop over the ``engine``'s measured link, else
    ``link`` (none: the default :class:`~onnx_partition.plan.contracts.Link`). Both step
    functions are linear in bytes, so they are read at 0 and 1 byte."""
    from onnx_partition.cost.analytic import DeviceSpec
    from onnx_partition.cost.devices import device_for
    from onnx_partition.plan.contracts import Link

    link = link or Link()
    barrier_ms = float(link.latency_ms)

    engine = costs.body.get("engine") if costs is not None else None
    if device is None and costs is not None and (costs.device or "").startswith("cuda"):
        device = device_for("cuda")
    probe = probe_of(engine)
    per_action, action_how = action_ms(engine, cuda=on_cuda(costs, device))
    optimizer = optimizer if optimizer in BYTES_PER_PARAMETER else "adamw"
    spec = device or DeviceSpec.cpu()
    step = measured_step_ms([0.0, 1.0], optimizer, engine) if engine else None
    if step is not None:
        how = (f"measured: {optimizer} step on the program's parameters (profile --mode "
               "train), per stage by parameter bytes, + "
               f"{BARRIERS_PER_STEP} "
               + ("barriers as train meets them (the probe)"
                  if _number(probe, "barrier_ms") is not None else "two-process barriers"))
    else:
        step = analytic_step_ms([0.0, 1.0], optimizer, spec.mem_gbps, barrier_ms)
        how = (f"analytic: {BYTES_PER_PARAMETER[optimizer]:g} B per parameter ({optimizer}) at "
               f"{spec.mem_gbps:g} GB/s ({spec.name}) + {BARRIERS_PER_STEP} barriers at the "
               f"link's latency {barrier_ms:g} ms")
    said = {"step_ms": how}
    if engine and engine.get("accumulate_ms") is not None:
        accumulate = shared_out(float(engine["accumulate_ms"]), [1.0],
                                float(engine.get("parameter_bytes") or 0.0))[0]
        said["accumulate_ms"] = ("measured: in-place gradient adds over the program's "
                                 "parameters, per stage by parameter bytes")
    else:
        accumulate = analytic_accumulate_ms([1.0], spec.mem_gbps)[0]
        said["accumulate_ms"] = (f"analytic: {ACCUMULATE_BYTES:g} B per parameter at "
                                 f"{spec.mem_gbps:g} GB/s ({spec.name})")
    said["action_ms"] = action_how
    hop = _number(probe, "hop_ms")
    fitted = (engine or {}).get("link") or {}
    return EngineTerms(step[1] - step[0], step[0], accumulate, per_action, hop or 0.0, said,
                       split_call_ms=split_call_ms(costs),
                       link_sizes=tuple(float(x) for x in fitted.get("sizes", ())),
                       link_one_way_ms=tuple(float(x) for x in fitted.get("one_way_ms", ())),
                       link_latency_ms=float(link.latency_ms),
                       link_gbps=float(link.bandwidth_gbps))


@dataclass(frozen=True)
class FleetEngine:
    """A mixed fleet's train plan's engine work (cluster@2 ``groups``), per stage priced on its
    own GPU kind's :class:`EngineTerms` (a stage whose replicas span two kinds, each term the
    larger: its replicas meet at the step): the planner's yardstick
    (:func:`~onnx_partition.solve.fleet.score_fleet`) and :func:`price_engine`'s figures, one
    computation."""

    step_ms: list[float]
    accumulate_ms: list[float]
    split_ms: list[float]  # ZB-H1's split backward; zeros under other schedules
    action_ms: list[float]
    hop_ms: list[float]  # per boundary: the larger of its two stages' kinds' work per hop

    @classmethod
    def of(cls, terms: Sequence[Sequence[EngineTerms]], weights_bytes: Sequence[float], *,
           tied: Sequence[float] | None = None, tensors: Sequence[int] | None = None,
           split: bool = False) -> FleetEngine:
        """Stage ``k`` runs on the kinds ``terms[k]`` holding ``weights_bytes[k]`` (``tied``:
        its bytes tied to another stage, all-reduced at the step, :func:`tied_bytes`;
        ``tensors``: its trainable tensors, for ZB-H1's split backward when ``split``)."""
        count = len(terms)
        tied = tied if tied is not None else [0.0] * count
        step = [max(t.step_ms([w])[0] + t.tied_ms(b) for t in ts)
                for ts, w, b in zip(terms, weights_bytes, tied, strict=True)]
        accumulate = [max(t.accumulate_ms([w])[0] for t in ts)
                      for ts, w in zip(terms, weights_bytes, strict=True)]
        splits = ([0.0 if k == 0 else split_groups(int(n)) * max(t.split_call_ms for t in ts)
                   for k, (ts, n) in enumerate(zip(terms, tensors, strict=True))]
                  if split and tensors is not None else [0.0] * count)
        return cls(step, accumulate, splits, [max(t.action_ms for t in ts) for ts in terms],
                   [max(t.hop_ms for t in (*here, *there))
                    for here, there in itertools.pairwise(terms)])


def tied_bytes(initializers: Sequence[Collection[str]], nbytes: Mapping[str, float],
               trainable: Collection[str] | None) -> list[float]:
    """Per stage, the bytes of its trainable parameters that another stage also holds (a tied
    weight, GPT-2's embedding and head: each rank keeps a copy, and ``train`` all-reduces their
    gradients over the holders every step); ``initializers`` per stage, ``nbytes`` per name;
    none without ``trainable`` (no program: nothing trains)."""
    if trainable is None:
        return [0.0] * len(initializers)
    seen: dict[str, int] = {}
    for names in initializers:
        for name in set(names):
            seen[name] = seen.get(name, 0) + 1
    return [float(sum(nbytes.get(n, 0.0) for n in set(names)
                      if seen[n] > 1 and n in trainable)) for names in initializers]


@dataclass(frozen=True)
class EnginePrice:
    """A train plan's engine work as plan.json states it: the per-stage (per-boundary for
    ``send_ms``) figures it sets in ``simulator_costs`` (``costs``: ``step_ms``,
    ``accumulate_ms``, ``send_ms`` where re-priced, ``split_ms`` under ZB-H1, ``action_ms``,
    in that order) and how each was priced (``said``: plan.json's ``engine_costs``)."""

    costs: dict[str, list[float]]
    said: dict[str, str]


def engine_price(*, costs: CostsFile | None, device: DeviceSpec | None, optimizer: str,
                 link: Link | None, weights: Sequence[float],
                 hop_bytes: Sequence[float] | None, send_ms: Sequence[float] | None,
                 schedule: str | None, tied: Sequence[float] | None = None,
                 tensors: Sequence[int] | None = None,
                 kinds: Mapping[str, EngineTerms] | None = None,
                 gpus: Sequence[str | None] = ()) -> EnginePrice:
    """Price a train plan's engine work from its figures, before the plan is built: each
    stage's parameter bytes (``weights``), each boundary's ``hop_bytes`` and ``send_ms`` as
    the plan states them before this pricing, its ``schedule`` and ``optimizer``, the plan's
    ``link`` (plain pipelines; None on a cluster): ``step_ms`` per stage (measured from the
    costs file's ``engine``, :func:`~onnx_partition.cost.profile.engine.measure_engine`,
    where it has the plan's optimizer; else analytic on ``device``'s memory bandwidth:
    without one, the default GPU's for a costs file measured on CUDA, else the CPU default)
    and, where ``engine`` fitted a link and ``hop_bytes`` has one entry per boundary,
    ``send_ms`` per boundary at those bytes; ``accumulate_ms`` per stage likewise; a stage
    holding ``tied`` bytes (per stage, :func:`tied_bytes`) adds one hop of them to its
    ``step_ms`` for their all-reduce, priced as the hops are; a ZB-H1 plan with ``tensors``
    (per stage, its trainable tensors) gets ``split_ms`` (:func:`split_ms`, per group the
    costs file's ``split_call_ms`` or :data:`SPLIT_CALL_MS`); every train plan gets
    ``action_ms`` per stage (:func:`action_ms`: the probe's, else :data:`ACTION_MS` on a CPU,
    0 on CUDA). Where ``engine`` has a probe (:func:`probe_of`), its ``barrier_ms`` is each
    barrier of the measured ``step_ms`` and its ``hop_ms`` is added to every ``send_ms`` (to
    be priced once: a plan as ``partition`` writes it; sends priced from the measured link are
    priced afresh each time). A mixed fleet's plan (``kinds``: each GPU kind's terms,
    :func:`engine_terms` of its own costs file or device) prices each stage on the kinds of
    its entry of ``gpus`` (:class:`FleetEngine`, as its planner did), its sends on the
    fleet's links plus each boundary's work per hop."""
    if kinds is not None:
        return _fleet_engine_price(kinds, weights, send_ms, schedule, tied, tensors, gpus)
    engine = costs.body.get("engine") if costs is not None else None
    out: dict[str, list[float]] = {}
    terms = engine_terms(costs, device, optimizer, link=link)
    step = terms.step_ms(weights)
    said = dict(terms.said)
    fitted = (engine or {}).get("link")
    if tied and any(tied):
        step = [t + terms.tied_ms(b) for t, b in zip(step, tied, strict=True)]
        said["step_ms"] += "; + one hop of the parameters tied across stages (their all-reduce)"
    out["step_ms"] = [round(x, 6) for x in step]
    out["accumulate_ms"] = [round(x, 6) for x in terms.accumulate_ms(weights)]
    sends = send_ms
    if fitted and isinstance(hop_bytes, list) and len(hop_bytes) == len(weights) - 1:
        sizes, times = fitted["sizes"], fitted["one_way_ms"]
        sends = out["send_ms"] = [round(hop_ms(float(b), sizes, times), 6) for b in hop_bytes]
        said["send_ms"] = (f"measured: gloo ping-pong between two processes (profile --mode "
                           f"train), {fitted['latency_ms']:g} ms at {sizes[0]} B, piecewise "
                           "linear in the hop's bytes")
    else:
        said["send_ms"] = "the plan's link model"
    if _number(probe_of(engine), "hop_ms") is not None and isinstance(sends, list):
        out["send_ms"] = [round(float(x) + terms.hop_ms, 6) for x in sends]
        said["send_ms"] += f", + {terms.hop_ms:g} ms of the engine's work per hop (the probe)"
    if schedule == "zb-h1" and tensors is not None and len(tensors) == len(weights):
        call = (engine or {}).get("split_call_ms")
        per_group = terms.split_call_ms
        out["split_ms"] = [round(x, 6) for x in split_ms(tensors, per_group)]
        said["split_ms"] = (("measured: " if call is not None else "analytic: ")
                            + f"{per_group:g} ms per weight group (half the stage's trainable "
                            "tensors), the split backward's walk and autograd calls"
                            + (" (profile --mode train)" if call is not None else ""))
    out["action_ms"] = [round(terms.action_ms, 6)] * len(weights)
    return EnginePrice(out, said)


def _fleet_engine_price(kinds: Mapping[str, EngineTerms], weights: Sequence[float],
                        send_ms: Sequence[float] | None, schedule: str | None,
                        tied: Sequence[float] | None, tensors: Sequence[int] | None,
                        gpus: Sequence[str | None]) -> EnginePrice:
    """:func:`engine_price` for a fleet's plan: each stage by its kinds' terms."""
    out: dict[str, list[float]] = {}
    terms = [[kinds[k] for k in str(g).split("+")] for g in gpus]
    zb = schedule == "zb-h1" and tensors is not None and len(tensors) == len(weights)
    work = FleetEngine.of(terms, weights, tied=tied if tied and any(tied) else None,
                          tensors=tensors, split=zb)
    out["step_ms"] = [round(x, 6) for x in work.step_ms]
    out["accumulate_ms"] = [round(x, 6) for x in work.accumulate_ms]
    said: dict[str, str] = {"send_ms": "the fleet's links"}
    if zb:
        out["split_ms"] = [round(x, 6) for x in work.split_ms]
        said["split_ms"] = ("each stage on its GPU kind: per weight group (half the stage's "
                            "trainable tensors) " + "; ".join(
                                f"{kind}: {t.split_call_ms:g} ms" for kind, t in kinds.items()))
    out["action_ms"] = [round(x, 6) for x in work.action_ms]
    if any(work.hop_ms) and isinstance(send_ms, list):
        out["send_ms"] = [round(float(x) + h, 6) for x, h in zip(send_ms, work.hop_ms)]
        said["send_ms"] += ", + each boundary's engine work per hop (its kinds' probes)"
    for what in ("step_ms", "accumulate_ms", "action_ms"):
        said[what] = "each stage on its GPU kind: " + "; ".join(
            f"{kind}: {t.said.get(what, '')}" for kind, t in kinds.items())
    if tied and any(tied):
        said["step_ms"] += "; + one hop of the parameters tied across stages (their all-reduce)"
    return EnginePrice(out, said)


def price_engine(plan: Plan, *, costs: CostsFile | None, device: DeviceSpec | None,
                 tied: Sequence[float] | None = None,
                 tensors: Sequence[int] | None = None,
                 kinds: Mapping[str, EngineTerms] | None = None) -> None:
    """:func:`engine_price` of a train plan already built (one read back, re-priced), written
    into it: its ``simulator_costs`` and ``engine_costs``. ``partition`` prices the engine
    before it builds the plan instead. Inference plans are left alone."""
    if plan.mode != "train":
        return
    sim = plan.simulator_costs
    priced = engine_price(
        costs=costs, device=device, optimizer=plan.optimizer or "adamw", link=plan.link,
        weights=[float((s.predicted.weights_bytes if s.predicted else 0) or 0)
                 for s in plan.stages],
        hop_bytes=sim.hop_bytes, send_ms=sim.send_ms, schedule=plan.schedule, tied=tied,
        tensors=tensors, kinds=kinds, gpus=[s.gpu for s in plan.stages])
    for key, value in priced.costs.items():
        setattr(sim, key, value)
    plan.simulator_costs = sim
    plan.engine_costs = EngineCosts.given(priced.said)
