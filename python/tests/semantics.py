"""A float64 numpy transcription of shared/spec/SEMANTICS.md, written for these tests alone.

It shares no code with the library or with src/reference: it materialises the score matrix of
one (batch*head) at a time, builds the mask from the spec's rules verbatim and takes the softmax
in float64. The library's extensions beyond the Neuron kernel (include/flashcte/flashcte.h:
softcap, ALiBi, key_bias, window_left/window_right, bottom_right) are transcribed from the
header's comments. Plus FlashAttention's conventions (bottom-right causal, windows, softcap,
ALiBi) as an independent model, for flash_attn_func / flash_attn_varlen_func.
"""

from __future__ import annotations

import numpy as np

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    ml_dtypes = None
    BF16 = None


def f64(x) -> np.ndarray:
    """Any numpy array (bfloat16 included) as float64."""
    x = np.asarray(x)
    if BF16 is not None and x.dtype == BF16:
        x = x.astype(np.float32)
    return x.astype(np.float64)


def attention_cte_ref(
    q,
    k,
    v,
    scale=1.0,
    causal_mask=True,
    k_prior=None,
    v_prior=None,
    prior_used_len=None,
    sink=None,
    sliding_window=0,
    tp_q=True,
    tp_k=False,
    cp_offset=None,
    global_cp_deg=None,
    cp_strided_q_slicing=False,
    bound_min=None,
    bound_max=None,
    softcap=0.0,
    alibi_slopes=None,
    key_bias=None,
    window_left=-1,
    window_right=-1,
    bottom_right=False,
):
    """Returns (out (bs, Sq, dv), neg_max (bs, Sq), sum_recip (bs, Sq), lse (bs, Sq)), float64.

    Empty rows (no unmasked key, no sink): out 0, neg_max +inf, sum_recip +inf, lse -inf.
    Extensions: S = scale * q.k -> softcap * tanh(S / softcap) -> + -slope * |q_pos - kv_pos|
    -> + key_bias[b, j] -> masks, where the masks add -window_left <= diff <= window_right
    (-1: unbounded) and bottom_right moves every query position by Skv - Sq (Skv: k's length,
    without the prior).
    """
    # 1. Undo the transposes.
    q = f64(q) if tp_q else f64(q).transpose(0, 2, 1)
    k = f64(k) if tp_k else f64(k).transpose(0, 2, 1)
    v = f64(v)
    bs, sq, _ = q.shape
    bs_kv, skv, _ = k.shape
    dv = v.shape[2]
    group = bs // bs_kv
    if k_prior is not None:
        kp = f64(k_prior) if tp_k else f64(k_prior).transpose(0, 2, 1)
        vp = f64(v_prior)
    if prior_used_len is None:
        used = [kp.shape[1] if k_prior is not None else 0] * bs_kv
    elif np.ndim(prior_used_len) == 0:
        used = [int(prior_used_len)] * bs_kv
    else:
        used = [int(u) for u in prior_used_len]
        if len(used) == 1:
            used = used * bs_kv

    # 2. Positions.
    i = np.arange(sq)
    offset = 0 if cp_offset is None else cp_offset
    if cp_strided_q_slicing:
        q_pos = offset + i * global_cp_deg
    else:
        q_pos = offset + i
    if bottom_right:
        q_pos = q_pos + (skv - sq)
    slopes = None if alibi_slopes is None else f64(alibi_slopes).reshape(-1)
    bias = None if key_bias is None else f64(key_bias)
    sink_vals = None if sink is None else f64(sink).reshape(-1)
    if bound_min is not None:
        bmin = f64(bound_min).reshape(-1)
        bmax = f64(bound_max).reshape(-1)

    out = np.zeros((bs, sq, dv))
    neg_max = np.full((bs, sq), np.inf)
    sum_recip = np.full((bs, sq), np.inf)
    lse = np.full((bs, sq), -np.inf)
    for b in range(bs):
        kb = b // group
        p = used[kb]
        if k_prior is not None:
            keys = np.concatenate([kp[kb, :p], k[kb]], axis=0)
            vals = np.concatenate([vp[kb, :p], v[kb]], axis=0)
        else:
            keys, vals = k[kb], v[kb]
        j = np.arange(keys.shape[0])
        kv_pos = j - p
        diff = kv_pos[None, :] - q_pos[:, None]
        # 3. The mask.
        masked = np.zeros(diff.shape, bool)
        if causal_mask:
            masked |= diff > 0
        if sliding_window > 0:
            masked |= diff <= -sliding_window
        if window_left >= 0:
            masked |= diff < -window_left
        if window_right >= 0:
            masked |= diff > window_right
        if bound_min is not None:
            masked |= (j[None, :] < bmin[:, None]) | (j[None, :] >= bmax[:, None])
        # 4. Scores, then the modifiers in the header's order, then the mask.
        s = scale * (q[b] @ keys.T)
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        if slopes is not None:
            s = s - slopes[b] * np.abs(diff)
        if bias is not None:
            s = s + bias[b, : keys.shape[0]][None, :]
        s[masked] = -np.inf
        # 5. Sink column (not scaled, no value vector).
        if sink_vals is not None:
            s = np.concatenate([s, np.full((sq, 1), sink_vals[b])], axis=1)
        # 6., 7. Softmax, output, statistics.
        m = s.max(axis=1) if s.shape[1] else np.full(sq, -np.inf)
        live = np.isfinite(m)
        e = np.exp(s[live] - m[live, None])
        total = e.sum(axis=1)
        pv = e[:, : vals.shape[0]] @ vals
        out[b, live] = pv / total[:, None]
        neg_max[b, live] = -m[live]
        sum_recip[b, live] = 1.0 / total
        lse[b, live] = m[live] + np.log(total)
    return out, neg_max, sum_recip, lse


