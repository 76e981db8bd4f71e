"""The fuzzer's generators shared by its targets (test_fuzz_serving.py): arrays drawn with their
memory layout (slices of padded buffers holding a sentinel, permuted storage, negative strides),
values, 8-bit codes and scales; and the faults the targets share (a wrong dtype or shape, a
read-only array, a bad page table, a bad scalar, bad scales)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from fuzz_serving_model import DIMS, FLOATS, FORMATS, LAYOUTS, TOP, WRONG_FLOAT, dtype_of, name_of
from hypothesis import strategies as st
from semantics import f64

# ---- drawing arrays ----------------------------------------------------------------------------


def draw_heads(draw) -> tuple[int, int, int, int]:
    """(kv_heads, heads, d, dv): GQA groups of 1 to 3, head dims around the SIMD widths."""
    hk = draw(st.integers(1, 3), label="heads_k")
    heads = hk * draw(st.sampled_from([1, 1, 2, 3]), label="group")
    d = draw(st.sampled_from(DIMS), label="d")
    dv = d if draw(st.booleans(), label="dv == d") else draw(st.sampled_from(DIMS), label="dv")
    return hk, heads, d, dv


def sentinel(dtype: np.dtype):
    """What fills the padding around a sliced argument: a value that shows up if read."""
    if dtype == np.int8:
        return -128  # outside the codes a cache holds (+-127)
    if np.issubdtype(dtype, np.integer):
        return np.iinfo(dtype).max  # out of range as a page, a length or an offset
    return np.nan  # floats, bfloat16 and float8


def place(draw, a: np.ndarray, layout: str | None = None) -> np.ndarray:
    """`a`'s values in a fresh buffer of a drawn layout: contiguous; a slice (maybe every other
    row) of a larger buffer padded with the sentinel; storage in permuted axis order read
    through a transposed view; or storage reversed along an axis read with a negative stride."""
    layout = layout or draw(st.sampled_from(LAYOUTS), label="layout")
    if a.ndim == 0 or layout == "contiguous":
        return a.copy()
    if layout == "padded":
        axis = draw(st.integers(0, a.ndim - 1), label="padded axis")
        step = draw(st.sampled_from([1, 1, 2]), label="step")
        before, after = draw(st.integers(0, 2)), draw(st.integers(0, 2))
        shape = list(a.shape)
        shape[axis] = before + step * a.shape[axis] + after
        big = np.empty(shape, a.dtype)
        big[...] = sentinel(a.dtype)
        index = [slice(None)] * a.ndim
        index[axis] = slice(before, before + step * a.shape[axis], step)
        view = big[tuple(index)]
        view[...] = a
        return view
    if layout == "permuted":
        perm = draw(st.permutations(range(a.ndim)), label="storage order")
        return np.ascontiguousarray(a.transpose(perm)).transpose(np.argsort(perm))
    axis = draw(st.integers(0, a.ndim - 1), label="reversed axis")
    return np.flip(np.ascontiguousarray(np.flip(a, axis)), axis)


def negative_strides(a: Any) -> bool:
    """A negative stride, which _tensors.viewable copies away (even over one element): an
    argument written in place is then refused."""
    return isinstance(a, np.ndarray) and any(s < 0 for s in a.strides)


def values(rng, shape, dtype: str, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dtype_of(dtype))


def kv8_scales(rng, fmt: str, shape) -> np.ndarray:
    """Dequantization scales that make codes() values of magnitude ~1 (0.25 to 2 times its
    spread's inverse), as a real cache's: far larger values make the scores hundreds, whose
    softmax amplifies float32 rounding past the output rule (max|ref|-relative) by itself."""
    return (rng.uniform(0.25, 2.0, shape) * 8 / TOP[fmt]).astype(np.float32)


def codes(rng, shape, fmt: str) -> np.ndarray:
    """Random 8-bit cache codes: int8 in [-127, 127], float8 of a spread of magnitudes."""
    if fmt == "int8":
        return rng.integers(-127, 128, shape).astype(np.int8)
    return (rng.standard_normal(shape) * (TOP[fmt] / 8)).astype(FORMATS[fmt])


def rng_of(draw) -> np.random.Generator:
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="values seed"))


def retype(draw, a: np.ndarray, wrong: tuple) -> np.ndarray:
    dtype = draw(st.sampled_from(wrong), label="wrong dtype")
    return f64(a).astype(dtype) if dtype != "int8" else f64(a).astype(np.int8)


def is_float(a: Any) -> bool:
    return isinstance(a, np.ndarray) and name_of(a) in FLOATS


def int_table(a: Any) -> np.ndarray | None:
    """An int32 table argument as an array (None for the wrong kind): lists become int32."""
    if isinstance(a, (list, tuple)):
        return np.asarray(a, np.int32)
    if isinstance(a, np.ndarray) and a.dtype == np.int32:
        return a
    return None


# ---- faults the targets share -------------------------------------------------------------------

# As factories over the argument names a target has: each returns a
# mutation (draw, rng, kwargs) that changes kwargs in place.


def heads_of(kw: dict) -> int:
    """q's heads: axis 2 of (batch, seqlen_q, heads, d), axis 1 of (total_q, heads, d)."""
    q = kw["q"]
    return q.shape[-2] if isinstance(q, np.ndarray) and q.ndim >= 2 else 1


def mutation(name: str, fn: Callable) -> Callable:
    fn.__name__ = name
    return fn


def dtype_fault(*names: str) -> Callable:
    """One float argument in a dtype it must not have (float16 / float32 against q's)."""

    def fault(draw, rng, kw):
        name = draw(st.sampled_from(names))
        if isinstance(kw.get(name), np.ndarray):
            kw[name] = retype(draw, kw[name], WRONG_FLOAT + ("float16", "float32"))

    return mutation("dtype", fault)


def shape_fault(*names: str) -> Callable:
    """One array one shorter along an axis, or with an inserted axis (one more rank)."""

    def fault(draw, rng, kw):
        name = draw(st.sampled_from(names))
        x = kw.get(name)
        if isinstance(x, np.ndarray):
            axis = draw(st.integers(0, max(x.ndim - 1, 0)))
            index = [slice(None)] * x.ndim
            if x.ndim and draw(st.booleans()):
                index[axis] = slice(0, max(x.shape[axis] - 1, 0))
            else:
                index.insert(axis, None)
            kw[name] = x[tuple(index)]

    return mutation("shape", fault)


def read_only_fault(*names: str) -> Callable:
    def fault(draw, rng, kw):
        name = draw(st.sampled_from(names))
        if isinstance(kw.get(name), np.ndarray):
            kw[name].flags.writeable = False

    return mutation("read_only", fault)


def table_fault(draw, rng, kw):
    """block_table: an entry out of range (or another sequence's page), int64, rank 1, one
    column short."""
    table = kw.get("block_table")
    if table is None:
        return
    kind = draw(st.sampled_from(["entry", "entry", "int64", "rank1", "narrow", "shared"]))
    table = np.array(table)
    if kind == "int64":
        kw["block_table"] = table.astype(np.int64)
    elif kind == "rank1":
        kw["block_table"] = table.reshape(-1)
    elif kind == "narrow":
        kw["block_table"] = table[:, : max(table.shape[1] - 1, 0)]
    elif table.size:
        b = draw(st.integers(0, table.shape[0] - 1))
        col = draw(st.integers(0, table.shape[1] - 1))
        if kind == "shared":
            table[b, col] = table[draw(st.integers(0, table.shape[0] - 1)), 0]
        else:
            table[b, col] = draw(st.sampled_from([-1, -(2**31), kw["k_cache"].shape[0], 2**31 - 1]))
        kw["block_table"] = table


def scalar_fault(*extra: tuple) -> Callable:
    """A mask or score option out of its domain (and the target's own `extra` (name, value))."""

    def fault(draw, rng, kw):
        heads = heads_of(kw)
        name, value = draw(
            st.sampled_from(
                [
                    ("window_size", (-2, 0)),
                    ("window_size", (0, -5)),
                    ("window_size", "wide"),
                    ("softcap", -1.0),
                    ("softcap", float("nan")),
                    ("softmax_scale", float("nan")),
                    ("softmax_scale", float("inf")),
                    ("alibi_slopes", np.ones(heads + 1, np.float32)),
                    ("alibi_slopes", np.full(heads, np.nan, np.float32)),
                    ("alibi_slopes", np.ones((2, 3, heads), np.float32)),
                ]
                + list(extra)
            )
        )
        kw[name] = value

    return mutation("scalars", fault)


def scales_fault(draw, rng, kw):
    """An 8-bit cache's scale dropped, out of its domain, misshapen, float64, or given to a float
    cache."""
    name = draw(st.sampled_from(["k_scale", "v_scale"]))
    s = kw.get(name)
    kind = draw(st.sampled_from(["drop", "zero", "shape", "float64", "to_float_cache"]))
    if kind == "drop":
        kw.pop(name, None)
    elif kind == "zero":
        kw[name] = draw(st.sampled_from([0.0, -1.0, float("nan")]))
    elif kind == "shape":
        kw[name] = np.ones(7, np.float32)
    elif kind == "float64" and isinstance(s, np.ndarray):
        kw[name] = s.astype(np.float64)
    elif kind == "to_float_cache":
        kw[name] = 0.5
