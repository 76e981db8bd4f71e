"""The fuzzer's mixed-batch targets (test_fuzz_serving.py): flash_attn_varlen_func over pages and
paged_attention, one draw for both (decode steps and prefill chunks over a shuffled page pool),
their contract and mutations."""

from __future__ import annotations

from typing import Any

import flashcte
import numpy as np
from conftest import assert_close, assert_stat_close
from fuzz_serving_draw import (
    codes,
    draw_heads,
    dtype_fault,
    is_float,
    kv8_scales,
    negative_strides,
    place,
    read_only_fault,
    rng_of,
    scalar_fault,
    scales_fault,
    shape_fault,
    table_fault,
    values,
)
from fuzz_serving_kv8 import scale_contract
from fuzz_serving_kvcache import options, summarize
from fuzz_serving_kvcache_contract import (
    alibi_contract,
    dequantized,
    pages_read,
    pages_seen,
    table_contract,
    threads_contract,
    window_contract,
)
from fuzz_serving_model import FLOATS, FORMATS, Call, Contract, dtype_of, name_of
from fuzz_serving_varlen import (
    QUERY_LENGTHS,
    VARLEN_PAGED_NAMES,
    _varlen_max_seqlen,
    draw_offsets,
    offsets,
    offsets_contract,
    offsets_fault,
)
from hypothesis import strategies as st
from semantics import f64, varlen_kvcache_ref

# ---- the mixed batch: flash_attn_varlen_func over pages, and paged_attention ------------------
#
# One draw for both (they share the library's flash_attn_varlen_kvcache), in the names below
# (flash_attn_varlen_func's, the caches as the library names them); each target's own names
# replace them before the call. The caches are only read: a call must leave them as they were.

PAGED_NAMES = {
    "q": "query",
    "k_cache": "key_cache",
    "v_cache": "value_cache",
    "seqused_k": "seq_lens",
    "cu_seqlens_q": "query_start_loc",
    "softmax_scale": "scale",
    "window_size": "window",
}


def nhd(x: Any, hnd: bool) -> Any:
    """A cache (num_blocks, heads_k, block_size, d) or a per-token scale (num_blocks, heads_k,
    block_size) in HND as the (num_blocks, block_size, heads_k, ...) view the library reads."""
    if hnd and isinstance(x, np.ndarray) and x.ndim in (3, 4):
        return x.swapaxes(1, 2)
    return x


