"""The fuzzer's packed flash_attn_varlen_func target (test_fuzz_serving.py): query and key lengths
of 0 to 33, cu_seqlens of int32 / int64 / lists, max_seqlen_*, and their contract and
mutations."""

from __future__ import annotations

from typing import Any

import flashcte
import numpy as np
from conftest import assert_close, assert_stat_close
from fuzz_serving_draw import (
    draw_heads,
    dtype_fault,
    int_table,
    is_float,
    place,
    rng_of,
    scalar_fault,
    shape_fault,
    values,
)
from fuzz_serving_kvcache import options, summarize
from fuzz_serving_kvcache_contract import alibi_contract, threads_contract, window_contract
from fuzz_serving_model import FLOATS, Call, Contract, name_of
from hypothesis import strategies as st
from semantics import flash_attn_varlen_ref

# ---- flash_attn_varlen_func, packed --------------------------------------------------------------

# Query chunks of a mixed batch: decode steps (up to 16 queries run on the decode kernel), and
# prefill chunks past it (attention_cte); keys around them.
QUERY_LENGTHS = (0, 1, 1, 2, 3, 5, 17, 20)
KEY_LENGTHS = (0, 1, 2, 5, 9, 20, 33)


def offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, np.int64))]).astype(np.int64)


def draw_offsets(draw, lengths, name: str) -> Any:
    """cu_seqlens over `lengths`: int32 as FlashAttention's, int64, or a list."""
    cu = offsets(lengths)
    form = draw(st.sampled_from(["int32", "int32", "int64", "list"]), label=f"{name} form")
    return cu.tolist() if form == "list" else cu.astype(form)


def offsets_contract(c: Contract, name: str, x: Any, total: int | None = None, int32=False):
    """cu_seqlens: 1-D, >= 1 entries, from 0, non-decreasing (and with `total`, ending at it);
    any integer dtype or a list (with int32, an int32 array or a list). The array or None."""
    if int32:
        a = int_table(x)
        if a is None:
            c.refuse(f"{name} is {name_of(x)}, not int32")
            return None
    else:
        a = np.asarray(x) if isinstance(x, (list, tuple, np.ndarray)) else None
        if a is None or not (np.issubdtype(a.dtype, np.integer) or a.size == 0 and a.ndim == 1):
            c.refuse(f"{name} is {name_of(x)}, not integers")
            return None
    if a.ndim != 1 or a.size < 1:
        c.refuse(f"{name} has shape {a.shape}, not (batch + 1,)")
        return None
    a = a.astype(np.int64)
    if a[0] != 0 or np.any(np.diff(a) < 0):
        c.refuse(f"{name} {a.tolist()} does not start at 0 or decreases")
        return None
    if total is not None and a[-1] != total:
        c.refuse(f"{name} ends at {a[-1]}, not at total_q = {total}")
        return None
    return a


# flash_attn_varlen_func's names for the caches of the mixed batch (fuzz_serving_mixed.py), which
# an error of the packed call may name: ALiBi per sequence goes through that call.
VARLEN_PAGED_NAMES = {"k_cache": "k", "v_cache": "v"}


def draw_varlen(draw) -> Call:
    rng = rng_of(draw)
    dtype = draw(st.sampled_from(FLOATS), label="dtype")
    nseq = draw(st.sampled_from([1, 1, 2, 3, 4, 0]), label="sequences")
    hk, heads, d, dv = draw_heads(draw)
    len_q = [draw(st.sampled_from(QUERY_LENGTHS), label="seqlen_q") for _ in range(nseq)]
    if draw(st.booleans(), label="cu_seqlens_k == cu_seqlens_q"):
        len_k = list(len_q)
    else:
        len_k = [draw(st.sampled_from(KEY_LENGTHS), label="seqlen_k") for _ in range(nseq)]
    # Rows past the last offset: q's output 0 (lse -inf), k's and v's never read.
    total_q = sum(len_q) + draw(st.sampled_from([0, 0, 0, 1, 3]), label="rows past cu_seqlens_q")
    total_k = sum(len_k) + draw(st.sampled_from([0, 0, 0, 2]), label="rows past cu_seqlens_k")
    kwargs: dict = {
        "q": values(rng, (total_q, heads, d), dtype),
        "k": values(rng, (total_k, hk, d), dtype),
        "v": values(rng, (total_k, hk, dv), dtype),
        "cu_seqlens_q": draw_offsets(draw, len_q, "cu_seqlens_q"),
        "cu_seqlens_k": draw_offsets(draw, len_k, "cu_seqlens_k"),
        "max_seqlen_q": max(len_q, default=0) + draw(st.sampled_from([0, 0, 1, 9])),
        "max_seqlen_k": max(len_k, default=0) + draw(st.sampled_from([0, 0, 1, 9])),
    }
    # ALiBi per head reaches one packed attention_cte call when every sequence has the same
    # key-query shift (self-attention), per sequence the mixed-batch call: both are drawn.
    options(draw, rng, kwargs, heads, nseq)
    kwargs["return_softmax_lse"] = draw(st.booleans(), label="lse")
    for name in ("q", "k", "v"):
        kwargs[name] = place(draw, kwargs[name])

    mutation = draw(st.sampled_from([None] * 6 + VARLEN_MUTATIONS), label="mutation")
    if mutation:
        mutation(draw, rng, kwargs)
    c, info = varlen_contract(kwargs)

    def check(result, before, after):
        out, lse = result if after.get("return_softmax_lse") else (result, None)
        ref_out, ref_lse = flash_attn_varlen_ref(
            before["q"],
            before["k"],
            before["v"],
            info["cu_q"],
            info["cu_k"],
            before.get("softmax_scale"),
            before.get("causal", False),
            before.get("window_size", (-1, -1)),
            before.get("softcap", 0.0),
            before.get("alibi_slopes"),
        )
        assert_close(out, ref_out, info["dtype"])
        if lse is not None:
            assert_stat_close(lse, ref_lse, info["dtype"], "lse")

    summary = summarize(kwargs, mutation)
    call = Call(flashcte.flash_attn_varlen_func, kwargs, c, check, summary=summary)
    # ALiBi per sequence goes through the mixed-batch call, whose names for k and v these are.
    call.foreign = frozenset(VARLEN_PAGED_NAMES)
    return call