def neuron_layout(stat: np.ndarray) -> np.ndarray:
    """(bs, Sq) -> the kernel's (bs, 128, Sq/128): element [b, p, g] is row g*128 + p."""
    bs, sq = stat.shape
    return stat.reshape(bs, sq // 128, 128).transpose(0, 2, 1)


def fa_mask(seqlen_q: int, seqlen_k: int, causal: bool, window=(-1, -1)) -> np.ndarray:
    """FlashAttention's allowed (query, key) pairs: bottom-right aligned diagonal; query i sees
    keys [i + Sk - Sq - left, i + Sk - Sq + right] (-1: unbounded); causal means right = 0."""
    left, right = window
    if causal:
        right = 0
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    diag = i + seqlen_k - seqlen_q
    ok = np.ones((seqlen_q, seqlen_k), bool)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    return ok


def masked_softmax_attention(q, k, v, allowed, scale, softcap=0.0, bias=None):
    """One head: q (Sq, d), k (Sk, d), v (Sk, dv), allowed (Sq, Sk), optional additive bias
    (Sq, Sk) after soft-capping -> (out, lse), float64."""
    s = scale * (f64(q) @ f64(k).T)
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    s[~allowed] = -np.inf
    out = np.zeros((s.shape[0], np.shape(v)[1]))
    lse = np.full(s.shape[0], -np.inf)
    m = s.max(axis=1) if s.shape[1] else np.full(s.shape[0], -np.inf)
    # Empty rows (every key masked) output 0; a NaN score (a NaN in q or a key it sees) makes
    # its row NaN, as IEEE arithmetic does.
    live = ~np.isneginf(m)
    e = np.exp(s[live] - m[live, None])
    total = e.sum(axis=1)
    out[live] = (e @ f64(v)) / total[:, None]
    lse[live] = m[live] + np.log(total)
    return out, lse


def fold_sinks(out, lse, sinks):
    """A sink per head joins each row's softmax without a value: out * l / (l + e^sink),
    lse -> logaddexp(lse, sink). out (rows, heads, dv), lse (heads, rows), float64."""
    s = f64(sinks)[:, None]
    total = np.logaddexp(lse, s)
    with np.errstate(invalid="ignore"):  # -inf - -inf: a row of no key, no sink
        share = np.where(np.isneginf(total), 1.0, np.exp(lse - total))
    return out * share.T[:, :, None], total


def fa_alibi_distance(seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """FlashAttention's ALiBi distance |i + Sk - Sq - j| (its documented bias is -slope times
    this; bottom-right aligned like its causal mask)."""
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    return np.abs(i + seqlen_k - seqlen_q - j).astype(np.float64)


def flash_attn_ref(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
):
    """q (B, Sq, H, d), k/v (B, Sk, Hk, d): (out (B, Sq, H, dv), lse (B, H, Sq)), float64.
    alibi_slopes: (H,) or (B, H); sinks (H,): folded in as fold_sinks."""
    batch, sq, heads, d = q.shape
    sk, heads_k = k.shape[1], k.shape[2]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    allowed = fa_mask(sq, sk, causal, window_size)
    slopes = None
    if alibi_slopes is not None:
        slopes = np.broadcast_to(f64(alibi_slopes), (batch, heads))
        dist = fa_alibi_distance(sq, sk)
    out = np.zeros((batch, sq, heads, v.shape[3]))
    lse = np.zeros((batch, heads, sq))
    for b in range(batch):
        for h in range(heads):
            hk = h // (heads // heads_k)
            bias = None if slopes is None else -slopes[b, h] * dist
            out[b, :, h], lse[b, h] = masked_softmax_attention(
                q[b, :, h], k[b, :, hk], v[b, :, hk], allowed, scale, softcap, bias
            )
        if sinks is not None:
            out[b], lse[b] = fold_sinks(out[b], lse[b], sinks)
    return out, lse


def flash_attn_varlen_ref(
    q,
    k,
    v,
    cu_q,
    cu_k,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
):
    """Per sequence flash_attn_ref (positions within the sequence); rows outside every sequence
    are 0 with lse -inf. alibi_slopes: (H,) or (num_sequences, H); sinks (H,)."""
    total_q, heads, _d = q.shape
    out = np.zeros((total_q, heads, v.shape[2]))
    lse = np.full((heads, total_q), -np.inf)
    for s in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        slopes = None
        if alibi_slopes is not None:
            slopes = f64(alibi_slopes)
            slopes = slopes if slopes.ndim == 1 else slopes[s]
        o, l = flash_attn_ref(
            q[None, qs:qe],
            k[None, ks:ke],
            v[None, ks:ke],
            softmax_scale,
            causal,
            window_size,
            softcap,
            slopes,
            sinks,
        )
        out[qs:qe] = o[0]
        lse[:, qs:qe] = l[0]
    return out, lse


def fa_rotary(x, cos, sin, positions, interleaved):
    """FlashAttention's apply_rotary_emb: x (n, d) turned at positions (n,) by the tables
    (S, rotary_dim / 2), float32 arithmetic as its kernels, the first rotary_dim channels only."""
    x = np.asarray(x, np.float32).copy()
    c = np.asarray(cos, np.float32)[positions]
    s = np.asarray(sin, np.float32)[positions]
    rd = 2 * c.shape[1]
    if interleaved:
        x0, x1 = x[:, 0:rd:2].copy(), x[:, 1:rd:2].copy()
        x[:, 0:rd:2], x[:, 1:rd:2] = x0 * c - x1 * s, x0 * s + x1 * c
    else:
        x0, x1 = x[:, : rd // 2].copy(), x[:, rd // 2 : rd].copy()
        x[:, : rd // 2], x[:, rd // 2 : rd] = x0 * c - x1 * s, x0 * s + x1 * c
    return x


def kvcache_ref(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
):
    """FlashAttention's flash_attn_with_kvcache as its test_flash_attn_kvcache models it:
    (out, lse, k_cache after, v_cache after); out / lse float64, the caches in their dtype."""
    batch, sq, heads, d = q.shape
    dtype = np.asarray(q).dtype
    k_after, v_after = np.array(k_cache), np.array(v_cache)
    paged = block_table is not None
    rows_per = k_cache.shape[1]
    capacity = block_table.shape[1] * rows_per if paged else rows_per
    seqlens = np.full(batch, capacity) if cache_seqlens is None else np.asarray(cache_seqlens)
    leftpad = np.zeros(batch, int) if cache_leftpad is None else np.asarray(cache_leftpad)
    new = 0 if k is None else k.shape[1]

    def where(b, j):
        if paged:
            return block_table[b, j // rows_per], j % rows_per
        return (b if cache_batch_idx is None else cache_batch_idx[b]), j

    rotary = rotary_cos is not None
    for b in range(batch):
        pos = seqlens[b] + np.arange(new)
        for h in range(k_cache.shape[2]):
            kn = f64(k[b, :, h]) if new else None
            if new and rotary:
                kn = fa_rotary(kn, rotary_cos, rotary_sin, pos, rotary_interleaved)
            for t in range(new):
                r, s = where(b, pos[t])
                k_after[r, s, h] = np.asarray(kn[t]).astype(dtype)
                v_after[r, s, h] = v[b, t, h]
    per_token = causal or tuple(window_size) != (-1, -1)
    out = np.zeros((batch, sq, heads, v_cache.shape[3]))
    lse = np.full((batch, heads, sq), -np.inf)
    for b in range(batch):
        sk = int(seqlens[b]) + new
        allowed = fa_mask(sq, sk, causal, window_size) & (np.arange(sk)[None, :] >= leftpad[b])
        # Slots no query row sees (before cache_leftpad, outside every row's window) are never
        # read: their pages may not exist (kvcache.h).
        seen = allowed.any(axis=0)
        kb, vb = (
            np.stack(
                [
                    f64(cache[where(b, j)]) if seen[j] else np.zeros(cache.shape[2:])
                    for j in range(sk)
                ]
            )
            if sk
            else np.zeros((0, 1, last))
            for cache, last in ((k_after, d), (v_after, 1))
        )
        for h in range(heads):
            qh = f64(q[b, :, h])
            if rotary:
                qpos = seqlens[b] + (np.arange(sq) if per_token else np.zeros(sq, int))
                qh = f64(fa_rotary(qh, rotary_cos, rotary_sin, qpos, rotary_interleaved).astype(dtype))
            if sk == 0:
                continue
            hk = h // (heads // k_cache.shape[2])
            bias = None
            if alibi_slopes is not None:
                slope = np.broadcast_to(f64(alibi_slopes), (batch, heads))[b, h]
                bias = -slope * fa_alibi_distance(sq, sk)
            scale = d**-0.5 if softmax_scale is None else softmax_scale
            out[b, :, h], lse[b, h] = masked_softmax_attention(
                qh, kb[:, hk], vb[:, hk], allowed, scale, softcap, bias
            )
    return out, lse, k_after, v_after


def varlen_kvcache_ref(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    seqused_k,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
):
    """The mixed batch (flash_attn_varlen_func with block_table, paged_attention): each sequence
    as kvcache_ref sees it alone, its queries the last of its seqused_k keys (bottom-right
    aligned); caches (num_blocks, page_block_size, kv_heads, d) with block_table, else dense
    (batch, seqlen_cache, kv_heads, d). A sink joins each row's softmax without a value:
    out * l / (l + e^sink), lse -> logaddexp(lse, sink). alibi_slopes: (heads,) or
    (batch, heads). Returns (out (total_q, heads, dv), lse (heads, total_q)), float64; rows of no
    sequence are 0 with lse -inf."""
    cu, used = np.asarray(cu_seqlens_q), np.asarray(seqused_k)
    total_q, heads = q.shape[0], q.shape[1]
    out = np.zeros((total_q, heads, v_cache.shape[3]))
    lse = np.full((heads, total_q), -np.inf)
    for b in range(len(used)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if cu[b + 1] == cu[b]:
            continue
        if block_table is not None:
            k_b, v_b, extra = k_cache, v_cache, {"block_table": np.asarray(block_table)[b : b + 1]}
        else:
            k_b, v_b, extra = k_cache[b : b + 1], v_cache[b : b + 1], {}
        slopes = None
        if alibi_slopes is not None:
            slopes = f64(alibi_slopes)
            slopes = slopes if slopes.ndim == 1 else slopes[b]
        o, lse_b, _, _ = kvcache_ref(
            q[None, rows],
            k_b,
            v_b,
            cache_seqlens=np.array([used[b]]),
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            alibi_slopes=slopes,
            **extra,
        )
        o, lse_b = o[0], lse_b[0]
        if sinks is not None:
            o, lse_b = fold_sinks(o, lse_b, sinks)
        out[rows] = o
        lse[:, rows] = lse_b
    return out, lse
