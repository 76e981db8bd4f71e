"""Context parallelism in FlashAttention's layout: ring attention (K/V blocks rotate around the
group while each rank computes on the block it holds, merged with merge_attn_states) and the
all-gather form of the same split.

Layout (FlashAttention's, as ring-flash-attention takes it): every rank passes its own tokens,
``q (batch, local_seqlen, heads, d)``, ``k``/``v (batch, local_seqlen, heads_k, d)`` (GQA:
``heads_k`` divides ``heads``; only the K/V heads travel). The whole sequence is self-attention
(its query and key lengths are equal), so FlashAttention's masks are in global positions: query
at position p sees keys at ``p - window_size[0] .. p + window_size[1]`` (-1 unbounded; causal:
right bound 0).

Each block's mask is exact. A block is one attention_cte call per batch element (heads as its
batch axis) whose rows and columns are the local queries and the block's keys; their global
positions give each query row its range of the block's keys (a contiguous index range, because
positions increase along both axes). A block that no row sees is skipped; one that every row
sees whole runs unmasked; contiguous queries against contiguous keys at or before them run with
``cp_offset`` (their distance) and FlashAttention's window; anything else (zigzag and strided
halves, keys after the queries under a window) with per-row packing bounds, whose tiles the
kernel skips by the same rule. A row with no key in a block has lse -inf there, which the merge
ignores.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import _flashcte
from .._attention import _call
from .._errors import ArgumentError, ArgumentTypeError
from .. import _fa_args
from .._tensors import Tensor, dtype_name, transpose
from . import _comm
from ._allgather import _torch_tensor
from ._shard import positions, split_lengths

ArrayLike = Any


def block_mask(pq: np.ndarray, pk: np.ndarray, left: int, right: int) -> dict | None:
    """The attention_cte mask arguments for queries at global positions ``pq`` against keys at
    ``pk`` (both increasing), FlashAttention window (left, right), -1 unbounded: None when no
    query sees any key, {} when every query sees every key."""
    n = pk.size
    lo = np.zeros(pq.size, np.int64) if left < 0 else np.searchsorted(pk, pq - left, "left")
    hi = np.full(pq.size, n, np.int64) if right < 0 else np.searchsorted(pk, pq + right, "right")
    hi = np.maximum(hi, lo)
    if not np.any(hi > lo):
        return None
    if np.all(lo == 0) and np.all(hi == n):
        return {}
    run = lambda p: p.size < 2 or bool(np.all(np.diff(p) == 1))
    delta = int(pq[0] - pk[0])
    if run(pq) and run(pk) and delta >= 0:
        return {"cp_offset": delta, "window_left": left, "window_right": right}
    return {"bound_min": lo.astype(np.int64), "bound_max": hi.astype(np.int64)}


class _Problem:
    """One rank's checked FlashAttention-layout arguments."""

    def __init__(self, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes):
        if dropout_p:
            raise ArgumentError(
                f"dropout_p: must be 0 (flashcte computes no dropout), got {dropout_p}"
            )
        if alibi_slopes is not None:
            raise ArgumentError(
                "alibi_slopes: not supported by flashcte.distributed's ring functions"
            )
        self.q, self.k, self.v = (_torch_tensor(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
        for name, t in (("q", self.q), ("k", self.k), ("v", self.v)):
            if t.ndim != 4:
                raise ArgumentError(
                    f"{name}: must have rank 4 (batch, local_seqlen, heads, head_dim), got shape "
                    f"{tuple(t.shape)}"
                )
        if not (self.q.dtype == self.k.dtype == self.v.dtype):
            raise ArgumentTypeError(
                f"k, v: dtypes {dtype_name(self.k.dtype)}, {dtype_name(self.v.dtype)} must be "
                f"q's {dtype_name(self.q.dtype)}"
            )
        b, s, h, d = self.q.shape
        bk, sk, hk, dk = self.k.shape
        if self.v.shape[:3] != self.k.shape[:3]:
            raise ArgumentError(
                f"v: shape {tuple(self.v.shape)} disagrees with k's {tuple(self.k.shape)}"
            )
        if bk != b or sk != s:
            raise ArgumentError(
                f"k: shape {tuple(self.k.shape)} must hold q's batch {b} and local_seqlen {s} "
                "(each rank passes the K/V of its own query tokens)"
            )
        if hk == 0 or h % hk:
            raise ArgumentError(
                f"k: {hk} heads must divide q's {h} heads (grouped-query attention)"
            )
        if dk != d:
            raise ArgumentError(f"k: head_dim {dk} differs from q's {d}")
        if s < 1:
            raise ArgumentError("q: every rank must hold at least one token")
        self.scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
        self.left, self.right = _fa_args.window(window_size, causal)
        self.shape = (b, s, h, d, hk, self.v.shape[3])

    def common(self, layout: str) -> dict:
        b, _, h, d, hk, dv = self.shape
        return {
            "batch": b,
            "heads": h,
            "head_dim": d,
            "heads_k": hk,
            "dv": dv,
            "dtype": dtype_name(self.q.dtype),
            "softmax_scale": self.scale,
            "window": [self.left, self.right],
            "layout": layout,
        }


def _agree(g, what, layout, make) -> tuple[_Problem, list[int]]:
    holder: list = []

    def describe():
        p = make()
        holder.append(p)
        return {"common": p.common(layout), "length": p.shape[1]}

    metas = _comm.agree(g, describe, what)
    _comm.fail_unless_same(metas, "common", what)
    lengths = [m["length"] for m in metas]
    total = sum(lengths)
    if layout == "zigzag" and (len(set(lengths)) != 1 or lengths[0] % 2):
        raise ArgumentError(
            f"flashcte.distributed.{what}: the zigzag split needs the same even local_seqlen on "
            f"every rank (2 chunks of seqlen / (2 P) each), got {lengths}"
        )
    if layout == "strided" and lengths != split_lengths(total, g.size, "strided"):
        raise ArgumentError(
            f"flashcte.distributed.{what}: the ranks hold {lengths} tokens; a strided split of "
            f"{total} over {g.size} ranks holds {split_lengths(total, g.size, 'strided')}"
        )
    return holder[0], lengths


def _batched(mask: dict, batch: int) -> dict:
    """``mask`` for attention_cte's rank-4 (batch) form: per-row bounds get a leading batch axis
    of stride 0 (every sequence of the batch shares them)."""
    return {
        key: np.broadcast_to(val, (batch,) + val.shape) if key.startswith("bound") else val
        for key, val in mask.items()
    }


def _attend(p: _Problem, k_blk, v_blk, mask: dict, out_acc, lse_acc, blk_out, blk_lse, threads):
    """One block: attention of the local queries against (k_blk, v_blk) with `mask`, merged into
    the accumulators (float32, in place); one call each for the whole batch."""
    _call(
        Tensor("q", transpose(p.q, 1, 2)),
        Tensor("k", transpose(k_blk, 1, 2)),
        Tensor("v", transpose(v_blk, 1, 2)),
        transpose(blk_out, 1, 2),
        lse=blk_lse,
        scale=p.scale,
        causal_mask=False,
        tp_k=True,
        num_threads=threads,
        **_batched(mask, p.shape[0]),
    )
    acc = transpose(out_acc, 1, 2)
    _flashcte.merge_attn_states(
        out_a=acc,
        lse_a=lse_acc,
        out_b=transpose(blk_out, 1, 2),
        lse_b=blk_lse,
        out=acc,
        lse=lse_acc,
        bf16_bits=False,
    )


def _ring(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    alibi_slopes,
    return_attn_probs,
    group,
    layout,
    timeout,
    num_threads,
    what,
):
    g = _comm.resolve_group(group, timeout)
    p, lengths = _agree(
        g,
        what,
        layout,
        lambda: _Problem(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes),
    )
    b, s, h, d, hk, dv = p.shape
    dtype = p.q.dtype
    pos = [positions(lengths, r, layout) for r in range(g.size)]
    block_bytes = [_comm.nbytes((b, n, hk, d + dv), dtype) for n in lengths]
    k_bytes = lambda n: _comm.nbytes((b, n, hk, d), dtype)
    cur = torch.empty(max(block_bytes), dtype=torch.uint8)
    nxt = torch.empty_like(cur) if g.size > 1 else cur
    error: BaseException | None = None
    try:
        _comm.byte_view(cur, 0, dtype, (b, s, hk, d)).copy_(p.k)
        _comm.byte_view(cur, k_bytes(s), dtype, (b, s, hk, dv)).copy_(p.v)
        out_acc = torch.zeros((b, s, h, dv), dtype=torch.float32)
        lse_acc = torch.full((b, h, s), -math.inf, dtype=torch.float32)
        blk_out = torch.empty((b, s, h, dv), dtype=dtype)
        blk_lse = torch.empty((b, h, s), dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - reported to every rank by settle()
        error = e
    nxt_rank, prev_rank = g.global_rank((g.rank + 1) % g.size), g.global_rank((g.rank - 1) % g.size)
    for step in range(g.size):
        src = (g.rank - step) % g.size
        works = []
        if step + 1 < g.size:  # the next block travels while this one is computed
            nsrc = (g.rank - step - 1) % g.size
            works.append(
                ("send", dist.isend(cur[: block_bytes[src]], nxt_rank, group=g.group, tag=step))
            )
            works.append(
                (
                    "receive",
                    dist.irecv(nxt[: block_bytes[nsrc]], prev_rank, group=g.group, tag=step),
                )
            )
        if error is None:
            try:
                mask = block_mask(pos[g.rank], pos[src], p.left, p.right)
                if mask is not None:
                    n = lengths[src]
                    k_blk = _comm.byte_view(cur, 0, dtype, (b, n, hk, d))
                    v_blk = _comm.byte_view(cur, k_bytes(n), dtype, (b, n, hk, dv))
                    _attend(p, k_blk, v_blk, mask, out_acc, lse_acc, blk_out, blk_lse, num_threads)
            except Exception as e:  # noqa: BLE001 - reported to every rank by settle()
                error = e
        for name, work in works:
            g.wait(work, f"{what}: step {step} K/V {name}")
        cur, nxt = nxt, cur
    _comm.settle(g, error, what)
    out = out_acc if dtype == torch.float32 else out_acc.to(dtype)
    return (out, lse_acc, None) if return_attn_probs else out


def ring_flash_attn_func(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: Any = None,
    *,
    timeout: Any = None,
    num_threads: int | None = None,
):
    """Ring attention over contiguous shards: ring-flash-attention's ``ring_flash_attn_func``
    (same arguments, same order) on flashcte.

    Rank r of ``group`` (default: the world) holds one run of the sequence, the runs in rank
    order, any lengths (exchanged first). In P steps every rank computes its queries against the
    K/V block it holds (its own first) while sending that block to rank r + 1 and receiving the
    next from rank r - 1 (``isend``/``irecv``, overlapping the computation), and merges each
    block's (out, lse) into float32 accumulators with :func:`merge_attn_states`. Blocks a causal
    or windowed mask hides entirely are not computed (causal: rank r computes r + 1 blocks, so
    the last rank works P times the first; :func:`zigzag_ring_flash_attn_func` balances them).

    Args:
        q: ``(batch, local_seqlen, heads, d)``; k, v: ``(batch, local_seqlen, heads_k, d)``
            torch CPU tensors (float32, float16, bfloat16), this rank's tokens.
        dropout_p: must be 0. alibi_slopes: must be None. deterministic: ignored (flashcte is
            deterministic).
        softmax_scale, causal, window_size: as :func:`flashcte.flash_attn_func` on the whole
            sequence (self-attention: positions are global).
        return_attn_probs: also return lse, as ring-flash-attention: ``(out, lse, None)``.
        group: the process group. timeout: seconds or a timedelta bounding every wait
            (None: the group's timeout). num_threads: OpenMP threads of each block's call.

    Returns:
        ``out (batch, local_seqlen, heads, d)`` in q's dtype (the float32 accumulation rounded
        once), or ``(out, lse, None)`` with ``lse (batch, heads, local_seqlen)`` float32: this
        rank's rows of ``flash_attn_func`` on the whole sequence. For 16-bit inputs each block's
        output is rounded to q's dtype before its merge (attention_cte writes q's dtype), so the
        result may differ from the single call by about one rounding of the dtype more.

    Errors (bad arguments on any rank, arguments that differ between ranks, a failure while
    computing) raise on every rank; a peer that never arrives raises RuntimeError after
    ``timeout`` instead of hanging.
    """
    return _ring(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        alibi_slopes,
        return_attn_probs,
        group,
        "contiguous",
        timeout,
        num_threads,
        "ring_flash_attn_func",
    )


def zigzag_ring_flash_attn_func(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: Any = None,
    *,
    timeout: Any = None,
    num_threads: int | None = None,
):
    """Ring attention over zigzag shards: ring-flash-attention's ``zigzag_ring_flash_attn_func``.

    The sequence is cut into ``2P`` equal chunks and rank r holds chunks ``r`` and
    ``2P - 1 - r`` back to back (``flashcte.distributed.shard(x, r, P, "zigzag")``), so under a
    causal mask every rank computes the same number of (query, key) pairs: its own block's two
    triangles and one full chunk pair, then half of every other block. Every rank passes the
    same even ``local_seqlen``. Arguments, results and errors as :func:`ring_flash_attn_func`.
    """
    return _ring(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        alibi_slopes,
        return_attn_probs,
        group,
        "zigzag",
        timeout,
        num_threads,
        "zigzag_ring_flash_attn_func",
    )


def stripe_flash_attn_func(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: Any = None,
    *,
    timeout: Any = None,
    num_threads: int | None = None,
):
    """Ring attention over strided shards (ring-flash-attention's ``stripe_flash_attn_func``;
    Neuron's ``cp_strided_q_slicing``): rank r holds tokens ``r, r + P, r + 2P, ...``
    (``ceil((seqlen - r) / P)`` of them, any seqlen), causal work balanced to within a row per
    block. Arguments, results and errors as :func:`ring_flash_attn_func`."""
    return _ring(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        alibi_slopes,
        return_attn_probs,
        group,
        "strided",
        timeout,
        num_threads,
        "stripe_flash_attn_func",
    )


def allgather_flash_attn_func(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: Any = None,
    *,
    layout: str = "contiguous",
    timeout: Any = None,
    num_threads: int | None = None,
):
    """All-gather context parallelism in FlashAttention's layout: K/V all-gathered, then one
    call per batch element of this rank's queries against the whole sequence.

    ``layout``: ``"contiguous"`` (any lengths; the call takes ``cp_offset`` = the tokens before
    this rank), ``"strided"`` (``cp_offset = r``, ``global_cp_deg = P``,
    ``cp_strided_q_slicing``: the Neuron kernel's strided CP) or ``"zigzag"`` (per-row bounds).
    Arguments, results and errors as :func:`ring_flash_attn_func`.
    """
    what = "allgather_flash_attn_func"
    g = _comm.resolve_group(group, timeout)
    p, lengths = _agree(
        g,
        what,
        layout,
        lambda: _Problem(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes),
    )
    b, s, h, _, _, dv = p.shape
    fulls, error = _comm.allgather_seq(
        g, [p.k, p.v], lengths, lambda r: positions(lengths, r, layout), f"{what}: K/V"
    )
    out = lse = None
    if error is None:
        try:
            total = sum(lengths)
            pq = positions(lengths, g.rank, layout)
            if layout == "strided":
                mask = {
                    "cp_offset": g.rank,
                    "global_cp_deg": g.size,
                    "cp_strided_q_slicing": True,
                    "window_left": p.left,
                    "window_right": p.right,
                }
            else:
                mask = block_mask(pq, np.arange(total, dtype=np.int64), p.left, p.right)
            out = torch.zeros((b, s, h, dv), dtype=p.q.dtype)
            lse = torch.full((b, h, s), -math.inf, dtype=torch.float32)
            if mask is not None:
                _call(
                    Tensor("q", transpose(p.q, 1, 2)),
                    Tensor("k", transpose(fulls[0], 1, 2)),
                    Tensor("v", transpose(fulls[1], 1, 2)),
                    transpose(out, 1, 2),
                    lse=lse,
                    scale=p.scale,
                    causal_mask=False,
                    tp_k=True,
                    num_threads=num_threads,
                    **_batched(mask, b),
                )
        except Exception as e:  # noqa: BLE001 - reported to every rank by settle()
            error = e
    _comm.settle(g, error, what)
    return (out, lse, None) if return_attn_probs else out
