"""The tensor framing of ``torch.distributed`` messages (:mod:`onnx_partition.runtime.wire`):
exact headers, packing round trips of every dtype and shape, bad headers, and real transfers
between two gloo ranks on loopback."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from support.wire import CapturedWire

from onnx_partition.errors import PartitionError
from onnx_partition.runtime.wire import (
    ALIGN,
    CODES,
    DTYPES,
    MAX_DIMS,
    SMALL_BYTES,
    TORCH_DTYPES,
    Wire,
    decode_header,
    decode_torch_header,
    dtype_code,
    encode_codes,
    encode_header,
    header_size,
    pack,
    torch_dtype_code,
    unpack,
)

SHAPES = [(), (0,), (3, 0, 2), (1,), (2, 3), (1, 1, 1, 1, 1, 1, 1, 2)]


def sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Distinct values of ``dtype`` (bool alternates; complex has an imaginary part)."""
    values = np.arange(1, int(np.prod(shape)) + 1) + seed
    if dtype == "bool":
        return (values % 2 == 0).reshape(shape)
    array = values.astype(dtype).reshape(shape)
    return array + 1j * array if dtype.startswith("complex") else array


# ------------------------------------------------------------------------------ pure framing


def test_header_layout_is_exact() -> None:
    arrays = [np.zeros((2, 3), np.float32), np.array(True), np.zeros(0, np.int64)]
    head = encode_header(5, ["a", "b", "c"], arrays)
    assert header_size(3) == len(head) == 2 + 3 * (2 + MAX_DIMS) == 32
    assert head.dtype == np.int64
    assert head[:2].tolist() == [5, 3]
    assert head[2:12].tolist() == [0, 2, 2, 3, 0, 0, 0, 0, 0, 0]  # float32, 2 dims: 2 x 3
    assert head[12:22].tolist() == [11, 0] + [0] * MAX_DIMS  # bool, 0-d
    assert head[22:32].tolist() == [3, 1, 0] + [0] * (MAX_DIMS - 1)  # int64, one empty dim
    assert header_size(0) == 2 and encode_header(9, [], []).tolist() == [9, 0]


def test_every_dtype_has_its_own_code() -> None:
    assert [dtype_code(np.dtype(name), "t") for name in DTYPES] == list(range(len(DTYPES)))
    for bad in (np.dtype(object), np.dtype("U3"), np.dtype("datetime64[s]"), np.dtype("V4")):
        with pytest.raises(PartitionError, match=r"tensor 't' of dtype .* cannot be sent"):
            dtype_code(bad, "t")


@given(dtype=st.sampled_from(DTYPES),
       shape=hnp.array_shapes(min_dims=0, max_dims=MAX_DIMS, min_side=0, max_side=3),
       m=st.integers(0, 2**40))
def test_header_round_trip(dtype: str, shape: tuple[int, ...], m: int) -> None:
    arrays = [np.zeros(shape, dtype), np.zeros((2, 5), np.uint8)]
    specs = decode_header(encode_header(m, ["x", "y"], arrays), m, 2)
    assert specs == [(np.dtype(dtype), shape), (np.dtype(np.uint8), (2, 5))]


@given(st.lists(st.tuples(st.sampled_from(DTYPES),
                          hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)),
                max_size=6),
       st.integers(0, 1000))
