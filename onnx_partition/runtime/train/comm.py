"""Point-to-point transfer of named torch tensors between training ranks.

Per hop and micro-batch: the int64 header of :mod:`onnx_partition.runtime.dist.wire` (micro-batch,
count, dtype and shape per tensor; none for gradients, whose receiver knows their shapes: a
message less per backward hop, 77 -> 50 ms per step of gpt tiny on two loaded cores), then
each non-empty tensor as its own message, straight from and into torch tensors on the
communication device (no host round trip on NCCL).
Receives block, in the order the sender sent (both sides walk the same schedule), and the
header's micro-batch number catches any disorder.

Sends are queued, and posted together with the rank's next receive in one
``batch_isend_irecv`` (or at :meth:`TensorWire.wait`, the end of the step): a send is thus
posted before the rank blocks, as the schedule needs, and a send and a receive between the
same two ranks in opposite directions (1F1B's steady state: activation forward, gradient back)
form one group, which NCCL needs (two separately issued ones serialize on the pair's stream and
deadlock; Megatron's ``send_forward_recv_backward`` batches them likewise).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from onnx_partition.errors import one_line
from onnx_partition.runtime.dist.wire import decode_header, encode_header, header_size

__all__ = ["TensorWire", "Tensors", "numpy_dtype"]

Tensors = dict[str, torch.Tensor]


def numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    """The numpy dtype of a torch dtype (those the wire protocol carries)."""
    return torch.empty(0, dtype=dtype).numpy().dtype


def _shape_only(t: torch.Tensor) -> np.ndarray:
    """A zero-strided numpy array with ``t``'s dtype and shape (for the header; no copy)."""
    return np.broadcast_to(np.zeros((), numpy_dtype(t.dtype)), tuple(t.shape))


class TensorWire:
    """Send and receive named tensors for one micro-batch; ``peer`` names a rank in errors."""

    def __init__(self, device: torch.device, peer: Callable[[int], str] = str) -> None:
        self.device = device
        self.peer = peer
        self.comm_s = 0.0
        self.outbox: list[tuple[torch.Tensor, int]] = []  # queued sends
        self.pending: list[tuple[Any, int, torch.Tensor]] = []  # posted, not yet complete

    def send(self, dst: int, m: int, names: Sequence[str],
             tensors: Mapping[str, torch.Tensor], *, header: bool = True) -> None:
        """Queue ``tensors[names]`` for ``dst``; ``header=False`` when the receiver knows
        the shapes (:meth:`recv_like`)."""
        values = [tensors[n].detach().to(self.device).contiguous() for n in names]
        if header:
            head = encode_header(m, names, [_shape_only(v) for v in values])
            self.outbox.append((torch.from_numpy(head).to(self.device), dst))
        self.outbox.extend((v, dst) for v in values if v.numel())

    def recv_like(self, src: int, names: Sequence[str],
                  like: Mapping[str, torch.Tensor]) -> Tensors:
        """Receive tensors shaped as ``like[names]`` without a header (gradients: the
        receiver sent the tensors they belong to)."""
        out: Tensors = {}
        for n in names:
            out[n] = torch.empty_like(like[n], device=self.device,
                                      memory_format=torch.contiguous_format)
            if out[n].numel():
                self._recv(out[n], src)
        return out

    def recv(self, src: int, m: int, names: Sequence[str]) -> Tensors:
        head = torch.empty(header_size(len(names)), dtype=torch.int64, device=self.device)
        self._recv(head, src)
        out: Tensors = {}
        for n, (dtype, shape) in zip(names, decode_header(head.cpu().numpy(), m, len(names))):
            value = torch.from_numpy(np.empty(0, dtype)).new_empty(shape, device=self.device)
            if value.numel():
                self._recv(value, src)
            out[n] = value
        return out

    def wait(self) -> None:
        """Post the queued sends and wait for every send to complete."""
        began = time.perf_counter()
        self._post(None)
        for work, dst, _ in self.pending:
            try:
                work.wait()
            except Exception as exc:  # torch raises DistBackendError / RuntimeError
                raise RuntimeError(f"sending to {self.peer(dst)}: {one_line(exc)}") from exc
        self.pending.clear()
        self.comm_s += time.perf_counter() - began

    def _post(self, receive: tuple[torch.Tensor, int] | None) -> Any:
        """Post the queued sends and ``receive`` (tensor, source) as one batch; the receive's
        work, if any."""
        ops = [dist.P2POp(dist.isend, t, dst) for t, dst in self.outbox]
        if receive is not None:
            ops.append(dist.P2POp(dist.irecv, receive[0], receive[1]))
        if not ops:
            return None
        works = dist.batch_isend_irecv(ops)
        for work, (t, dst) in zip(works, self.outbox):
            self.pending.append((work, dst, t))  # the tensor kept alive until sent
        self.outbox.clear()
        return works[-1] if receive is not None else None

    def _recv(self, tensor: torch.Tensor, src: int) -> None:
        began = time.perf_counter()
        try:
            self._post((tensor, src)).wait()
        except Exception as exc:  # torch raises DistBackendError / RuntimeError
            raise RuntimeError(f"receiving from {self.peer(src)}: {one_line(exc)}") from exc
        self.comm_s += time.perf_counter() - began
