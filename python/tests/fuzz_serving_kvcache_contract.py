"""The fuzzer's contract of flash_attn_with_kvcache (test_fuzz_serving.py): page tables, caches,
the pages a call reads or writes, the options (window, softcap, scale, ALiBi, threads), and the
8-bit append checked against quantize_kv's contract; shared with the varlen and mixed targets."""

from __future__ import annotations

from typing import Any

import numpy as np
from fuzz_serving_draw import int_table, is_float, negative_strides
from fuzz_serving_kv8 import (
    check_codes,
    check_token_scales,
    quantized,
    scale_contract,
    token_scales,
)
from fuzz_serving_model import FORMATS, Contract, name_of
from semantics import f64, fa_rotary

# ---- flash_attn_with_kvcache ---------------------------------------------------------------------


def table_contract(c: Contract, name: str, x: Any, length: int | None, shape2: bool = False):
    """An int32 table argument (a (batch,) vector, or with shape2 a 2-D page table): the array,
    or None after refusing it."""
    if x is None:
        return None
    a = int_table(x)
    if a is None:
        c.refuse(f"{name} is {name_of(x)}, not int32")
        return None
    if shape2 and (a.ndim != 2 or a.shape[0] != length):
        c.refuse(f"{name} has shape {a.shape}, not ({length}, max_blocks)")
        return None
    if not shape2 and a.shape != (length,):
        c.refuse(f"{name} has shape {a.shape}, not ({length},)")
        return None
    return a


def cache_contract(c: Contract, name: str, x: Any, dtype: str, written: bool):
    """A cache argument: its format ("" for a float cache) or None after refusing it."""
    if not isinstance(x, np.ndarray):
        c.refuse(f"{name} is a {type(x).__name__}")
        return None
    fmt = {v: k for k, v in FORMATS.items()}.get(x.dtype, "")
    if not fmt and name_of(x) != dtype:
        c.refuse(f"{name} is {name_of(x)}, q is {dtype}")
        return None
    if x.ndim != 4:
        c.refuse(f"{name} has rank {x.ndim}")
        return None
    if written and not x.flags.writeable:
        c.refuse(f"{name} is read-only and written")
    if written and negative_strides(x) and not fmt:
        c.refuse(f"{name} has negative strides and is written")
    if fmt and negative_strides(x):
        # Float arrays with negative strides are read through a copy (_tensors.viewable); an
        # 8-bit cache is addressed in place, and whether it may have them is not documented.
        c.leave_open(f"{name}: an 8-bit cache with negative strides")
    return fmt


