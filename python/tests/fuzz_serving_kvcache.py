"""The fuzzer's flash_attn_with_kvcache target (test_fuzz_serving.py): the draw (dense,
cache_batch_idx and paged caches, float and 8-bit, the append with rotary, left padding), the
options every target draws, a call's summary, and the target's mutations."""

from __future__ import annotations

import inspect

import flashcte
import numpy as np
from conftest import assert_close, assert_stat_close, check_allclose
from fuzz_serving_draw import (
    codes,
    draw_heads,
    dtype_fault,
    kv8_scales,
    place,
    read_only_fault,
    rng_of,
    scalar_fault,
    scales_fault,
    shape_fault,
    table_fault,
    values,
)
from fuzz_serving_kvcache_contract import check_kv8_append, dequantized, kvcache_contract, rotated_q
from fuzz_serving_model import FLOATS, FORMATS, Call, dtype_of, name_of
from hypothesis import strategies as st
from semantics import kvcache_ref


def draw_kvcache(draw) -> Call:
    rng = rng_of(draw)
    dtype = draw(st.sampled_from(FLOATS), label="dtype")
    batch = draw(st.sampled_from([1, 1, 2, 3, 0]), label="batch")
    hk, heads, d, dv = draw_heads(draw)
    sq = draw(st.sampled_from([1, 1, 2, 3, 5, 0, 17, 20]), label="seqlen_q")
    new = draw(st.sampled_from([0, 0, 1, 2, 3]), label="seqlen_new")
    storage = draw(st.sampled_from(["dense", "batch_idx", "paged", "paged"]), label="storage")
    fmt = draw(st.sampled_from([""] * 4 + list(FORMATS)), label="cache format")
    page = draw(st.sampled_from([1, 2, 3, 5, 16]), label="page") if storage == "paged" else 0
    wanted = draw(st.integers(max(new, 1), 48) | st.just(1100), label="capacity")
    pages = -(-wanted // page) if page else 0
    capacity = pages * page if page else wanted
    lengths = rng.integers(0, capacity - new + 1, batch).astype(np.int32)
    form = draw(st.sampled_from(["array", "array", "int", "list", "none"]), label="cache_seqlens")
    kwargs: dict = {"q": values(rng, (batch, sq, heads, d), dtype)}
    if form == "int" and batch:
        lengths[:] = lengths[0]
    if form == "none" and not new:
        lengths[:] = capacity
    kwargs["cache_seqlens"] = {
        "array": lengths,
        "int": int(lengths[0]) if batch else 0,
        "list": lengths.tolist(),
        "none": None,
    }[form]

    def cache_values(shape, last):
        if fmt:
            return codes(rng, shape + (last,), fmt)
        return values(rng, shape + (last,), dtype)

    if page:
        num_blocks = batch * pages + draw(st.integers(0, 2), label="spare pages")
        table = rng.permutation(num_blocks)[: batch * pages].reshape(batch, pages)
        if batch > 1 and not new and draw(st.booleans(), label="shared pages"):
            table[1, : pages // 2 + 1] = table[0, : pages // 2 + 1]  # read-only prefix sharing
        kwargs["block_table"] = table.astype(np.int32)
        cache_shape = (num_blocks, page, hk)
    elif storage == "batch_idx":
        rows = batch + draw(st.integers(0, 2), label="spare rows")
        kwargs["cache_batch_idx"] = rng.permutation(rows)[:batch].astype(np.int32)
        cache_shape = (rows, capacity, hk)
    else:
        cache_shape = (batch, capacity, hk)
    kwargs["k_cache"] = cache_values(cache_shape, d)
    kwargs["v_cache"] = cache_values(cache_shape, dv)
    if fmt:
        for name in ("k_scale", "v_scale"):
            granularity = draw(st.sampled_from(["tensor", "head", "token"]), label=name)
            shape = {"tensor": (1,), "head": (hk,), "token": cache_shape}[granularity]
            scale = kv8_scales(rng, fmt, shape)
            python_float = granularity == "tensor" and draw(st.booleans(), label="float scale")
            kwargs[name] = float(scale[0]) if python_float else scale
    if new:
        kwargs["k"] = values(rng, (batch, new, hk, d), dtype)
        kwargs["v"] = values(rng, (batch, new, hk, dv), dtype)
        if d >= 2 and draw(st.booleans(), label="rotary"):
            half = draw(st.integers(1, d // 2), label="rotary_dim / 2")
            positions = capacity + max(sq, new) + draw(st.integers(0, 3))
            angle = rng.random((positions, half)) * 2 * np.pi
            table_dtype = draw(st.sampled_from([dtype, "float32"]), label="rotary dtype")
            kwargs["rotary_cos"] = np.cos(angle).astype(dtype_of(table_dtype))
            kwargs["rotary_sin"] = np.sin(angle).astype(dtype_of(table_dtype))
            kwargs["rotary_interleaved"] = draw(st.booleans(), label="interleaved")
    if batch and draw(st.booleans(), label="leftpad"):
        full = np.asarray(lengths if form != "none" else np.full(batch, capacity))
        kwargs["cache_leftpad"] = np.array([rng.integers(0, n + 1) for n in full], np.int32)
    options(draw, rng, kwargs, heads, batch)
    kwargs["num_splits"] = draw(st.sampled_from([0, 0, 1, 3]), label="num_splits")
    kwargs["return_softmax_lse"] = draw(st.booleans(), label="lse")
    for name in ("q", "k_cache", "v_cache", "k", "v", "k_scale", "v_scale"):
        if isinstance(kwargs.get(name), np.ndarray):
            kwargs[name] = place(draw, kwargs[name])

    mutation = draw(st.sampled_from([None] * 6 + KVCACHE_MUTATIONS), label="mutation")
    if mutation:
        mutation(draw, rng, kwargs)
    c, info = kvcache_contract(kwargs)
    appending = kwargs.get("k") is not None

    def check(result, before, after):
        out, lse = result if after.get("return_softmax_lse") else (result, None)
        args = {n: before[n] for n in inspect.signature(kvcache_ref).parameters if n in before}
        args["cache_seqlens"] = info["lengths"]
        if info["kf"]:
            # The append first, checked on its own; then attention over the verified cache.
            if appending:
                check_kv8_append(before, after, info, "k")
                check_kv8_append(before, after, info, "v")
            args.update(k=None, v=None, cache_seqlens=info["lengths"] + info["new"])
            if args.get("rotary_cos") is not None:
                # q turned where the append put it (kvcache_ref would take the grown lengths).
                args["q"] = rotated_q(args, info["lengths"])
                args.update(rotary_cos=None, rotary_sin=None)
            args["k_cache"] = dequantized(after["k_cache"], after["k_scale"], info["k_scale"])
            args["v_cache"] = dequantized(after["v_cache"], after["v_scale"], info["v_scale"])
        ref_out, ref_lse, k_after, v_after = kvcache_ref(**args)
        assert_close(out, ref_out, info["dtype"])
        if lse is not None:
            assert_stat_close(lse, ref_lse, info["dtype"], "lse")
        if appending and not info["kf"]:
            # FlashAttention's rule for the append: v exactly, k within 1e-3 after rotary.
            check_allclose(after["v_cache"], v_after, rtol=0, atol=0, what="v_cache")
            rotary = 1e-3 if before.get("rotary_cos") is not None else 0.0
            check_allclose(after["k_cache"], k_after, rtol=rotary, atol=rotary, what="k_cache")

    written = ("k_cache", "v_cache", "k_scale", "v_scale") if appending else ()
    summary = summarize(kwargs, mutation)
    return Call(flashcte.flash_attn_with_kvcache, kwargs, c, check, written, summary=summary)


def options(draw, rng, kwargs: dict, heads: int, batch: int, names=None) -> None:
    """The masks and score modifiers, under the target's names for them."""
    names = names or {}
    kwargs["causal"] = draw(st.booleans(), label="causal")
    if draw(st.booleans(), label="window"):
        w = (draw(st.integers(-1, 6), label="left"), draw(st.integers(-1, 6), label="right"))
        kwargs[names.get("window_size", "window_size")] = w
    kwargs["softcap"] = draw(st.sampled_from([0.0, 0.0, 0.0, 0.5, 3.0]), label="softcap")
    form = draw(st.sampled_from([None, None, "heads", "batch_heads"]), label="alibi")
    if form:
        shape = (heads,) if form == "heads" else (batch, heads)
        kwargs["alibi_slopes"] = (rng.random(shape) * 0.5).astype(np.float32)
    scale = draw(st.sampled_from([None, None, 0.3, -0.7, 0.0, 1.3]), label="softmax_scale")
    if scale is not None or "softmax_scale" not in names:
        kwargs[names.get("softmax_scale", "softmax_scale")] = scale
    kwargs["num_threads"] = draw(st.sampled_from([None, 1, 2, 3]), label="num_threads")


def summarize(kwargs: dict, mutation) -> dict:
    def brief(x):
        if isinstance(x, np.ndarray):
            layout = "" if x.flags.c_contiguous else f" strides={x.strides}"
            return f"{name_of(x)}{list(x.shape)}{layout}"
        return x

    summary = {n: brief(x) for n, x in kwargs.items()}
    summary["mutation"] = getattr(mutation, "__name__", None)
    return summary


# flash_attn_with_kvcache's own faults.


def _kv_lengths(draw, rng, kw):
    given = kw.get("cache_seqlens")
    lengths = np.array(0 if given is None else given, np.int64).reshape(-1)
    kind = draw(st.sampled_from(["negative", "past", "int64", "short", "python"]))
    if kind == "int64":
        kw["cache_seqlens"] = lengths.astype(np.int64)
        return
    if kind == "short":
        kw["cache_seqlens"] = lengths[:-1].astype(np.int32)
        return
    if kind == "python":
        kw["cache_seqlens"] = draw(st.sampled_from([-1, 10_000, 0]))
        return
    if lengths.size:
        lengths[draw(st.integers(0, lengths.size - 1))] = -1 if kind == "negative" else 10_000
    kw["cache_seqlens"] = lengths.astype(np.int32)


def _kv_table(draw, rng, kw):
    if kw.get("block_table") is None:
        kw["block_table"] = np.zeros((kw["q"].shape[0], 1), np.int32)  # a dense cache as pages
    else:
        table_fault(draw, rng, kw)


def _kv_batch_idx(draw, rng, kw):
    batch = kw["q"].shape[0]
    idx = rng.integers(0, kw["k_cache"].shape[0] + 1, batch)
    idx[: draw(st.integers(0, batch))] = draw(st.sampled_from([-1, 0]))
    kw["cache_batch_idx"] = idx.astype(draw(st.sampled_from(["int32", "int32", "int64"])))


def _kv_leftpad(draw, rng, kw):
    batch = kw["q"].shape[0]
    pad = np.full(batch, draw(st.sampled_from([-1, 5, 60, 2000])), np.int32)
    kw["cache_leftpad"] = pad if draw(st.booleans()) else pad.astype(np.int64)


def _kv_half_append(draw, rng, kw):
    kw.pop(draw(st.sampled_from(["k", "v"])), None)


def _kv_rotary(draw, rng, kw):
    cos, sin = kw.get("rotary_cos"), kw.get("rotary_sin")
    if cos is None:
        d = kw["q"].shape[3]
        kw["rotary_cos"] = kw["rotary_sin"] = np.ones((64, max(d // 2, 1)), np.float32)
        return
    kind = draw(st.sampled_from(["short", "only_cos", "wide", "mismatch"]))
    if kind == "short":
        n = draw(st.integers(0, 4))
        kw["rotary_cos"], kw["rotary_sin"] = cos[:n], sin[:n]
    elif kind == "only_cos":
        kw.pop("rotary_sin")
    elif kind == "wide":
        kw["rotary_cos"] = kw["rotary_sin"] = np.ones((cos.shape[0], kw["q"].shape[3]), cos.dtype)
    else:
        kw["rotary_sin"] = sin[:, :-1]


def _kv_nan_new(draw, rng, kw):
    k = kw.get("k")
    if isinstance(k, np.ndarray) and k.size:
        k[(0,) * k.ndim] = np.nan


KVCACHE_MUTATIONS = [
    dtype_fault("q", "k_cache", "v_cache", "k", "v", "rotary_cos"),
    _kv_lengths,
    _kv_table,
    _kv_batch_idx,
    _kv_leftpad,
    _kv_half_append,
    shape_fault("q", "k_cache", "v_cache", "k", "v"),
    _kv_rotary,
    scalar_fault(("num_splits", -1)),
    read_only_fault("k_cache", "v_cache", "k_scale", "v_scale"),
    scales_fault,
    _kv_nan_new,
]
