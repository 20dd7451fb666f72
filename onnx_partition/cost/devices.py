"""Named device specs for the analytic (roofline) costs: datasheet GPUs and a measured CPU.

A GPU spec holds the vendor's dense peaks per math mode, its memory bandwidth and size; turned
into a :class:`~onnx_partition.cost.analytic.DeviceSpec` with the per-op-class efficiencies of
:data:`GPU_EFFICIENCY` and a launch overhead. Peaks are *dense* (no 2:4 sparsity), SXM parts.

Sources (vendor datasheets):

* V100 SXM2 32 GB: 15.7 TFLOP/s fp32, 125 fp16 tensor, 900 GB/s HBM2 (no TF32, no bf16:
  those are priced at fp32 and fp16). NVIDIA Tesla V100 datasheet, 2020.
* A100 SXM4 40 GB / 80 GB: 19.5 fp32, 156 TF32, 312 fp16/bf16; 1,555 / 2,039 GB/s.
  NVIDIA A100 Tensor Core GPU datasheet, 2021.
* H100 SXM5 80 GB: 67 fp32, 494.7 TF32, 989.4 fp16/bf16; 3,350 GB/s HBM3.
  NVIDIA H100 Tensor Core GPU datasheet, 2023.
* H200 SXM 141 GB: the H100's compute; 4,800 GB/s HBM3e. NVIDIA H200 datasheet, 2024.
* L4 24 GB: 30.3 fp32, 60 TF32, 121 fp16/bf16 (half the datasheet's sparse figures); 300 GB/s
  GDDR6. NVIDIA L4 datasheet, 2023.

**Math mode of a float32 graph.** A float32 ONNX graph's matrix products are priced at
**TF32** on GPUs that have it (A100, H100, H200, L4): onnxruntime's CUDA provider uses TF32 by
default (``use_tf32 = 1``), and ``train`` sets torch's TF32 flags to the math its plan was
priced in (plan.json ``math``, :func:`math_of`; torch's own default keeps matrix products in
fp32: :mod:`onnx_partition.runtime.train.math_mode`). ``NAME:fp32`` prices them at IEEE fp32
instead, ``NAME:bf16`` / ``NAME:fp16`` at the half-precision tensor-core peak (mixed
precision; bytes stay those of the graph's dtypes). Operators whose inputs are 2-byte floats
always use the half-precision peak. Element-wise, normalisation and data-movement operators
run on the CUDA cores (fp32 peak) and are memory-bound in practice.

**The CPU** is not a datasheet part: :func:`measured_cpu` times a small matrix product and a
large element-wise add in onnxruntime on one thread (the runtime's default) once per machine,
and keeps the figures in ``$XDG_CACHE_HOME/onnx-partition/cpu-speed.json`` (default
``~/.cache``; written atomically, one entry per host, CPU model and onnxruntime version), so the
same command gives the same plan; :func:`pinned_cpu` (``partition --cpu-tflops X [--cpu-gbps
Y]``) fixes them instead. The spec's ``source`` says which, for the summary and plan.json.

**Memory a plan may use.** A named GPU's datasheet memory less :data:`CUDA_CONTEXT_GB` for the
CUDA context and the cuBLAS workspace, which every training process holds besides its tensors
and which no count of the model includes (``nvidia-smi`` shows 781 MB for a PyTorch process
that has only initialised CUDA with eager module loading, PyTorch issue #34323; lazy loading,
the default since CUDA 11.7, leaves 0.3-0.5 GB; cuBLAS's default workspace on Hopper is 32 MiB
a stream, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``). A memory the user gives (``--device-memory``,
``memory_gb``) is taken as what a device may use, as it is.

**Links.** A named GPU also brings its datasheet memory and its intra-machine link
(:data:`GPU_LINKS`: NVLink per direction where the part has it, else PCIe), the defaults of a
plan on it (``partition --gpu``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from onnx_partition.cost.analytic import DeviceSpec
from onnx_partition.errors import PartitionError
from onnx_partition.fileio import atomic_write

__all__ = ["CPU_SPEED_FILE", "CUDA_CONTEXT_GB", "DEFAULT_GPU", "GPUS", "GPU_EFFICIENCY",
           "GPU_LAUNCH_MS", "GPU_LINKS", "MATH_MODES", "GpuLink", "GpuSpec", "cache_home",
           "device_for", "for_precision", "gpu", "gpu_key", "gpu_spec", "measured_cpu",
           "pinned_cpu"]

#: Achievable fraction of peak (compute, memory bandwidth) per operator class on a GPU.
#: dense (MatMul, Gemm, Conv): large cuBLAS GEMMs reach 70-80% of tensor-core peak (NVIDIA,
#:   "Matrix Multiplication Background User's Guide", Deep Learning Performance docs);
#:   Megatron-LM sustains 52% of A100 peak end to end on GPT-3 175B (Narayanan et al., SC'21,
#:   163 of 312 TFLOP/s), its GEMMs above that: 0.7.
#: attention (fused Attention ops): FlashAttention-2 reaches 50-73% of A100 peak in the
#:   forward pass (Dao, "FlashAttention-2", 2023): 0.5.
#: norm (LayerNorm, Softmax, reductions): framework kernels reach 60-80% of HBM bandwidth
#:   (OneFlow, "How to implement an efficient Softmax CUDA kernel", 2021; Triton's fused-softmax
#:   tutorial measures torch.softmax on A100 there): 0.7.
#: elementwise: streaming kernels reach 85-90% of HBM bandwidth (BabelStream on A100/H100,
#:   Deakin et al., 2018 and later results): 0.85.
#: move (Transpose, Concat, Gather, ...): strided copies reach well under a stream copy;
#:   a tiled transpose gets ~75% of copy bandwidth (Harris, "An Efficient Matrix Transpose in
#:   CUDA C/C++", NVIDIA blog 2013): 0.6.
GPU_EFFICIENCY = MappingProxyType({
    "dense": (0.70, 0.80),
    "attention": (0.50, 0.80),
    "norm": (0.70, 0.70),
    "elementwise": (0.80, 0.85),
    "move": (1.00, 0.60),
})
#: Per-kernel launch overhead on a GPU: ~4 us from host to kernel start in a stream of small
#: kernels (NVIDIA, "Getting Started with CUDA Graphs", 2019, measures 3-4 us per launch).
GPU_LAUNCH_MS = 0.004


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures of one GPU: dense TFLOP/s per math mode, GB/s, GB."""

    name: str
    fp32_tflops: float
    tf32_tflops: float  # 0: no TF32 (priced at fp32)
    half_tflops: float  # fp16 / bf16 tensor cores, dense
    mem_gbps: float
    memory_gb: float


