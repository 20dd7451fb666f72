"""Point-to-point transfer of named torch tensors between training ranks.

Per hop and micro-batch: the int64 header of :mod:`onnx_partition.runtime.wire` (micro-batch,
count, dtype and shape per tensor; none for gradients, whose receiver knows their shapes: a
message less per backward hop, 77 -> 50 ms per step of gpt tiny on two loaded cores), then
each non-empty tensor as its own message, straight from and into torch tensors on the
communication device (no host round trip on NCCL).
Receives block, in the order the sender sent (both sides walk the same schedule), and the
header's micro-batch number catches any disorder; a message's tensors are received in one
batch (after its header), so no batch waits for a batch its peer posts later.

Sends leave when the action that made them ends (:meth:`TensorWire.flush`, called by the
rank after each action), so a peer never waits for this rank's next receive. One exception: when
the next action's first receive is from the peer the queued sends go to (1F1B's steady state:
activation forward, then that stage's gradient back), they are held and posted with that
receive in one ``batch_isend_irecv``, as Megatron's ``send_forward_recv_backward``: NCCL
serialises a send and a receive between the same two ranks issued separately, and two ranks
doing so in opposite directions deadlock. Measured on gloo (gpt small, 2 stages, GPipe):
before, queued sends left with the next receive, so stage 0's activations left only when its
backward began and the pipeline ran serially both ways.

**A sent tensor is held until its send completes, no longer** (a rank's memory then grows with
the schedule's in-flight micro-batches, not with the step's count: before, every sent tensor was
held to the end of the step, M activations and M gradients). On gloo a send's work says it is
complete only once waited for (``is_completed`` stays false), so each peer's sends are waited for
by a thread of their own (:class:`_Reaper`), in the order posted (the order the peer receives
them), each tensor dropped as its send completes; the rank's own thread never blocks on a send.
Elsewhere (NCCL) the posted works are polled at every post and flush and the completed ones
dropped. :meth:`TensorWire.wait`, at the step's end, waits for what is still in flight and
raises the first send's error.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from onnx_partition.errors import one_line
from onnx_partition.runtime.wire import (
    decode_torch_header,
    encode_codes,
    header_size,
    torch_dtype_code,
)

__all__ = ["TensorWire", "Tensors"]

Tensors = dict[str, torch.Tensor]


class TensorWire:
    """Send and receive named tensors for one micro-batch; ``peer`` names a rank in errors."""

    def __init__(self, device: torch.device, peer: Callable[[int], str] = str) -> None:
        self.device = device
        self.peer = peer
        self.comm_s = 0.0
        self.outbox: list[tuple[torch.Tensor, int]] = []  # queued sends
        self.pending: list[tuple[Any, int, torch.Tensor]] = []  # posted, polled (not gloo)
        self.reapers: dict[int, _Reaper] = {}  # gloo: per peer, its sends in flight
        self.threaded = device.type == "cpu"  # gloo's works complete only when waited for

    def send(self, dst: int, m: int, names: Sequence[str],
             tensors: Mapping[str, torch.Tensor], *, header: bool = True) -> None:
        """Queue ``tensors[names]`` for ``dst``; ``header=False`` when the receiver knows
        the shapes (:meth:`recv_like`)."""
        values = [tensors[n].detach().to(self.device).contiguous() for n in names]
        if header:
            head = encode_codes(m, names, [(torch_dtype_code(v.dtype, n), tuple(v.shape))
                                           for n, v in zip(names, values)])
            self.outbox.append((torch.from_numpy(head).to(self.device), dst))
        self.outbox.extend((v, dst) for v in values if v.numel())

    def flush(self, hold_for: int | None = None) -> None:
        """Post the queued sends now, unless they all go to ``hold_for`` (the peer the next
        action receives from first): then they go out with that receive, in one batch."""
        if self.outbox and not all(dst == hold_for for _, dst in self.outbox):
            self._post([], 0)
        self._drop_completed()

    def in_flight(self) -> int:
        """Sends posted and not yet complete (their tensors held)."""
        return len(self.pending) + sum(r.count for r in self.reapers.values())

    def recv_like(self, src: int, names: Sequence[str],
                  like: Mapping[str, torch.Tensor]) -> Tensors:
        """Receive tensors shaped as ``like[names]`` without a header (gradients: the
        receiver sent the tensors they belong to)."""
        out = {n: torch.empty_like(like[n], device=self.device,
                                   memory_format=torch.contiguous_format) for n in names}
        self._recv([t for t in out.values() if t.numel()], src)  # held sends leave, too
        return out

    def recv(self, src: int, m: int, names: Sequence[str]) -> Tensors:
        head = torch.empty(header_size(len(names)), dtype=torch.int64, device=self.device)
        self._recv([head], src)
        specs = decode_torch_header(head.cpu().numpy(), m, len(names))
        out = {n: torch.empty(shape, dtype=dtype, device=self.device)
               for n, (dtype, shape) in zip(names, specs)}
        self._recv([t for t in out.values() if t.numel()], src)
        return out

    def wait(self) -> None:
        """Post the queued sends and wait for every send to complete."""
        began = time.perf_counter()
        self._post([], 0)
        for dst, reaper in self.reapers.items():
            error = reaper.join()
            if error is not None:
                raise RuntimeError(f"sending to {self.peer(dst)}: {one_line(error)}") from error
        for work, dst, _ in self.pending:
            try:
                work.wait()
            except Exception as exc:  # torch raises DistBackendError / RuntimeError
                raise RuntimeError(f"sending to {self.peer(dst)}: {one_line(exc)}") from exc
        self.pending.clear()
        self.comm_s += time.perf_counter() - began

    def _drop_completed(self) -> None:
        """Drop the polled sends that completed (their tensors with them)."""
        if self.pending:
            self.pending = [p for p in self.pending if not p[0].is_completed()]

    def _post(self, receives: Sequence[torch.Tensor], src: int) -> list[Any]:
        """Post the queued sends and the ``receives`` from ``src`` as one batch (all of a
        message's tensors at once: under NCCL a batch that waits for a peer's later batch
        could deadlock); the receives' works."""
        ops = [dist.P2POp(dist.isend, t, dst) for t, dst in self.outbox]
        ops += [dist.P2POp(dist.irecv, t, src) for t in receives]
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        for work, (t, dst) in zip(works, self.outbox):  # the tensor kept alive until sent
            if self.threaded:
                if dst not in self.reapers:
                    self.reapers[dst] = _Reaper()
                self.reapers[dst].put(work, t)
            else:
                self.pending.append((work, dst, t))
        self.outbox.clear()
        self._drop_completed()
        return works[len(works) - len(receives):]

    def _recv(self, tensors: Sequence[torch.Tensor], src: int) -> None:
        """Receive ``tensors`` from ``src`` (with the held sends, in one batch)."""
        began = time.perf_counter()
        try:
            for work in self._post(tensors, src):
                work.wait()
        except Exception as exc:  # torch raises DistBackendError / RuntimeError
            raise RuntimeError(f"receiving from {self.peer(src)}: {one_line(exc)}") from exc
        self.comm_s += time.perf_counter() - began


class _Reaper:
    """One peer's sends in flight, waited for in the order posted by a daemon thread (the peer
    receives them in that order), each dropped, with its tensor, once complete; the first error
    is kept for :meth:`join` (later sends to that peer are then dropped unwaited)."""

    def __init__(self) -> None:
        self.queue: queue.Queue[tuple[Any, torch.Tensor]] = queue.Queue()
        self.error: BaseException | None = None
        threading.Thread(target=self._loop, name="send-reaper", daemon=True).start()

    @property
    def count(self) -> int:
        """Sends in flight."""
        return self.queue.unfinished_tasks

    def put(self, work: Any, tensor: torch.Tensor) -> None:
        self.queue.put((work, tensor))

    def join(self) -> BaseException | None:
        """Wait until every send put so far completed; the first error, if any."""
        self.queue.join()
        return self.error

    def _loop(self) -> None:
        while True:
            work, tensor = self.queue.get()
            try:
                if self.error is None:
                    work.wait()  # releases the GIL while it waits
            except Exception as exc:  # torch raises DistBackendError / RuntimeError
                self.error = exc
            del work, tensor  # the tensor freed now, not with the next send
            self.queue.task_done()
