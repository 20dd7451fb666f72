"""The hybrid cost model of one stage, written once: ring all-reduce time, micro-batches in
flight, and memory per device.

Every tool that states a stage's memory or all-reduce time calls these functions: the hybrid
DP (:mod:`onnx_partition.solve.hybrid`, through :func:`held_in_front` for its tables), the
scorer (:mod:`onnx_partition.solve.scoring`), the planner (:mod:`onnx_partition.solve.planner`),
the event simulator (:mod:`onnx_partition.pipeline.simulate`, which counts in-flight
micro-batches from the actions it plays and prices them with :func:`device_bytes`),
``simulate``/``report`` (through the plan's ``simulator_costs``) and ``partition``'s table
(``predicted.memory_bytes``).

**Memory of a device** holding one replica of a stage::

    memory = static + held * stash
    static = W + (optimizer_factor - 1) * P + G
                                          (train: weights, the gradients and optimizer state of
                                           the trainable ones, and the receive buffer of one
                                           gradient micro-batch)
           = W                            (infer)
    stash  = A + R                        (per micro-batch: the stage's own activations and
                                           the activations it received, both kept for backward)

``W`` the bytes of every initializer the stage holds (constants and buffers take memory too;
a tied parameter in each stage that reads it), ``P`` those of its trainable parameters (the
program's parameters: only they have gradients and optimizer state; ``P = W`` where the
trainable ones are not known), ``A`` the stage's activation bytes per micro-batch (train plans of a
model with a program: the bytes autograd saves for backward, :mod:`onnx_partition.cost.saved`;
otherwise the bytes of its operators' outputs), ``R`` bytes the
stage receives per micro-batch (every tensor crossing its input boundary, relay model: what
it reads and what it relays on, :func:`~onnx_partition.pipeline.layout.relay_names`; stage
0's are the graph inputs of the micro-batch some node reads, which rank 0 holds until its
backward), ``G`` bytes it sends per micro-batch, relayed tensors included (the gradients of
those come back). ``held`` is the number of
micro-batches whose activations the device holds at its peak: :func:`peak_inflight`.

**Sharded optimizer state** (``partition --shard-optimizer``, ZeRO stage 1: Rajbhandari et al.,
SC 2020): a stage on ``r`` replicas keeps ``1 / r`` of its optimizer state on each (the
``optimizer_factor - 2`` copies of ``P``: AdamW's two moments, SGD's momentum, fp32 master
weights where they are kept), so::

    static = W + P + (optimizer_factor - 2) * P / r + G     (shard "optimizer")

:func:`optimizer_state` is that term, the one place it is written; ``r = 1`` or shard
``none`` is the formula above. The gradients' all-reduce becomes a reduce-scatter (each
replica's shard of the summed gradients) and, after the sharded step, an all-gather of the
updated parameters: on a ring the same ``2 (r - 1) / r * P`` bytes per device in the same
``2 (r - 1)`` steps as the all-reduce, so :func:`ring_allreduce_ms` prices both.

**Micro-batches in flight under 1F1B with replicas.** The schedule
(:func:`onnx_partition.pipeline.schedules.one_f_one_b`) gives stage ``s`` a *global* warm-up of
``W_s = min(sum(step_k for k in s..p-2), M)`` forwards, then alternates one forward and one
backward, and hands micro-batch ``m`` to replica ``m % d_s``. ``step_k`` is what boundary
``k`` adds: ``max(d_k, d_k+1)`` when one replica count divides the other (then replica ``j``
of the larger stage always talks to the same replica of the smaller one: with equal counts
every replica runs Megatron's 1F1B on its own micro-batches, warm-up ``p - s - 1`` of them),
else ``d_k + d_k+1 - 1`` (round-robin misaligns the replicas; checked by simulation to keep
the pipeline full). Replica ``j``'s actions are those of micro-batches ``m = j (mod d_s)``:
between the forward of ``m`` and its backward the stage runs the forwards of ``m .. m + W_s``,
a window of ``min(W_s + 1, M)`` consecutive micro-batches, of which at most
``ceil(min(W_s + 1, M) / d_s)`` are replica 0's (the most of any replica). So the peak per
device of stage ``s``::

    held = ceil(min(W_s + 1, M) / d_s)    (1F1B; no replicas: min(p - s, M), Narayanan 2021)
         = ceil(min(W_0 + 1, M) / d_s)    (ZB-H1: a micro-batch is held from F to its W, which
                                           stage s defers by W_0 - W_s; no replicas: min(p, M))
         = ceil(M / d_s)                  (GPipe: every micro-batch of the replica)
         = 1                              (inference: the micro-batch being computed)

The simulator counts the same number from the actions it runs; the property tests assert
both agree for every stage. :func:`held_in_front` is the same closed form over arrays (a stage
of each replica count in front of each suffix), which the hybrid DP's tables use.

**What ZB-H1 keeps from I to W.** A stage's input pass ``I`` keeps, for its weight pass ``W``,
the gradient that reached each *frontier* op (one reading both a weight and an activation: a
linear's ``dY``, a layer norm's; :func:`onnx_partition.runtime.train.passes.input_pass`), ``K``
bytes per micro-batch (:func:`onnx_partition.cost.saved.kept_gradient_bytes`, from the same run
that counts ``A``; a stage with no received activation, the first, runs its whole backward in
``W`` and keeps none). Stage ``s`` defers ``D_s = W_0 - W_s`` of its W passes, so right after
an ``I`` it keeps ``1 + D_s`` of them (over ``d`` replicas ``ceil((1 + D_s) / d)``, at most the
micro-batches it holds), at the moment it holds its most micro-batches::

    memory = static + held * stash + kept * K     (ZB-H1; kept = 0 under any other schedule)

:func:`kept_held` is ``kept``. On gpt tiny's last stage ``K`` is 131,072 B per micro-batch, the
sum of what the input pass keeps there.

**The backward's working set.** While an op's backward runs, the gradient of its output (arriving)
and those of its activation inputs (produced) are live beside everything stashed: ``T_u`` bytes
for op ``u``, its floating outputs and floating activation inputs that require grad
(:func:`onnx_partition.cost.saved.working_gradient_bytes`, from the same run that counts ``A``;
weights' gradients are in ``static``). The backward runs one op at a time, so a stage adds
the largest, ``T = max_u T_u`` (not a sum); the loss's log-softmax is the widest of a language
model's last stage, two logits-sized gradients beside the output it saved::

    memory = static + T + held * stash [+ kept * K]     (training; T = 0 in inference)

Under ZB-H1 the ``I`` running the widest op holds it beside every kept gradient, its own
micro-batch's ``K`` included, so the term is ``T`` there too (:func:`working_term`): an upper
bound, the widest op's own kept gradient counted twice where it is one (the logits' ``dY``);
unet's last stage measured 1.16x a plan that took ``max(0, T - K)``, a Concat's 4.2 MB split
gradient beside 2 x 5.6 MB kept.

**Recomputation** (activation checkpointing at stage granularity, Chen et al. 2016; chosen
per stage as AdaPipe and Mist do): a recomputing stage keeps only what it received, ``R``,
per micro-batch in flight, and runs its forward again at the start of its backward, so it
holds one micro-batch's activations ``A`` at a time::

    memory = static + T + A + held * R    (recompute; time: one more forward per backward)

Under ZB-H1 a recomputing stage holds the rebuilt activations from its ``I`` to its ``W``, so
up to ``1 + D_s`` of them (``D_s = W_0 - W_s`` deferred W passes): ``static + min(1 + D_s,
held) * A + held * R``. :func:`recompute_choice` is the planner's per-stage option: a stage
recomputes (``auto``) only when it does not fit otherwise and does with it.

**Ring all-reduce** of ``W`` gradient bytes over ``r`` replicas (Patarasuk and Yuan, JPDC
2009; PipeDream's replicated-stage model): ``2 (r - 1) / r * W / bandwidth + 2 (r - 1) *
latency`` (reduce-scatter then all-gather, ``r - 1`` steps each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "CLOSED_FORMS",
    "RECOMPUTE_MODES",
    "SHARD_MODES",
    "Num",
    "StageBytes",
    "boundary_step",
    "check_recompute",
    "device_bytes",
    "held_in_front",
    "kept_held",
    "memory_parts",
    "memory_per_device",
    "one_f_one_b_warmups",
    "optimizer_state",
    "peak_inflight",
    "rebuilt_held",
    "recompute_choice",
    "ring_allreduce_ms",
    "stage_working",
    "stash_bytes",
    "static_bytes",
    "working_term",
]

#: ``partition --recompute``: per stage where needed (auto), never, every stage.
RECOMPUTE_MODES = ("auto", "none", "all")

#: ``plan.json``'s ``stages[i].shard``: each replica holds all of its optimizer state, or
#: ``1 / r`` of it (``partition --shard-optimizer``).
SHARD_MODES = ("none", "optimizer")

#: Schedules whose in-flight count :func:`peak_inflight` knows.
CLOSED_FORMS = ("1f1b", "zb-h1", "gpipe", "infer")

Num = TypeVar("Num", float, "np.ndarray")  # numpy imported by the vectorised callers only


def ring_allreduce_ms(nbytes: Num, replicas: int, bytes_per_ms: float,
                      latency_ms: float) -> Num:
    """Time of a ring all-reduce of ``nbytes`` among ``replicas`` devices (0 for one);
    ``nbytes`` may be an array (the hybrid DP prices every stage at once)."""
    if replicas <= 1:
        return nbytes * 0.0
    return 2.0 * (replicas - 1) / replicas * nbytes / bytes_per_ms + 2.0 * (replicas - 1) * (
        latency_ms)


def boundary_step(before: int, after: int) -> int:
    """Micro-batches boundary ``before -> after`` (replica counts) adds to the warm-up of every
    stage up to it: ``max`` when one count divides the other, else ``before + after - 1``."""
    if before % after == 0 or after % before == 0:
        return max(before, after)
    return before + after - 1


def one_f_one_b_warmups(replicas: Sequence[int], microbatches: int) -> list[int]:
    """Global warm-up forwards of each stage under 1F1B: ``min(sum of steps after it, M)``."""
    warm, out = 0, [0] * len(replicas)
    for s in range(len(replicas) - 1, -1, -1):
        if s < len(replicas) - 1:
            warm += boundary_step(replicas[s], replicas[s + 1])
        out[s] = min(warm, microbatches)
    return out


def held_in_front(replicas: np.ndarray, next_replicas: np.ndarray, next_warmup: np.ndarray,
                  microbatches: int, *, last: bool) -> tuple[np.ndarray, np.ndarray]:
    """The 1F1B closed form for many stages at once (the hybrid DP's tables): a stage of
    ``replicas[c]`` replicas in front of a suffix whose first stage has ``next_replicas[j]``
    replicas and global warm-up ``next_warmup[j]`` (``last``: the stage ends the pipeline, no
    suffix). Returns ``(held[c, j], steps[c, j])`` as int64: the micro-batches the fullest
    replica holds (:func:`peak_inflight`'s ``ceil(min(W + 1, M) / d)``) and the warm-up its
    boundary adds (:func:`boundary_step`), so the stage's own warm-up is
    ``min(steps + next_warmup, M)`` (:func:`one_f_one_b_warmups`)."""
    m = microbatches
    import numpy as np

    r = np.asarray(replicas, dtype=np.int64)[:, None]
    nxt = np.asarray(next_replicas, dtype=np.int64)
    if last:
        steps = np.zeros((len(r), len(nxt)), dtype=np.int64)
    else:
        after = np.maximum(nxt, 1)[None, :]
        divides = (r % after == 0) | (after % r == 0)
        steps = np.where(divides, np.maximum(r, after), r + after - 1)
    warmup = np.minimum(steps + np.asarray(next_warmup, dtype=np.int64)[None, :], m)
    return -(-np.minimum(warmup + 1, m) // r), steps


def peak_inflight(schedule: str, replicas: Sequence[int], microbatches: int) -> list[int]:
    """Micro-batches whose activations the fullest replica of each stage holds at once (see
    the module docstring): ``1f1b``, ``zb-h1``, ``gpipe`` or ``infer``."""
    m = microbatches
    if schedule == "infer":
        return [1 if m > 0 else 0] * len(replicas)
    if schedule == "gpipe":
        return [-(-m // d) for d in replicas]
    if schedule not in ("1f1b", "zb-h1"):
        raise ValueError(f"no closed form for schedule {schedule!r}; use one of {CLOSED_FORMS}")
    warm = one_f_one_b_warmups(replicas, m)
    if schedule == "zb-h1":
        warm = [warm[0] if warm else 0] * len(warm)
    return [-(-min(w + 1, m) // d) for w, d in zip(warm, replicas, strict=True)]


@dataclass(frozen=True)
class StageBytes:
    """What one stage holds, in bytes: its initializers (``params``: weights, constants and
    buffers), its operators' outputs per micro-batch, what it receives per micro-batch (input
    boundary), what it sends (output boundary), of ``params`` the trainable ones
    (``trainable``: with gradients and optimizer state; None: all of them), and the output
    gradients ZB-H1 keeps per micro-batch from ``I`` to ``W`` (``kept``, ``K``), and the most
    gradient bytes live in the backward of one of its ops (``working``, ``T``; training)."""

    params: float
    activations: float
    received: float = 0.0
    sent: float = 0.0
    trainable: float | None = None
    kept: float = 0.0
    working: float = 0.0

    @property
    def trained(self) -> float:
        """Bytes of the parameters that have gradients and optimizer state."""
        return self.params if self.trainable is None else self.trainable


def optimizer_state(trained: Num, optimizer_factor: float, replicas: int = 1,
                    shard: str = "none") -> Num:
    """Bytes of optimizer state one device holds for ``trained`` parameter bytes: the
    ``optimizer_factor - 2`` copies beyond the weights and gradients, ``1 / replicas`` of
    them when ``shard`` is ``optimizer`` (ZeRO-1)."""
    state = (optimizer_factor - 2.0) * trained
    return state / replicas if shard == "optimizer" and replicas > 1 else state


def static_bytes(stage: StageBytes, *, train: bool, optimizer_factor: float,
                 replicas: int = 1, shard: str = "none") -> float:
    """Bytes held whatever the schedule: weights (+ the trainable ones' gradients and
    optimizer state, ``1 / replicas`` of the state when ``shard`` is ``optimizer``, and one
    gradient receive buffer in training)."""
    shed = 0.0  # the state the other replicas hold (nothing unsharded: the figures unchanged)
    if train and shard == "optimizer" and replicas > 1:
        full = optimizer_state(stage.trained, optimizer_factor)
        shed = full - optimizer_state(stage.trained, optimizer_factor, replicas, shard)
    if train and stage.trainable is None:  # every parameter trained
        return optimizer_factor * stage.params + stage.sent - shed
    if train:
        return stage.params + (optimizer_factor - 1.0) * stage.trained + stage.sent - shed
    return stage.params


def stash_bytes(stage: StageBytes, recompute: bool = False) -> float:
    """Bytes held per micro-batch in flight: own activations plus received inputs (only the
    received inputs when the stage recomputes)."""
    return stage.received if recompute else stage.activations + stage.received


def kept_held(schedule: str, replicas: Sequence[int], microbatches: int) -> list[int]:
    """Micro-batches between an ``I`` and its ``W`` on the fullest replica of each stage at its
    peak: under ZB-H1 ``ceil((1 + W_0 - W_s) / d_s)``, at most the micro-batches it holds;
    0 under any other schedule (no ``I``)."""
    if schedule != "zb-h1":
        return [0] * len(replicas)
    held = peak_inflight(schedule, replicas, microbatches)
    warm = one_f_one_b_warmups(replicas, microbatches)
    return [min(-(-(1 + warm[0] - w) // d), h)
            for w, h, d in zip(warm, held, replicas, strict=True)]


def rebuilt_held(schedule: str, replicas: Sequence[int], microbatches: int) -> list[int]:
    """Micro-batches whose activations a recomputing stage holds rebuilt at once: one, but
    under ZB-H1 those between an ``I`` and its deferred ``W`` too (:func:`kept_held`)."""
    if schedule == "zb-h1":
        return kept_held(schedule, replicas, microbatches)
    return [min(1, h) for h in peak_inflight(schedule, replicas, microbatches)]


def working_term(working: Num, schedule: str) -> Num:
    """The backward's working set a stage adds to its peak (module docstring): ``T`` in
    training, under ZB-H1 too (beside the kept gradients, its ``I``'s own included); 0 in
    inference. Arrays or numbers."""
    if schedule == "infer":
        return working * 0.0
    return working


def stage_working(stage: StageBytes, schedule: str) -> float:
    """:func:`working_term` of one stage."""
    return float(working_term(stage.working, schedule))


def device_bytes(static: Num, stash: Num, held: Num | int) -> Num:
    """``static + held * stash``: the one memory formula (the simulator calls it too)."""
    return static + held * stash


def memory_per_device(
    stages: Sequence[StageBytes], replicas: Sequence[int], microbatches: int, *,
    schedule: str, optimizer_factor: float = 4.0, recompute: Sequence[bool] | None = None,
    shard: str = "none",
) -> list[float]:
    """Peak bytes on the fullest device of each stage of a plan with these replica counts,
    under ``schedule`` (``1f1b``, ``zb-h1``, ``gpipe`` or ``infer``), the stages flagged in
    ``recompute`` keeping only their inputs: the figure the planner checks against the device
    memory, ``partition`` prints and plan.json stores (``shard``: :data:`SHARD_MODES`); under
    ZB-H1 with the gradients kept from ``I`` to ``W`` (:func:`kept_held` of ``kept``); in
    training with the backward's working set (:func:`working_term`)."""
    train = schedule != "infer"
    held = peak_inflight(schedule, replicas, microbatches)
    flags = list(recompute) if recompute is not None and train else [False] * len(stages)
    rebuilt = rebuilt_held(schedule, replicas, microbatches) if any(flags) else held
    kept = kept_held(schedule, replicas, microbatches)
    return [float(device_bytes(static_bytes(s, train=train, optimizer_factor=optimizer_factor,
                                            replicas=r, shard=shard),
                               stash_bytes(s, rc), h) + (b * s.activations if rc else 0.0)
                  + g * s.kept + stage_working(s, schedule))
            for s, h, rc, b, r, g in zip(stages, held, flags, rebuilt, replicas, kept,
                                         strict=True)]


def check_recompute(mode: str) -> str:
    """``mode`` if it is one of :data:`RECOMPUTE_MODES` (a ValueError otherwise): the one check
    of every solver that takes a recompute mode."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
    return mode


def recompute_choice(
    stages: Sequence[StageBytes], replicas: Sequence[int], microbatches: int, *,
    schedule: str, memory_bytes: float, mode: str = "auto", optimizer_factor: float = 4.0,
    shard: str = "none",
) -> list[bool]:
    """Which stages recompute: none, all, or (``auto``) each stage that is over
    ``memory_bytes`` keeping its activations and within it keeping only its inputs (memory
    down, one more forward per backward). Inference never recomputes."""
    if check_recompute(mode) == "none" or schedule == "infer":
        return [False] * len(stages)
    if mode == "all":
        return [True] * len(stages)
    kept = memory_per_device(stages, replicas, microbatches, schedule=schedule,
                             optimizer_factor=optimizer_factor, shard=shard)
    rebuilt = memory_per_device(stages, replicas, microbatches, schedule=schedule,
                                optimizer_factor=optimizer_factor,
                                recompute=[True] * len(stages), shard=shard)
    return [k > memory_bytes >= r for k, r in zip(kept, rebuilt, strict=True)]


def memory_parts(stage: StageBytes, held: int, *, train: bool,
                 optimizer_factor: float = 4.0, rebuilt: int | None = None,
                 replicas: int = 1, shard: str = "none", kept: int = 0,
                 working: float = 0.0) -> dict[str, int]:
    """:func:`device_bytes` of one stage in its parts (plan.json's per-stage ``predicted``):
    weights, the trainable ones' gradients and optimizer state (``optimizer_factor - 2`` copies:
    Adam's two moments at the default 4), activations per micro-batch, micro-batches in flight,
    and the buffers (received inputs of those in flight, one gradient receive buffer); and
    ``memory_bytes``, their sum, the one formula's peak. A recomputing stage (``rebuilt``: the
    micro-batches whose activations it holds rebuilt at once, :func:`rebuilt_held`) counts those
    as ``inflight``; its buffers still hold the inputs of all ``held``. A stage sharding its
    optimizer state over ``replicas`` (``shard``) counts its own ``1 / replicas`` of it. Under
    ZB-H1 the buffers hold the output gradients of the ``kept`` micro-batches between an ``I``
    and its ``W`` too (:func:`kept_held`; they grow with the rows, as received inputs do), and
    in training the backward's ``working`` set (:func:`stage_working`: the schedule's)."""
    static = static_bytes(stage, train=train, optimizer_factor=optimizer_factor,
                          replicas=replicas, shard=shard)
    weights = stage.params
    grads = stage.trained if train else 0.0
    optimizer = static - stage.sent - weights - grads if train else 0.0
    buffers = ((stage.sent + working if train else 0.0) + held * stage.received
               + kept * stage.kept)
    acts = held if rebuilt is None else rebuilt
    return {"weights_bytes": int(weights), "grad_bytes": int(grads),
            "optimizer_bytes": int(optimizer), "activation_bytes": int(stage.activations),
            "inflight": int(acts), "buffer_bytes": int(buffers),
            "memory_bytes": int(device_bytes(static, stash_bytes(stage, rebuilt is not None),
                                             held) + acts * stage.activations * (
                                                 rebuilt is not None) + kept * stage.kept
                                    + (working if train else 0.0))}