def draw_mixed(draw, api: str) -> Call:
    """A mixed batch of decode steps and prefill chunks over a shuffled page pool, for
    flash_attn_varlen_func(block_table=...) (api "varlen") or paged_attention ("paged")."""
    paged = api == "paged"
    rng = rng_of(draw)
    dtype = draw(st.sampled_from(FLOATS), label="dtype")
    nseq = draw(st.sampled_from([1, 1, 2, 3, 4, 0]), label="sequences")
    hk, heads, d, dv = draw_heads(draw)
    page = draw(st.sampled_from([1, 2, 3, 5, 16]), label="page")
    len_q = [draw(st.sampled_from(QUERY_LENGTHS), label="seqlen_q") for _ in range(nseq)]
    used = [n + draw(st.sampled_from([0, 0, 1, 4, 9, 30]), label="cached") for n in len_q]
    if nseq and draw(st.integers(0, 9), label="fewer keys than queries") == 0:
        b = draw(st.integers(0, nseq - 1))
        used[b] = draw(st.integers(0, max(len_q[b] - 1, 0)))
    hnd = paged and draw(st.booleans(), label="HND")
    formats = [""] * (4 if paged else 16) + list(FORMATS)  # varlen takes no scales: refused
    fmt = draw(st.sampled_from(formats), label="cache format")
    pages = max(-(-max(used, default=0) // page), 1) + draw(st.integers(0, 1), label="spare")
    num_blocks = nseq * pages + draw(st.integers(0, 2), label="spare pages")
    table = rng.permutation(num_blocks)[: nseq * pages].reshape(nseq, pages).astype(np.int32)
    if nseq > 1 and draw(st.booleans(), label="shared pages"):
        table[1, : pages // 2 + 1] = table[0, : pages // 2 + 1]  # prefix sharing, read only
    if draw(st.booleans(), label="-1 past the used pages"):
        for b in range(nseq):
            table[b, -(-used[b] // page) :] = -1  # never read
    cache_shape = (num_blocks, page, hk)

    def cache(last):
        x = (
            codes(rng, cache_shape + (last,), fmt)
            if fmt
            else values(rng, cache_shape + (last,), dtype)
        )
        return np.ascontiguousarray(x.swapaxes(1, 2)) if hnd else x

    kwargs: dict = {
        "q": values(rng, (sum(len_q), heads, d), dtype),
        "k_cache": cache(d),
        "v_cache": cache(dv),
        "cu_seqlens_q": offsets(len_q).astype(np.int32),
        "block_table": table,
    }
    if draw(st.booleans(), label="lists"):
        kwargs["cu_seqlens_q"] = kwargs["cu_seqlens_q"].tolist()
    if fmt and paged:  # flash_attn_varlen_func takes no scales: its 8-bit caches are refused
        for name in ("k_scale", "v_scale"):
            granularity = draw(st.sampled_from(["tensor", "head", "token"]), label=name)
            shape = {"tensor": (1,), "head": (hk,), "token": cache_shape}[granularity]
            scale = kv8_scales(rng, fmt, shape)
            if granularity == "tensor" and draw(st.booleans(), label="float scale"):
                kwargs[name] = float(scale[0])
            else:
                kwargs[name] = nhd(scale, hnd).copy() if granularity == "token" else scale
    options(draw, rng, kwargs, heads, nseq)
    if paged:
        kwargs["seqused_k"] = np.array(used, np.int32)
        if kwargs.get("softmax_scale") is None:
            kwargs["softmax_scale"] = d**-0.5  # required
        form = draw(st.sampled_from([None, None, "values", "with -inf"]), label="sinks")
        if form:
            sinks = rng.standard_normal(heads).astype(np.float32)
            if form == "with -inf":
                sinks[draw(st.integers(0, heads - 1))] = -np.inf  # no sink for that head
            kwargs["sinks"] = sinks
        if draw(st.booleans(), label="output"):
            kwargs["output"] = np.full((sum(len_q), heads, dv), np.nan, dtype_of(dtype))
        layout = draw(st.sampled_from(["default", "named"]), label="kv_layout")
        if not hnd or layout == "named":
            kwargs["kv_layout"] = "HND" if hnd else "NHD"
    else:
        lengths = draw(st.sampled_from(["seqused_k", "cu_seqlens_k", "both"]), label="lengths")
        kwargs["cu_seqlens_k"] = None
        if lengths != "seqused_k":
            # With both, seqused_k says the lengths and cu_seqlens_k is not read.
            kwargs["cu_seqlens_k"] = draw_offsets(
                draw, used if lengths == "cu_seqlens_k" else len_q, "cu_seqlens_k"
            )
        if lengths != "cu_seqlens_k":
            kwargs["seqused_k"] = np.array(used, np.int32)
        kwargs["max_seqlen_q"] = max(len_q, default=0) + draw(st.sampled_from([0, 0, 1, 9]))
        kwargs["max_seqlen_k"] = max(used, default=0) + draw(st.sampled_from([0, 0, 1, 9]))
        kwargs["return_softmax_lse"] = draw(st.booleans(), label="lse")
    for name in ("q", "k_cache", "v_cache", "k_scale", "v_scale", "output"):
        if isinstance(kwargs.get(name), np.ndarray):
            kwargs[name] = place(draw, kwargs[name])

    mutations = MIXED_MUTATIONS + (PAGED_MUTATIONS if paged else VARLEN_PAGED_MUTATIONS)
    mutation = draw(st.sampled_from([None] * 6 + mutations), label="mutation")
    if mutation:
        mutation(draw, rng, kwargs)
    c, info = mixed_contract(kwargs, api)

    def check(result, before, after):
        out, lse = result if after.get("return_softmax_lse") else (result, None)
        if before.get("output") is not None:
            assert out is after["output"], "output given: the call returns it"
        caches = {}
        for side in ("k", "v"):
            x = nhd(before[f"{side}_cache"], info["hnd"])
            fmt = info["kf" if side == "k" else "vf"]
            if fmt:
                scale = nhd(np.asarray(before[f"{side}_scale"]), info["hnd"])
                x = dequantized(x, scale, info[f"{side}_scale"])
            caches[side] = f64(x)
        ref_out, ref_lse = varlen_kvcache_ref(
            before["q"],
            caches["k"],
            caches["v"],
            info["cu"],
            info["used"],
            info["table"],
            before.get("softmax_scale"),
            before.get("causal", paged),
            before.get("window_size", (-1, -1)),
            before.get("softcap", 0.0),
            before.get("alibi_slopes"),
            before.get("sinks"),
        )
        assert_close(out, ref_out, info["dtype"])
        if lse is not None:
            assert_stat_close(lse, ref_lse, info["dtype"], "lse")

    names = PAGED_NAMES if paged else VARLEN_PAGED_NAMES
    fn = flashcte.paged_attention if paged else flashcte.flash_attn_varlen_func
    summary = summarize({names.get(n, n): x for n, x in kwargs.items()}, mutation)
    call = Call(fn, kwargs, c, check, ("output",) if paged else (), summary=summary)
    call.foreign = frozenset(dict(names, out="output") if paged else names)
    return renamed(call, names)


def renamed(call: Call, names: dict) -> Call:
    """`call` (drawn, checked against its contract and referenced in the shared names) with the
    target's names for its arguments: the call and run() see these, `check` the shared ones."""
    back = {v: k for k, v in names.items()}
    shared_check = call.check

    def rename(kwargs: dict) -> dict:
        return {back.get(n, n): x for n, x in kwargs.items()}

    def check(result, before, after):
        shared_check(result, rename(before), rename(after))

    call.kwargs = {names.get(n, n): x for n, x in call.kwargs.items()}
    call.written = tuple(names.get(n, n) for n in call.written)
    call.check = check
    return call


def mixed_contract(kw: dict, api: str) -> tuple[Contract, dict]:
    """The mixed batch's documented contract (kvcache.h, flash_attn_varlen_kvcache; the
    docstrings of flash_attn_varlen_func and paged_attention) on `kw` in the shared names."""
    c = Contract()
    info: dict = {}
    paged = api == "paged"
    layout = kw.get("kv_layout", "HND") if paged else "NHD"
    if layout not in ("HND", "NHD"):
        c.refuse(f"kv_layout {layout!r}")
        return c, info
    hnd = layout == "HND"
    q = kw["q"]
    if not is_float(q):
        c.refuse(f"q is {name_of(q)}")
        return c, info
    if q.ndim != 3:
        c.refuse(f"q has rank {q.ndim}")
        return c, info
    total_q, heads, d = q.shape
    dtype = name_of(q)
    fmts = {}
    for name in ("k_cache", "v_cache"):
        x = kw[name]
        fmt = {v: k for k, v in FORMATS.items()}.get(getattr(x, "dtype", None), "")
        if not (fmt or is_float(x)):
            c.refuse(f"{name} is {name_of(x)}")
        elif x.ndim != 4:
            c.refuse(f"{name} has rank {x.ndim}")
        else:
            fmts[name] = fmt
            if not fmt and name_of(x) != dtype:
                c.refuse(f"{name} is {name_of(x)}, q is {dtype}")
            if fmt and negative_strides(x):
                # Float arrays are copied (_tensors.viewable); an 8-bit cache is read in place.
                c.leave_open(f"{name}: an 8-bit cache with negative strides")
    if len(fmts) < 2:
        return c, info
    kf, vf = fmts["k_cache"], fmts["v_cache"]
    kc, vc = nhd(kw["k_cache"], hnd), nhd(kw["v_cache"], hnd)
    if not paged and (kf or vf):
        c.refuse("an 8-bit cache, and flash_attn_varlen_func takes no k_scale")
    if bool(kf) != bool(vf):
        c.leave_open("one 8-bit cache and one float cache")
    hk, dv = kc.shape[2], vc.shape[3]
    if vc.shape[:3] != kc.shape[:3]:
        c.refuse(f"k_cache {kc.shape} and v_cache {vc.shape} differ before head_dim")
    if hk == 0 or heads % hk:
        c.refuse(f"{heads} heads are not a multiple of {hk} KV heads")
    if kc.shape[3] != d:
        c.refuse(f"k_cache head_dim {kc.shape[3]} != q's {d}")
    if min(total_q, heads, d, dv, kc.shape[0], kc.shape[1]) == 0:
        c.leave_open("an empty dimension")
    cu = offsets_contract(c, "cu_seqlens_q", kw["cu_seqlens_q"], total_q, int32=True)
    if cu is None:
        return c, info
    batch = cu.size - 1
    if kw.get("seqused_k") is not None or paged:
        lengths = table_contract(c, "seqused_k", kw.get("seqused_k"), batch)
        if kw.get("seqused_k") is None:
            c.refuse("seq_lens is None")
    elif kw.get("cu_seqlens_k") is None:
        c.refuse("neither seqused_k nor cu_seqlens_k")
        lengths = None
    else:
        cu_k = offsets_contract(c, "cu_seqlens_k", kw["cu_seqlens_k"])
        lengths = None if cu_k is None else np.diff(cu_k)
        if lengths is not None and lengths.shape != (batch,):
            c.refuse(f"cu_seqlens_k gives {lengths.size} sequences, cu_seqlens_q {batch}")
    if lengths is None or c.refused:
        return c, info
    page = kc.shape[1]
    table = None
    if kw.get("block_table") is None:
        c.leave_open("no block_table: dense caches, one row per sequence (undocumented)")
        if kc.shape[0] != batch:
            c.refuse(f"dense caches of {kc.shape[0]} rows for {batch} sequences")
        capacity = page
    else:
        table = table_contract(c, "block_table", kw["block_table"], batch, shape2=True)
        if table is None:
            return c, info
        if page == 0:
            c.refuse("pages of 0 slots")
        capacity = table.shape[1] * page
    if np.any(lengths < 0) or np.any(lengths > capacity):
        c.refuse(f"seqused_k {lengths.tolist()} outside [0, {capacity}]")
        return c, info
    if table is not None and page:
        # flash_attn_with_kvcache's rule per sequence (kvcache.h): in range where a query row
        # sees the page; the other used pages are left open (a long chunk reads whole tiles).
        for b, col in pages_read(lengths, None, table, page):
            if 0 <= table[b, col] < kc.shape[0]:
                continue
            rows = int(cu[b + 1] - cu[b])
            window = kw.get("window_size", (-1, -1))
            seen = pages_seen([lengths[b]], 0, None, rows, window, kw.get("causal", paged), page)
            if (0, col) in set(seen):
                c.refuse(f"block_table[{b}, {col}] = {table[b, col]} is read and out of range")
            else:
                c.leave_open(f"block_table[{b}, {col}] = {table[b, col]} is out of range, seen by no query")
    if np.any(np.diff(cu) > lengths):
        c.leave_open("a sequence with more queries than keys")
    sinks = kw.get("sinks")
    if sinks is not None:
        if not is_float(sinks):
            c.refuse(f"sinks is {name_of(sinks)}")
        elif name_of(sinks) != "float32":
            c.refuse(f"sinks is {name_of(sinks)}, not float32")
        elif sinks.shape != (heads,):
            c.refuse(f"sinks has shape {sinks.shape}, not ({heads},)")
        elif np.any(np.isnan(sinks) | (sinks == np.inf)):
            c.refuse("sinks holds NaN or +inf")
    alibi_contract(c, kw.get("alibi_slopes"), batch, heads)
    if paged and np.ndim(kw.get("alibi_slopes")) == 2:
        c.leave_open("alibi_slopes (num_seqs, heads): paged_attention documents (heads,)")
    if not paged:
        for name, longest in (("max_seqlen_q", np.diff(cu)), ("max_seqlen_k", lengths)):
            m = kw.get(name)
            if batch and not (isinstance(m, (int, np.integer)) and m >= longest.max()):
                c.refuse(f"{name} = {m!r} is not an int >= the longest sequence")
    window_contract(c, kw, "window_size")
    softcap = kw.get("softcap")
    if softcap is not None and not (np.isfinite(softcap) and softcap >= 0):
        c.refuse(f"softcap {softcap} is not finite and >= 0")
    scale = kw.get("softmax_scale")
    if scale is not None and not np.isfinite(scale):
        c.refuse(f"softmax_scale {scale} is not finite")
    threads_contract(c, kw.get("num_threads"))
    shapes = {"tensor": (1,), "head": (hk,), "token": kc.shape[:3]}
    if hk == 1:
        shapes.pop("head")
    for name, fmt in (("k_scale", kf), ("v_scale", vf)):
        s = kw.get(name)
        if not fmt:
            if s is not None:
                c.refuse(f"{name} with a float cache")
        elif s is None:
            if paged:
                c.refuse(f"an 8-bit cache without {name}")
        else:
            info[name] = scale_contract(c, name, nhd(s, hnd), shapes, False, )
    out = kw.get("output")
    if out is not None:
        if not is_float(out):
            c.refuse(f"output is {name_of(out)}")
        elif not out.flags.writeable or negative_strides(out):
            c.refuse("output is read-only or negatively strided")
        elif out.ndim != 3 or out.shape[:2] != (total_q, heads):
            c.refuse(f"output has shape {out.shape}, not {(total_q, heads, dv)}")
        elif any(
            np.shares_memory(out, x)
            for n, x in kw.items()
            if n != "output" and isinstance(x, np.ndarray)
        ):
            c.refuse("output overlaps an input")
        elif name_of(out) != dtype or out.shape[2] != dv:
            c.refuse(f"output is {name_of(out)}{list(out.shape)}, q is {dtype}")
    info.update(dtype=dtype, kf=kf, vf=vf, cu=cu, used=lengths, table=table, hnd=hnd)
    return c, info


def _mixed_offsets(draw, rng, kw):
    kw["cu_seqlens_q"] = offsets_fault(draw, kw["cu_seqlens_q"], extra=1)


def _mixed_lengths(draw, rng, kw):
    """seqused_k (or, without it, cu_seqlens_k) negative, past the pages, int64, short, an int."""
    if kw.get("seqused_k") is None:
        kw["cu_seqlens_k"] = offsets_fault(draw, kw["cu_seqlens_k"], extra=10_000)
        return
    lengths = np.array(kw["seqused_k"], np.int64)
    kind = draw(st.sampled_from(["negative", "past", "int64", "short", "python"]))
    if kind == "int64":
        kw["seqused_k"] = lengths
    elif kind == "short":
        kw["seqused_k"] = lengths[:-1].astype(np.int32)
    elif kind == "python":
        kw["seqused_k"] = draw(st.sampled_from([0, 5]))
    elif lengths.size:
        lengths[draw(st.integers(0, lengths.size - 1))] = -1 if kind == "negative" else 10_000
        kw["seqused_k"] = lengths.astype(np.int32)


def _mixed_more_queries(draw, rng, kw):
    """One sequence given fewer keys than it has queries (seqused_k)."""
    cu, used = np.asarray(kw["cu_seqlens_q"]), kw.get("seqused_k")
    if isinstance(used, np.ndarray) and used.size:
        b = draw(st.integers(0, used.size - 1))
        used[b] = max(int(cu[b + 1] - cu[b]) - draw(st.integers(1, 3)), 0)


def _paged_output(draw, rng, kw):
    """output overlapping q, of the wrong dtype or shape, read-only or negatively strided."""
    q = kw["q"]
    kind = draw(st.sampled_from(["q", "float64", "shape", "read_only", "reversed"]))
    if not isinstance(q, np.ndarray) or q.ndim != 3:
        return
    shape = q.shape[:2] + (kw["v_cache"].shape[-1],)
    if kind == "q":
        kw["output"] = q
    elif kind == "float64":
        kw["output"] = np.zeros(shape, np.float64)
    elif kind == "shape":
        kw["output"] = np.zeros(shape[:2] + (shape[2] + 1,), q.dtype)
    else:
        out = np.zeros(shape, q.dtype)
        if kind == "read_only":
            out.flags.writeable = False
        kw["output"] = out if kind == "read_only" else place(draw, out, "reversed")


def _paged_no_table(draw, rng, kw):
    kw["block_table"] = None


MIXED_MUTATIONS = [
    dtype_fault("q", "k_cache", "v_cache"),
    shape_fault("q", "k_cache", "v_cache", "block_table"),
    table_fault,
    _mixed_offsets,
    _mixed_lengths,
    _mixed_more_queries,
    # The caches and their scales are only read: read-only arrays are taken.
    read_only_fault("q", "k_cache", "v_cache", "k_scale", "v_scale"),
]
PAGED_MUTATIONS = [
    scalar_fault(
        ("sinks", np.array([np.nan], np.float32)),
        ("sinks", np.full(1, np.inf, np.float32)),
        ("sinks", np.zeros(3, np.float64)),
        ("kv_layout", "NCHW"),
        ("num_threads", -1),
    ),
    scales_fault,
    _paged_output,
    _paged_no_table,
    shape_fault("output", "sinks"),
]
VARLEN_PAGED_MUTATIONS = [scalar_fault(("num_threads", -1)), _varlen_max_seqlen]