GPUS = MappingProxyType({
    "v100": GpuSpec("V100-SXM2-32GB", 15.7, 0.0, 125.0, 900.0, 32.0),
    "a100-40gb": GpuSpec("A100-SXM4-40GB", 19.5, 156.0, 312.0, 1555.0, 40.0),
    "a100-80gb": GpuSpec("A100-SXM4-80GB", 19.5, 156.0, 312.0, 2039.0, 80.0),
    "h100": GpuSpec("H100-SXM5-80GB", 67.0, 494.7, 989.4, 3350.0, 80.0),
    "h200": GpuSpec("H200-SXM-141GB", 67.0, 494.7, 989.4, 4800.0, 141.0),
    "l4": GpuSpec("L4-24GB", 30.3, 60.0, 121.0, 300.0, 24.0),
})
DEFAULT_GPU = "h100"
#: GB of a GPU's datasheet memory a plan leaves to the CUDA context and cuBLAS's workspace
#: (module docstring); CPUs keep none.
CUDA_CONTEXT_GB = 0.5
MATH_MODES = ("tf32", "fp32", "fp16", "bf16")


@dataclass(frozen=True)
class GpuLink:
    """The link between two GPUs of one machine: GB/s per direction, ms per message."""

    name: str
    bandwidth_gbps: float
    latency_ms: float


#: Intra-machine links per GPU, from the same datasheets: NVLink's total bandwidth is both
#: directions, a send uses one, so half of it (V100 NVLink 2: 300 GB/s -> 150; A100 NVLink 3:
#: 600 -> 300; H100/H200 NVLink 4: 900 -> 450); the L4 has no NVLink: PCIe 4.0 x16, 64 GB/s
#: both ways -> 32. Latency: a few microseconds per NCCL message within a node (NCCL's
#: intra-node latency is ~5 us on NVLink, ~10 us over PCIe).
GPU_LINKS = MappingProxyType({
    "v100": GpuLink("NVLink 2", 150.0, 0.005),
    "a100-40gb": GpuLink("NVLink 3", 300.0, 0.005),
    "a100-80gb": GpuLink("NVLink 3", 300.0, 0.005),
    "h100": GpuLink("NVLink 4", 450.0, 0.005),
    "h200": GpuLink("NVLink 4", 450.0, 0.005),
    "l4": GpuLink("PCIe 4.0 x16", 32.0, 0.01),
})


def gpu_spec(name: str) -> tuple[str, GpuSpec]:
    """The :data:`GPUS` key and datasheet of GPU ``NAME`` or ``NAME:MODE`` (``a100``: the
    80 GB part)."""
    key = name.strip().lower().partition(":")[0]
    if key == "a100":
        key = "a100-80gb"
    spec = GPUS.get(key)
    if spec is None:
        raise PartitionError(f"unknown GPU {name!r}; choose one of {', '.join(GPUS)} "
                             f"(optionally NAME:{'|'.join(MATH_MODES)})")
    return key, spec