def varlen_contract(kw: dict) -> tuple[Contract, dict]:
    """flash_attn_varlen_func's documented contract without block_table (_flash_attn.py)."""
    c = Contract()
    info: dict = {}
    for name in ("q", "k", "v"):
        if not is_float(kw[name]):
            c.refuse(f"{name} is {name_of(kw[name])}")
    if c.refused:
        return c, info
    q, k, v = kw["q"], kw["k"], kw["v"]
    dtype = name_of(q)
    if name_of(k) != dtype or name_of(v) != dtype:
        c.refuse(f"q, k, v are {dtype}, {name_of(k)}, {name_of(v)}")
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        c.refuse(f"ranks {q.ndim}, {k.ndim}, {v.ndim}, not 3")
        return c, info
    total_q, heads, d = q.shape
    total_k, hk, _ = k.shape
    if v.shape[:2] != k.shape[:2]:
        c.refuse(f"k {k.shape} and v {v.shape} differ before head_dim")
    if hk == 0 or heads % hk:
        c.refuse(f"{heads} heads are not a multiple of {hk} KV heads")
    if k.shape[2] != d:
        c.refuse(f"k head_dim {k.shape[2]} != q's {d}")
    if min(total_q, heads, d, total_k, v.shape[2]) == 0:
        c.leave_open("an empty dimension")
    cu_q = offsets_contract(c, "cu_seqlens_q", kw["cu_seqlens_q"])
    cu_k = offsets_contract(c, "cu_seqlens_k", kw["cu_seqlens_k"])
    if cu_q is None or cu_k is None:
        return c, info
    if cu_q.size != cu_k.size:
        c.refuse(f"{cu_q.size} query offsets, {cu_k.size} key offsets")
        return c, info
    if cu_q[-1] > total_q or cu_k[-1] > total_k:
        c.refuse(f"offsets end at {cu_q[-1]}, {cu_k[-1]} past {total_q}, {total_k}")
        return c, info
    for name, cu in (("max_seqlen_q", cu_q), ("max_seqlen_k", cu_k)):
        longest, m = int(np.diff(cu).max(initial=0)), kw[name]
        if cu.size > 1 and not (isinstance(m, (int, np.integer)) and m >= longest):
            c.refuse(f"{name} = {m!r} is not an int >= the longest sequence, {longest}")
    window_contract(c, kw, "window_size")
    softcap = kw.get("softcap")
    if softcap is not None and not (np.isfinite(softcap) and softcap >= 0):
        c.refuse(f"softcap {softcap} is not finite and >= 0")
    scale = kw.get("softmax_scale")
    if scale is not None and not np.isfinite(scale):
        c.refuse(f"softmax_scale {scale} is not finite")
    alibi_contract(c, kw.get("alibi_slopes"), cu_q.size - 1, heads)
    threads_contract(c, kw.get("num_threads"))
    info.update(dtype=dtype, cu_q=cu_q, cu_k=cu_k)
    return c, info


def _varlen_offsets(draw, rng, kw):
    """cu_seqlens_q or cu_seqlens_k not from 0, decreasing, past the rows, float, 2-D, or one
    sequence short of the other."""
    name = draw(st.sampled_from(["cu_seqlens_q", "cu_seqlens_k"]))
    kw[name] = offsets_fault(draw, kw[name], extra=1_000)


def offsets_fault(draw, x, extra: int):
    cu = np.array(x, np.int64)
    kind = draw(st.sampled_from(["start", "decrease", "past", "float", "rank2", "short", "empty"]))
    if kind == "start":
        cu = cu + 1
    elif kind == "decrease" and cu.size > 1:
        cu[-1], cu[0] = -1, 0
    elif kind == "past":
        cu[-1] += extra
    elif kind == "float":
        return cu.astype(np.float32)
    elif kind == "rank2":
        return cu[None].astype(np.int32)
    elif kind == "short":
        cu = cu[:-1]
    elif kind == "empty":
        cu = cu[:0]
    return cu.astype(np.int32)


def _varlen_max_seqlen(draw, rng, kw):
    name = draw(st.sampled_from(["max_seqlen_q", "max_seqlen_k"]))
    kw[name] = draw(st.sampled_from([0, -1, None]))


VARLEN_MUTATIONS = [
    dtype_fault("q", "k", "v"),
    shape_fault("q", "k", "v"),
    _varlen_offsets,
    _varlen_max_seqlen,
    scalar_fault(("num_threads", -1)),
]
