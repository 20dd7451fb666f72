"""The device-resident hop (``hop="device"``): a stage's inputs and outputs stay torch tensors on
the rank's device from the wire through onnxruntime and back onto the wire.

onnxruntime runs through IOBinding: inputs are bound to the received tensors' memory, outputs
are allocated by onnxruntime on the device and handed to torch through DLPack (no copy), and on
CUDA the session runs on torch's current stream (``user_compute_stream``), the stream NCCL's
sends wait for and its receives complete on, so no host synchronisation is needed between them.
Payloads travel one tensor per message (packing small ones would be a copy), after the wire's
header, which goes once per (peer, names, key) as in :class:`~onnx_partition.runtime.wire.
Wire`. The only copies are rank 0's: the feeds onto the device and the outputs back to the
host (counted in ``copies`` as ``to_device`` and ``to_host``; none on CPU, where the tensors
share the arrays' memory).

**Status.** No GPU has run this path. It runs and is tested on CPU with gloo (the same IOBinding
and DLPack calls, CPU memory); on CUDA it needs ``backend="nccl"``. Until a GPU run confirms it
the default stays ``hop="host"`` over gloo.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
import torch.distributed as dist

from onnx_partition.errors import one_line
from onnx_partition.runtime.wire import (
    Spec,
    decode_header,
    encode_header,
    header_size,
    wait_sends,
)

__all__ = ["HOPS", "DeviceHop", "TensorEnv"]

HOPS = ("host", "device")
TensorEnv = dict[str, torch.Tensor]


def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    return torch.empty((), dtype=dtype).numpy().dtype


def _torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    return torch.from_numpy(np.empty((), dtype)).dtype


class DeviceHop:
    """Stage runs and transfers of torch tensors on ``device`` (see the module's notes)."""

    def __init__(self, session: ort.InferenceSession, device: torch.device,
                 peer: Callable[[int], str] = str) -> None:
        self.session = session
        self.device = device
        self.peer = peer
        self.comm_s = 0.0
        self.headers_sent = 0
        self.copies: Counter[str] = Counter()
        self._sent: dict[tuple[Any, ...], list[Spec]] = {}
        self._known: dict[tuple[Any, ...], list[Spec]] = {}
        self._ort_device = "cuda" if device.type == "cuda" else "cpu"
        self._index = (device.index or 0) if device.type == "cuda" else 0

    # ----------------------------------------------------------------------- host edges

    def to_device(self, env: Mapping[str, np.ndarray]) -> TensorEnv:
        """Rank 0's feeds as tensors on the device (a copy only off the CPU)."""
        out = {}
        for name, a in env.items():
            t = torch.from_numpy(np.require(a, requirements=["C", "W"]))
            if self.device.type != "cpu":
                t = t.to(self.device, non_blocking=False)
                self.copies["to_device"] += 1
            out[name] = t
        return out

    def to_host(self, env: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Rank 0's results as arrays (a copy only off the CPU)."""
        out = {}
        for name, t in env.items():
            if t.device.type != "cpu":
                t = t.cpu()
                self.copies["to_host"] += 1
            out[name] = t.numpy()
        return out

    # ----------------------------------------------------------------------- the stage

    def run(self, outputs: Sequence[str], env: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The stage on ``env[inputs]`` through IOBinding; its outputs as tensors (DLPack)."""
        binding = self.session.io_binding()
        for arg in self.session.get_inputs():
            t = env[arg.name].contiguous()
            binding.bind_input(arg.name, self._ort_device, self._index,
                               _numpy_dtype(t.dtype), list(t.shape), t.data_ptr())
        for name in outputs:
            binding.bind_output(name, self._ort_device, self._index)
        self.session.run_with_iobinding(binding)
        return [torch.from_dlpack(v) for v in binding.get_outputs()]

    # ----------------------------------------------------------------------- the wire

    def send(self, dst: int, m: int, names: Sequence[str], env: Mapping[str, torch.Tensor],
             pending: list[Any], key: Hashable | None = None) -> None:
        """Start sending ``env[names]`` for micro-batch ``m`` (header once per key)."""
        tensors = [env[n].contiguous() for n in names]
        specs = [(_numpy_dtype(t.dtype), tuple(t.shape)) for t in tensors]
        cache = None if key is None else (dst, tuple(names), key)
        if cache is None or cache not in self._sent:
            proxies = [np.broadcast_to(np.zeros((), d), s) for d, s in specs]
            head = torch.from_numpy(encode_header(m, names, proxies)).to(self.device)
            pending.append((dist.isend(head, dst), dst, head))
            self.headers_sent += 1
            if cache is not None:
                self._sent[cache] = specs
        elif self._sent[cache] != specs:
            changed = next(n for n, a, b in zip(names, specs, self._sent[cache]) if a != b)
            raise RuntimeError(f"protocol error: tensor {changed!r} of micro-batch {m} changed "
                               f"shape after its hop's header was sent")
        for t in tensors:
            if t.numel():
                pending.append((dist.isend(t.reshape(-1), dst), dst, t))

    def recv(self, src: int, m: int, names: Sequence[str],
             key: Hashable | None = None) -> TensorEnv:
        """Receive micro-batch ``m``'s tensors ``names`` from ``src`` into fresh device
        tensors (each receive posted before waiting on any)."""
        began = time.perf_counter()
        try:
            cache = None if key is None else (src, tuple(names), key)
            if cache is not None and cache in self._known:
                specs = self._known[cache]
            else:
                head = torch.zeros(header_size(len(names)), dtype=torch.int64,
                                   device=self.device)
                dist.recv(head, src)
                specs = decode_header(head.cpu().numpy(), m, len(names))
                if cache is not None:
                    self._known[cache] = specs
            out = [torch.empty(s, dtype=_torch_dtype(d), device=self.device) for d, s in specs]
            works = [dist.irecv(t.reshape(-1), src) for t in out if t.numel()]
            for work in works:
                if work is not None:
                    work.wait()
        except RuntimeError as exc:
            if str(exc).startswith("protocol error"):
                raise
            raise RuntimeError(f"receiving from {self.peer(src)}: {one_line(exc)}") from exc
        self.comm_s += time.perf_counter() - began
        return dict(zip(names, out))

    def wait(self, pending: list[Any]) -> None:
        began = time.perf_counter()
        wait_sends(pending, self.peer, torch.device("cpu"))  # the stream orders device work
        self.comm_s += time.perf_counter() - began