def gpu(name: str = DEFAULT_GPU) -> DeviceSpec:
    """The roofline spec of GPU ``NAME`` or ``NAME:MODE`` (``MODE`` in :data:`MATH_MODES`:
    how float32 matrix products are priced; default TF32 where the GPU has it)."""
    key, spec = gpu_spec(name)
    mode = name.strip().lower().partition(":")[2]
    mode = mode or ("tf32" if spec.tf32_tflops else "fp32")
    if mode not in MATH_MODES:
        raise PartitionError(f"unknown math mode {mode!r} in {name!r}; choose one of "
                             f"{', '.join(MATH_MODES)}")
    dense = {"fp32": spec.fp32_tflops, "tf32": spec.tf32_tflops or spec.fp32_tflops,
             "fp16": spec.half_tflops, "bf16": spec.half_tflops}[mode]
    return DeviceSpec(
        f"{key}:{mode}", peak_gflops=dense * 1e3, mem_gbps=spec.mem_gbps,
        launch_overhead_ms=GPU_LAUNCH_MS, half_gflops=spec.half_tflops * 1e3,
        vector_gflops=spec.fp32_tflops * 1e3, efficiency=GPU_EFFICIENCY,
        memory_gb=spec.memory_gb, kind="cuda", source=f"datasheet of the {spec.name}")


def math_of(device_name: str | None, precision: str | None) -> str:
    """The matrix-product math a train plan is priced in: its autocast precision when half,
    else the analytic device's math mode (the ``MODE`` of a ``NAME:MODE`` spec name, as
    ``h100:tf32``), else ``fp32`` (a CPU, a costs file: profiles run with TF32 off)."""
    if precision in ("bf16", "fp16"):
        return precision
    mode = (device_name or "").partition(":")[2]
    return mode if mode in ("fp32", "tf32") else "fp32"


def _best_ms(run: object, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best * 1e3


#: The measured CPU's cache file, in :func:`cache_home`.
CPU_SPEED_FILE = "cpu-speed.json"
_CPU_FORMAT = "onnx-partition/cpu-speed@1"
#: A pinned CPU's bandwidth and overhead when not given: DeviceSpec.cpu()'s assumed figures.
_PINNED_GBPS = 10.0
_PINNED_OVERHEAD_MS = 0.005


def cache_home() -> Path:
    """``$XDG_CACHE_HOME/onnx-partition`` (an absolute path, as the XDG base directory spec
    asks), else ``~/.cache/onnx-partition``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "onnx-partition"


def measured_cpu() -> DeviceSpec:
    """One CPU core running onnxruntime, measured once per machine and cached
    (:data:`CPU_SPEED_FILE` in :func:`cache_home`; read once per process): peak from a 256^3
    MatMul (2 * 256^3 FLOPs), bandwidth from an Add of two 4M-float tensors (48 MB moved,
    beyond the caches), overhead from a 1-element Add; best of a few runs each (~0.1 s). An
    unreadable cache is measured over; an unwritable one leaves the figures uncached (said in
    ``source``)."""
    return _cached_cpu(cache_home() / CPU_SPEED_FILE)


def pinned_cpu(tflops: float, gbps: float | None = None) -> DeviceSpec:
    """A CPU of the given dense peak (TFLOP/s) and memory bandwidth (GB/s; default 10, the
    conservative end of one core's STREAM), with a 5 us launch overhead: nothing measured."""
    if not (tflops > 0 and (gbps is None or gbps > 0)):
        raise PartitionError(f"--cpu-tflops and --cpu-gbps must be positive, got {tflops} "
                             f"and {gbps}")
    bandwidth = f"{gbps:g} GB/s by --cpu-gbps" if gbps else \
        f"{_PINNED_GBPS:g} GB/s assumed (--cpu-gbps sets it)"
    return DeviceSpec("cpu:pinned", peak_gflops=tflops * 1e3, mem_gbps=gbps or _PINNED_GBPS,
                      launch_overhead_ms=_PINNED_OVERHEAD_MS,
                      source=f"pinned: {tflops:g} TFLOP/s by --cpu-tflops, {bandwidth}")


def _this_cpu() -> dict[str, str]:
    """What a cached speed is of: host, CPU model, onnxruntime version."""
    import onnxruntime as ort

    model = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            model = next((line.split(":", 1)[1].strip() for line in info
                          if line.startswith("model name")), model)
    except OSError:
        pass
    return {"host": platform.node(), "cpu": model or platform.machine(),
            "onnxruntime": str(ort.__version__)}


@functools.cache
def _cached_cpu(path: Path) -> DeviceSpec:
    """The entry of this machine in ``path``, else a new measurement written there."""
    me = _this_cpu()
    key = json.dumps(me, sort_keys=True)
    entries: dict[str, Any] = {}
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(body, dict) and body.get("format") == _CPU_FORMAT:
            entries = dict(body.get("machines") or {})
        entry = entries.get(key)
        if isinstance(entry, dict):
            return DeviceSpec(
                "cpu:measured", peak_gflops=float(entry["peak_gflops"]),
                mem_gbps=float(entry["mem_gbps"]),
                launch_overhead_ms=float(entry["launch_overhead_ms"]),
                source=f"measured {entry.get('measured_at', '')}, cached in {path}; "
                       "--cpu-tflops pins it, deleting the file measures again")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, PartitionError):
        pass  # none yet, or unreadable: measure over it
    spec = _measure_cpu()
    entries[key] = {**me, "peak_gflops": spec.peak_gflops, "mem_gbps": spec.mem_gbps,
                    "launch_overhead_ms": spec.launch_overhead_ms,
                    "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"format": _CPU_FORMAT, "machines": entries},
                                      indent=1, sort_keys=True) + "\n")
        where = f"cached in {path}"
    except OSError as exc:
        where = f"not cached ({path}: {exc.strerror or exc})"
    return replace(spec, source=f"measured now, {where}; --cpu-tflops pins it")