def pages_read(lengths, leftpad, table, page):
    """(sequence, table column) of the pages each sequence reads: slots [leftpad, length)."""
    for b, n in enumerate(lengths):
        first = int(leftpad[b]) if leftpad is not None else 0
        for col in range(first // page, -(-int(n) // page)):
            yield b, col


def pages_seen(lengths, new, leftpad, sq, window, causal, page):
    """(sequence, table column) of the pages flash_attn_with_kvcache must find in range: those
    holding a slot some query row sees (kvcache.h: rows bottom-right aligned over slots
    [leftpad, length + new), within the window) or the append writes. A page of the other used
    slots is left open: the library may look at it (a prefill reads whole tiles) or not (no query
    row, or before a window)."""
    try:
        left, right = (int(x) for x in window)
    except (TypeError, ValueError):  # refused by window_contract
        left, right = -1, -1
    right = 0 if causal else right
    for b, n in enumerate(lengths):
        n, first = int(n) + new, int(leftpad[b]) if leftpad is not None else 0
        cols = {slot // page for slot in range(n - new, n)}
        for i in range(sq):
            diagonal = n - sq + i
            hi = n if right < 0 else min(n, diagonal + right + 1)
            lo = first if left < 0 else max(first, diagonal - left)
            cols.update(range(lo // page, -(-hi // page)) if lo < hi else ())
        for col in sorted(cols):
            yield b, col


def kvcache_contract(kw: dict) -> tuple[Contract, dict]:
    """flash_attn_with_kvcache's documented contract on `kw` (kvcache.h, _kvcache.py's docstring);
    returns it and what the reference needs (shapes, formats, lengths)."""
    c = Contract()
    info = {}
    q = kw["q"]
    if not is_float(q):
        c.refuse(f"q is {name_of(q)}")
        return c, info
    if q.ndim != 4:
        c.refuse(f"q has rank {q.ndim}")
        return c, info
    batch, sq, heads, d = q.shape
    dtype = name_of(q)
    appending = kw.get("k") is not None
    kf = cache_contract(c, "k_cache", kw["k_cache"], dtype, appending)
    vf = cache_contract(c, "v_cache", kw["v_cache"], dtype, appending)
    if kf is None or vf is None:
        return c, info
    kc, vc = kw["k_cache"], kw["v_cache"]
    info.update(dtype=dtype, kf=kf, vf=vf, batch=batch, heads=heads)
    if bool(kf) != bool(vf):
        c.leave_open("one 8-bit cache and one float cache")
    hk = kc.shape[2]
    if vc.shape[:3] != kc.shape[:3]:
        c.refuse(f"k_cache {kc.shape} and v_cache {vc.shape} differ before head_dim")
    if hk == 0 or heads % hk:
        c.refuse(f"{heads} heads are not a multiple of {hk} KV heads")
    if kc.shape[3] != d:
        c.refuse(f"k_cache head_dim {kc.shape[3]} != q's {d}")
    if min(batch, sq, heads, d, vc.shape[3], kc.shape[0], kc.shape[1]) == 0:
        c.leave_open("an empty dimension")
    paged = kw.get("block_table") is not None
    table = table_contract(c, "block_table", kw.get("block_table"), batch, shape2=True)
    rows = kc.shape[1]
    capacity = table.shape[1] * rows if table is not None else rows
    if paged and kw.get("cache_batch_idx") is not None:
        c.refuse("cache_batch_idx with a paged cache")
    idx = table_contract(c, "cache_batch_idx", kw.get("cache_batch_idx"), batch)
    bad_rows = np.zeros(batch, bool)  # out-of-range cache_batch_idx entries (judged below)
    if idx is not None and not paged:
        bad_rows = (idx < 0) | (idx >= kc.shape[0])
        if not bad_rows.any() and appending and len(set(idx.tolist())) < batch:
            c.refuse("a repeated cache_batch_idx entry while appending")
    elif not paged and kc.shape[0] != batch:
        (c.refuse if kc.shape[0] < batch else c.leave_open)(f"batch_cache {kc.shape[0]} != {batch}")
    new = 0
    if appending != (kw.get("v") is not None):
        c.refuse("k and v must be given together")
    elif appending:
        k, v = kw["k"], kw["v"]
        for name, t, last in (("k", k, d), ("v", v, vc.shape[3])):
            if not is_float(t) or name_of(t) != dtype:
                c.refuse(f"{name} is {name_of(t)}, q is {dtype}")
            elif t.ndim != 4 or t.shape[0] != batch or t.shape[2:] != (hk, last):
                c.refuse(f"{name} has shape {t.shape}")
        if k.shape[:2] != v.shape[:2]:
            c.refuse(f"k {k.shape} and v {v.shape} hold different tokens")
        new = k.shape[1] if k.ndim == 4 else 0
        if new == 0:
            c.leave_open("k and v of no token")
        if kf == "int8" and is_float(k) and np.isnan(f64(k)).any():
            c.refuse("a NaN appended to an int8 cache")
    raw = kw.get("cache_seqlens")
    if raw is None:
        lengths = np.full(batch, capacity)
        if appending:
            c.refuse("k and v without cache_seqlens")
    elif isinstance(raw, (int, np.integer)) and not isinstance(raw, bool):
        lengths = np.full(batch, int(raw))
    else:
        lengths = table_contract(c, "cache_seqlens", raw, batch)
        if lengths is None:
            return c, info
    if np.any(lengths < 0) or np.any(lengths + new > capacity):
        c.refuse(f"cache_seqlens {lengths.tolist()} + {new} outside [0, {capacity}]")
        return c, info
    leftpad = table_contract(c, "cache_leftpad", kw.get("cache_leftpad"), batch)
    if leftpad is not None and np.any((leftpad < 0) | (leftpad > lengths)):
        c.refuse(f"cache_leftpad {leftpad.tolist()} outside [0, cache_seqlens]")
        return c, info
    # A cache row, as a page, must be in range where the sequence reads or writes it.
    uses = (
        (lengths + new > (0 if leftpad is None else leftpad)) if new == 0 else np.ones(batch, bool)
    )
    if np.any(bad_rows & uses):
        c.refuse("cache_batch_idx out of range for a sequence that reads or writes its row")
    elif bad_rows.any():
        c.leave_open("cache_batch_idx out of range for a sequence that uses no slot")
    if table is not None and not c.refused:
        window = kw.get("window_size", (-1, -1))
        seen = set(pages_seen(lengths, new, leftpad, sq, window, kw.get("causal"), rows))
        used = set(pages_read(lengths + new, leftpad, table, rows))
        named = {}
        for b in range(batch):
            for col in range(table.shape[1]):
                p = int(table[b, col])
                if not 0 <= p < kc.shape[0]:
                    if (b, col) in seen:
                        c.refuse(f"block_table[{b}, {col}] = {p} is read and out of range")
                    elif (b, col) in used:
                        c.leave_open(f"block_table[{b}, {col}] = {p} is out of range, used, seen by no query")
                    else:
                        c.leave_open(f"block_table[{b}, {col}] = {p} is out of range, not read")
                named.setdefault(p, []).append((b, col))
        for b in range(batch):
            for slot in range(int(lengths[b]), int(lengths[b]) + new):
                p = int(table[b, slot // rows])
                if len(named.get(p, [])) > 1:
                    c.refuse(f"page {p} is written by sequence {b} and named {named[p]}")
    cos, sin = kw.get("rotary_cos"), kw.get("rotary_sin")
    if (cos is None) != (sin is None):
        c.refuse("rotary_cos and rotary_sin must be given together")
    elif cos is not None:
        if not appending:
            c.refuse("rotary tables without k and v")
        for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
            if not is_float(t) or name_of(t) not in (dtype, "float32"):
                c.refuse(f"{name} is {name_of(t)}")
        if cos.shape != sin.shape or cos.ndim != 2 or not 1 <= 2 * cos.shape[1] <= d:
            c.refuse(f"rotary tables of shapes {cos.shape}, {sin.shape} for head_dim {d}")
        elif new and not c.refused:
            per_token = kw.get("causal") or tuple(kw.get("window_size", (-1, -1))) != (-1, -1)
            last = int(np.max(lengths + max(new, sq if per_token else 1) - 1, initial=-1))
            if cos.shape[0] <= last:
                c.refuse(f"rotary tables of {cos.shape[0]} positions, position {last} needed")
    window_contract(c, kw, "window_size")
    softcap_contract(c, kw.get("softcap"))
    scale_value_contract(c, "softmax_scale", kw.get("softmax_scale"))
    alibi_contract(c, kw.get("alibi_slopes"), batch, heads)
    if kw.get("num_splits", 0) < 0:
        c.refuse("num_splits < 0")
    threads_contract(c, kw.get("num_threads"))
    shapes = {"tensor": (1,), "head": (hk,), "token": kc.shape[:3]}
    if hk == 1:
        shapes.pop("head")
    for name, fmt in (("k_scale", kf), ("v_scale", vf)):
        s = kw.get(name)
        if not fmt:
            if s is not None:
                c.refuse(f"{name} with a float cache")
            continue
        if s is None:
            c.refuse(f"an 8-bit cache without {name}")
            continue
        info[name] = scale_contract(c, name, s, shapes, written=appending)
    info.update(lengths=lengths, new=new, leftpad=leftpad, table=table, idx=idx, rows=rows)
    return c, info


def window_contract(c: Contract, kw: dict, name: str) -> None:
    w = kw.get(name, (-1, -1))
    try:
        left, right = (int(x) for x in w)
    except (TypeError, ValueError):
        c.refuse(f"{name} {w!r} is not a pair of ints")
        return
    if left < -1 or right < -1:
        c.refuse(f"{name} {w!r} has an entry below -1")


def softcap_contract(c: Contract, softcap) -> None:
    if softcap is not None and not (np.isfinite(softcap) and softcap >= 0):
        c.refuse(f"softcap {softcap} is not finite and >= 0")


def scale_value_contract(c: Contract, name: str, scale) -> None:
    if scale is not None and not np.isfinite(scale):
        c.refuse(f"{name} {scale} is not finite")


def alibi_contract(c: Contract, slopes, batch: int, heads: int) -> None:
    if slopes is None:
        return
    a = np.asarray(slopes)
    if a.shape not in ((heads,), (batch, heads)):
        c.refuse(f"alibi_slopes of shape {a.shape}")
    elif not np.all(np.isfinite(f64(a))):
        c.refuse("alibi_slopes holds a non-finite slope")


def threads_contract(c: Contract, threads) -> None:
    if threads is not None and threads < 0:
        c.leave_open(f"num_threads = {threads}")


def dequantized(cache: np.ndarray, scale, granularity: str) -> np.ndarray:
    """An 8-bit cache (..., kv_heads, d) in float64, with its scales."""
    s = np.asarray(scale, np.float64)
    if granularity == "token":
        s = s[..., None]
    elif granularity == "head":
        s = s.reshape(-1)[:, None]
    else:
        s = s.reshape(-1)[0]
    return f64(cache) * s


def slot_of(info: dict, b: int, j: int) -> tuple[int, int]:
    """Where slot j of sequence b lives: (cache row or page, row within it)."""
    if info["table"] is not None:
        return int(info["table"][b, j // info["rows"]]), j % info["rows"]
    return (b if info["idx"] is None else int(info["idx"][b])), j


def rotated_q(args: dict, lengths) -> np.ndarray:
    """q turned as flash_attn_with_kvcache turns it (kvcache_ref's rule): at cache_seqlens + i
    when causal or windowed, else all at cache_seqlens; float32 arithmetic, q's dtype."""
    q = args["q"]
    per_token = args.get("causal") or tuple(args.get("window_size", (-1, -1))) != (-1, -1)
    out = np.array(q)
    for b in range(q.shape[0]):
        positions = int(lengths[b]) + (np.arange(q.shape[1]) if per_token else 0)
        positions = np.broadcast_to(positions, (q.shape[1],))
        for h in range(q.shape[2]):
            turned = fa_rotary(
                q[b, :, h],
                args["rotary_cos"],
                args["rotary_sin"],
                positions,
                args.get("rotary_interleaved", True),
            )
            out[b, :, h] = turned.astype(q.dtype)
    return out


def check_kv8_append(before: dict, after: dict, info: dict, side: str) -> None:
    """The 8-bit append of k or v (side), slot by slot: codes quantize_kv's contract gives in
    float64 (with the scale the call wrote for a per-token cache) for the new row (k turned in
    float32 first when rotary tables are given), other slots untouched."""
    cache, scale = f"{side}_cache", f"{side}_scale"
    fmt, granularity = info["kf" if side == "k" else "vf"], info[scale]
    new_rows = f64(before[side])
    want_codes = before[cache].copy()
    want_scale = before[scale].copy() if isinstance(before[scale], np.ndarray) else None
    for b in range(info["batch"]):
        for t in range(info["new"]):
            r, s = slot_of(info, b, int(info["lengths"][b]) + t)
            row = new_rows[b, t]  # (kv_heads, d)
            if side == "k" and before.get("rotary_cos") is not None:
                position = np.full(row.shape[0], int(info["lengths"][b]) + t)
                interleaved = before.get("rotary_interleaved", True)
                row = f64(
                    fa_rotary(
                        row, before["rotary_cos"], before["rotary_sin"], position, interleaved
                    )
                )
            if granularity == "token":
                want = token_scales(row, fmt)
                check_token_scales(after[scale][r, s], want, f"{scale}[{r}, {s}]")
                used = f64(after[scale][r, s])[:, None]
                want_scale[r, s] = after[scale][r, s]
            elif granularity == "head":
                used = f64(before[scale]).reshape(-1)[:, None]
            else:
                used = f64(np.asarray(before[scale])).reshape(-1)[0]
            want_codes[r, s] = quantized(row, fmt, used)
    check_codes(after[cache], want_codes, cache)
    if want_scale is not None:
        assert after[scale].tobytes() == want_scale.tobytes(), f"{scale}: other entries changed"