def test_pack_unpack_round_trip_aligned(items: list[tuple[str, tuple[int, ...]]],
                                        seed: int) -> None:
    arrays = [sample(d, s, seed + i) for i, (d, s) in enumerate(items)]
    buffer = pack(arrays)
    assert buffer.dtype == np.uint8
    assert len(buffer) == sum(-(-a.nbytes // ALIGN) * ALIGN for a in arrays)
    specs = [(a.dtype, a.shape) for a in arrays]
    for got, want in zip(unpack(buffer, specs), arrays):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.ctypes.data % ALIGN == buffer.ctypes.data % ALIGN  # offsets are aligned
        np.testing.assert_array_equal(got, want)


def test_pack_pads_with_zeros_between_tensors() -> None:
    buffer = pack([np.array([1], np.uint8), np.array([2, 3], np.uint8)])
    assert buffer.tolist() == [1] + [0] * 15 + [2, 3] + [0] * 14


def test_bad_headers_raise() -> None:
    head = encode_header(7, ["a", "b"], [np.zeros(3), np.zeros(2)])
    with pytest.raises(RuntimeError, match="expected micro-batch 8 with 2 tensors, got 7 with 2"):
        decode_header(head, 8, 2)
    with pytest.raises(RuntimeError, match="expected micro-batch 7 with 1 tensors, got 7 with 2"):
        decode_header(head, 7, 1)
    corrupt = head.copy()
    corrupt[2] = len(CODES)  # an unknown dtype code
    with pytest.raises(IndexError):
        decode_header(corrupt, 7, 2)
    with pytest.raises(PartitionError, match=r"tensor 'deep' has 9 dims; at most 8"):
        encode_header(0, ["deep"], [np.zeros((1,) * 9)])
    with pytest.raises(PartitionError, match="'s' of dtype object cannot be sent"):
        encode_header(0, ["s"], [np.array(["text"], dtype=object)])



def test_send_frames_header_packed_small_then_each_large_tensor() -> None:
    wire = CapturedWire()
    big = np.arange(SMALL_BYTES // 8, dtype=np.int64)  # exactly SMALL_BYTES: sent on its own
    env = {"b": big, "a": np.array([1, 2], np.int16), "c": np.zeros((2, 0), np.float32)}
    wire.send(1, 3, ["a", "b", "c"], env, [])
    head, packed, alone = wire.sent
    assert decode_header(head, 3, 3) == [(np.dtype(np.int16), (2,)),
                                         (np.dtype(np.int64), big.shape),
                                         (np.dtype(np.float32), (2, 0))]
    assert packed.tolist() == [1, 0, 2, 0] + [0] * 12  # little-endian int16, padded to 16
    assert alone.view(np.int64).tolist() == big.tolist()
    wire.sent.clear()
    wire.send(1, 0, ["c"], env, [])  # zero bytes in all: the header alone
    assert len(wire.sent) == 1


def test_send_keeps_a_0d_tensor_0d() -> None:
    wire = CapturedWire()
    wire.send(1, 0, ["s"], {"s": np.array(2.5, np.float32)}, [])
    assert decode_header(wire.sent[0], 0, 1) == [(np.dtype(np.float32), ())]


# ------------------------------------------------------------------------------ two gloo ranks


def _cases() -> list[dict[str, np.ndarray]]:
    """Messages rank 0 sends, in order (micro-batch m = index): every dtype in every shape of
    SHAPES, small and large tensors mixed, views that are not contiguous or not writeable,
    only empty tensors, and nothing at all."""
    every = {f"{d}{s}": sample(d, s, i) for i, (d, s) in
             enumerate((d, s) for d in DTYPES for s in SHAPES)}
    big = np.arange(SMALL_BYTES // 4 + 3, dtype=np.float32)  # just over SMALL_BYTES
    frozen = np.arange(6, dtype=np.int32)
    frozen.flags.writeable = False
    mixed = {"big": big, "tiny": np.array([2.5]), "wide": np.ones((SMALL_BYTES,), np.bool_),
             "t": np.arange(12, dtype=np.float64).reshape(3, 4).T, "ro": frozen}
    empty = {"e0": np.zeros((0, 4), np.float32), "e1": np.zeros((2, 0), np.int64)}
    return [every, mixed, empty, {}]


def _rank(rank: int, store_path: str, results: Any) -> None:
    """Rank 0 sends every case to rank 1, which receives it and checks it; then rank 1 waits on
    a receive that rank 0 never sends (the error names the peer)."""
    try:
        import torch.distributed as dist

        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        store = dist.FileStore(store_path, 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=3))
        wire = Wire(torch.device("cpu"), peer=lambda r: f"stage {r} (rank {r})")
        cases = _cases()
        if rank == 0:
            pending: list[Any] = []
            for m, env in enumerate(cases):
                wire.send(1, m, sorted(env), env, pending)
            wire.wait(pending)
            assert pending == []
            dist.barrier()
            results.put((rank, "ok"))
            return
        for m, env in enumerate(cases):
            got = wire.recv(0, m, sorted(env))
            assert list(got) == sorted(env)
            for name, want in env.items():
                assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
                assert got[name].flags.c_contiguous and got[name].flags.writeable, name
                np.testing.assert_array_equal(got[name], want, err_msg=name)
        dist.barrier()
        try:
            wire.recv(0, len(cases), ["never"])
        except RuntimeError as exc:
            results.put((rank, str(exc).split(":")[0]))
            return
        results.put((rank, "no error"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _two_ranks(target: Callable[[int, str, Any], None], tmp_path: Path) -> dict[int, str]:
    """Run ``target(rank, store, results)`` in two spawned processes; each rank's answer."""
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=target, args=(r, str(tmp_path / "store"), results))
             for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        return dict(results.get(timeout=60) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def test_two_gloo_ranks_exchange_every_dtype_and_shape(tmp_path: Path) -> None:
    answers = _two_ranks(_rank, tmp_path)
    assert answers == {0: "ok", 1: "receiving from stage 0 (rank 0)"}


# ------------------------------------------------------- the training wire: every torch dtype


def _torch_cases() -> dict[str, torch.Tensor]:
    """One (2, 3) tensor of every torch dtype the wire carries (bfloat16, float8 included)."""
    cases = {}
    for dtype in TORCH_DTYPES:
        if dtype is not None:
            value = torch.arange(6, dtype=torch.float32).reshape(2, 3) - 2
            cases[str(dtype).removeprefix("torch.")] = value.to(dtype)
    return cases


def _torch_rank(rank: int, store_path: str, results: Any) -> None:
    """Rank 0 sends every dtype with a header, then again without one (``recv_like``);
    rank 1 checks both bit for bit."""
    try:
        import torch.distributed as dist

        from onnx_partition.runtime.train.comm import TensorWire

        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        store = dist.FileStore(store_path, 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=10))
        wire = TensorWire(torch.device("cpu"))
        cases = _torch_cases()
        names = sorted(cases)
        if rank == 0:
            wire.send(1, 3, names, cases)
            wire.send(1, 3, names, cases, header=False)
            wire.flush()
            wire.wait()
            results.put((rank, "ok"))
            return
        for got in (wire.recv(0, 3, names), wire.recv_like(0, names, cases)):
            for name, want in cases.items():
                assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
                assert torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), name
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_training_wire_carries_every_torch_dtype(tmp_path: Path) -> None:
    assert {"bfloat16", "float16", "float32", "bool", "float8_e4m3fn"} <= set(_torch_cases())
    answers = _two_ranks(_torch_rank, tmp_path)
    assert answers == {0: "ok", 1: "ok"}


def test_torch_dtype_codes_follow_the_numpy_ones() -> None:
    """The numpy codes are unchanged; bfloat16 has its own; an unknown dtype is one line."""
    assert [str(d).removeprefix("torch.") for d in TORCH_DTYPES[:len(DTYPES)]] == list(DTYPES)
    assert torch_dtype_code(torch.bfloat16, "t") == len(DTYPES)
    specs = decode_torch_header(encode_codes(1, ["b"], [(len(DTYPES), (2,))]), 1, 1)
    assert specs == [(torch.bfloat16, (2,))]
    with pytest.raises(RuntimeError, match="a bfloat16 tensor for a numpy receiver"):
        decode_header(encode_codes(1, ["b"], [(len(DTYPES), (2,))]), 1, 1)
    with pytest.raises(PartitionError, match=r"'q' of dtype torch\.qint8 cannot be sent"):
        torch_dtype_code(torch.qint8, "q")