def _measure_cpu() -> DeviceSpec:
    """The measurement itself (see :func:`measured_cpu`)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    def session(op: str, shape: list[int]) -> ort.InferenceSession:
        graph = helper.make_graph(
            [helper.make_node(op, ["a", "b"], ["c"])], "bench",
            [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape) for x in "ab"],
            [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        return ort.InferenceSession(model.SerializeToString(), options,
                                    providers=["CPUExecutionProvider"])

    def timed(op: str, shape: list[int], repeats: int) -> float:
        sess = session(op, shape)
        # the values do not change the time; drawing 8M random floats took longer than timing
        feeds = {x: np.full(shape, 0.5, dtype=np.float32) for x in "ab"}
        sess.run(None, feeds)
        return _best_ms(lambda: sess.run(None, feeds), repeats)

    overhead = timed("Add", [1], 20)
    matmul = max(timed("MatMul", [256, 256], 5) - overhead, 1e-6)
    add = max(timed("Add", [4 << 20], 3) - overhead, 1e-6)
    return DeviceSpec("cpu:measured", peak_gflops=2 * 256**3 / matmul / 1e6,
                      mem_gbps=3 * 4 * (4 << 20) / add / 1e6, launch_overhead_ms=overhead)


def gpu_key(device_name: str) -> str | None:
    """The :data:`GPUS` key of a GPU as CUDA names it (``torch.cuda.get_device_name``:
    ``NVIDIA H200``, ``NVIDIA A100-SXM4-40GB``, ``Tesla V100-SXM2-32GB``...); None for a GPU
    without a spec here. An A100 without its memory in the name is taken as the 80 GB one."""
    text = device_name.upper().replace(" ", "-")
    for family in ("H200", "H100", "V100", "L4"):
        if re.search(rf"(^|[^A-Z0-9]){family}([^0-9]|$)", text):
            return family.lower()
    if re.search(r"(^|[^A-Z0-9])A100([^0-9]|$)", text):
        return "a100-40gb" if "40GB" in text else "a100-80gb"
    return None


def for_precision(device: DeviceSpec, precision: str) -> DeviceSpec:
    """``device`` as a training run in ``precision`` uses it: under bf16/fp16 autocast a GPU's
    matrix products run on its half-precision tensor cores (its ``half_gflops``; the name's
    math mode becomes the precision, ``h100:bf16``); fp32, a CPU, or a GPU without a half
    peak: ``device`` unchanged (CPU autocast is priced as fp32: not measured here)."""
    if precision == "fp32" or device.kind != "cuda" or not device.half_gflops:
        return device
    return replace(device, name=f"{device.name.partition(':')[0]}:{precision}",
                   peak_gflops=device.half_gflops)


def device_for(kind: str, gpu_name: str | None = None) -> DeviceSpec:
    """The analytic model of a cluster's devices: ``cuda`` -> :func:`gpu` (default
    :data:`DEFAULT_GPU`), ``cpu`` -> :func:`measured_cpu`."""
    if kind == "cuda":
        return gpu(gpu_name or DEFAULT_GPU)
    if gpu_name:
        raise PartitionError(f"a GPU ({gpu_name}) was named for {kind} devices: use "
                             "--device-kind cuda (cluster.json \"kind\": \"cuda\")")
    return measured_cpu()
