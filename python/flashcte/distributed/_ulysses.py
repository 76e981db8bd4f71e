"""Ulysses-style context parallelism (DeepSpeed-Ulysses): all-to-all from sequence shards to head
shards, attention of the whole sequence on this rank's heads, all-to-all back.

Every rank passes its own tokens in FlashAttention's layout, ``q (batch, local_seqlen, heads,
d)``, ``k``/``v (batch, local_seqlen, heads_k, d)``. The first all-to-all gives rank r the whole
sequence of query heads ``r * heads / P .. (r + 1) * heads / P - 1`` and of the KV heads those
read; one flashcte call per batch element computes them (the full self-attention, so masks are
the single-process call's); the second all-to-all returns every rank its own tokens of every
head. Both are gloo ``all_to_all_single`` calls on byte buffers with per-rank split sizes (gloo's
alltoallv), so ranks may hold different numbers of tokens.

Heads. ``heads`` must be divisible by P. KV heads (GQA): ``heads_k`` divisible by P gives each
rank ``heads_k / P`` of them; P a multiple of ``heads_k`` gives each rank the one KV head its
query heads read, each KV head replicated to ``P / heads_k`` ranks (its tokens are sent to each
of them); anything else is refused (a rank's query heads would read a non-uniform set of KV
heads).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .._errors import ArgumentError
from .._flash_attn import flash_attn_func
from . import _comm
from ._ring import _agree, _Problem
from ._shard import positions

ArrayLike = Any


def head_split(heads: int, heads_k: int, world: int) -> tuple[int, int]:
    """(query heads, KV heads) per rank under the rule of the module docstring; ValueError
    naming the argument otherwise. Rank r holds query heads ``[r * hq, (r + 1) * hq)`` and KV
    heads ``[r * hq // (heads // heads_k), ... + hk)``."""
    if heads % world:
        raise ArgumentError(
            f"q: {heads} heads are not divisible by the group size {world} (Ulysses gives each "
            "rank heads / P query heads)"
        )
    if heads_k % world and world % heads_k:
        raise ArgumentError(
            f"k: {heads_k} KV heads cannot be split over {world} ranks: Ulysses needs heads_k "
            f"divisible by the group size (each rank gets heads_k / P) or the group size a "
            f"multiple of heads_k (each KV head replicated to P / heads_k ranks)"
        )
    return heads // world, max(1, heads_k // world)


def _rows(pos: np.ndarray) -> Any:
    """An index of axis 1 for the positions ``pos``: a slice when they are one run."""
    if pos.size and int(pos[-1]) - int(pos[0]) == pos.size - 1:
        return slice(int(pos[0]), int(pos[-1]) + 1)
    return torch.from_numpy(pos)


def _all_to_all(g, send, send_sizes, recv_sizes, what):
    """gloo's alltoallv on flat byte buffers: ``send_sizes[r]`` bytes to rank r, ``recv_sizes[r]``
    from it."""
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8)
    if g.size == 1:
        recv.copy_(send)
        return recv
    work = dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=recv_sizes,
        input_split_sizes=send_sizes,
        group=g.group,
        async_op=True,
    )
    g.wait(work, what)
    return recv


def ulysses_flash_attn_func(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    return_attn_probs: bool = False,
    group: Any = None,
    *,
    layout: str = "contiguous",
    dropout_p: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    timeout: Any = None,
    num_threads: int | None = None,
):
    """Ulysses (all-to-all) context parallelism in FlashAttention's layout.

    Rank r of ``group`` (default: the world) holds its shard of the sequence: ``layout`` is
    ``"contiguous"`` (one run per rank in rank order, any lengths, exchanged first),
    ``"strided"`` or ``"zigzag"`` (:func:`flashcte.distributed.shard`'s splits, with their length
    rules). An all-to-all turns the shards into head shards of the whole sequence (rank r: query
    heads ``r * heads / P ..``, and the KV heads they read), one flashcte call per batch element
    computes them, and a second all-to-all returns each rank its own tokens. Every rank computes
    ``1 / P`` of the attention whatever the mask and the split (no causal imbalance).

    Args:
        q: ``(batch, local_seqlen, heads, d)``; k, v: ``(batch, local_seqlen, heads_k, d)``
            torch CPU tensors (float32, float16, bfloat16), this rank's tokens. ``heads``
            divisible by P; ``heads_k`` divisible by P or P a multiple of ``heads_k`` (then each
            KV head is replicated to ``P / heads_k`` ranks).
        softmax_scale, causal, window_size: as :func:`flashcte.flash_attn_func` on the whole
            sequence (self-attention: positions are global).
        return_attn_probs: also return lse: ``(out, lse, None)`` (lse travels back only then).
        group: the process group. layout: the split (above). timeout: seconds or a timedelta
            bounding every wait (None: the group's timeout). num_threads: OpenMP threads of the
            local call. dropout_p (must be 0), alibi_slopes (must be None), deterministic
            (ignored): keyword-only, accepted so that calls written for the ring functions with
            keywords run unchanged.

    Returns:
        ``out (batch, local_seqlen, heads, d)`` in q's dtype, or ``(out, lse, None)`` with
        ``lse (batch, heads, local_seqlen)`` float32: this rank's rows of ``flash_attn_func`` on
        the whole sequence. Each head's attention is one call on the whole sequence, as in the
        single-process call: no merges, one rounding for 16-bit outputs.

    Errors (bad arguments on any rank, heads the group cannot split, arguments that differ
    between ranks, lengths the split does not produce, a failure while computing) raise on every
    rank; a peer that never arrives raises RuntimeError after ``timeout`` instead of hanging.
    """
    what = "ulysses_flash_attn_func"
    g = _comm.resolve_group(group, timeout)

    def make():
        p = _Problem(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes)
        _, _, h, _, hk, _ = p.shape
        head_split(h, hk, g.size)
        return p

    p, lengths = _agree(g, what, layout, make)
    b, s, h, d, hk, dv = p.shape
    hq, hkv = head_split(h, hk, g.size)
    group_size = h // hk  # query heads per KV head
    kv0 = [r * hq // group_size for r in range(g.size)]  # rank r's first KV head
    dtype = p.q.dtype
    total = sum(lengths)
    rows = [_rows(positions(lengths, r, layout)) for r in range(g.size)]

    # Forward: to rank r, this rank's tokens of r's query and KV heads; from rank r, r's tokens
    # of this rank's heads.
    def shapes(n):
        return (b, n, hq, d), (b, n, hkv, d), (b, n, hkv, dv)

    def seg(n):
        return sum(_comm.nbytes(x, dtype) for x in shapes(n))

    send_sizes = [seg(s)] * g.size
    recv_sizes = [seg(n) for n in lengths]
    send = torch.empty(sum(send_sizes), dtype=torch.uint8)
    error: BaseException | None = None
    try:
        offset = 0
        for r in range(g.size):
            parts = (
                p.q[:, :, r * hq : (r + 1) * hq],
                p.k[:, :, kv0[r] : kv0[r] + hkv],
                p.v[:, :, kv0[r] : kv0[r] + hkv],
            )
            for part, shape in zip(parts, shapes(s)):
                _comm.byte_view(send, offset, dtype, shape).copy_(part)
                offset += _comm.nbytes(shape, dtype)
    except Exception as e:  # noqa: BLE001 - reported to every rank by settle()
        error = e
    recv = _all_to_all(g, send, send_sizes, recv_sizes, f"{what}: Q/K/V all_to_all")
    del send
    want_lse = bool(return_attn_probs)
    out_h = lse_h = None
    if error is None:
        try:
            full = [torch.empty((b, total) + x[2:], dtype=dtype) for x in shapes(total)]
            offset = 0
            for r, n in enumerate(lengths):
                for f, shape in zip(full, shapes(n)):
                    f[:, rows[r]] = _comm.byte_view(recv, offset, dtype, shape)
                    offset += _comm.nbytes(shape, dtype)
            del recv
            qf, kf, vf = full
            # The whole sequence of this rank's heads: flashcte's FlashAttention call, with the
            # window (causal included) already resolved by _Problem.
            out_h, lse_h = flash_attn_func(
                qf,
                kf,
                vf,
                softmax_scale=p.scale,
                window_size=(p.left, p.right),
                return_softmax_lse=True,
                num_threads=num_threads,
            )
            del full, qf, kf, vf
        except Exception as e:  # noqa: BLE001 - reported to every rank by settle()
            error = e

    # Back: to rank r, r's tokens of this rank's heads (and their lse); from rank r, this rank's
    # tokens of r's heads.
    def back(n):
        return ((b, n, hq, dv), dtype), ((b, hq, n), torch.float32)

    def seg_back(n):
        return sum(_comm.nbytes(*x) for x in back(n)[: 1 + want_lse])

    send_sizes = [seg_back(n) for n in lengths]
    recv_sizes = [seg_back(s)] * g.size
    send = torch.empty(sum(send_sizes), dtype=torch.uint8)
    if error is None:
        try:
            offset = 0
            for r, n in enumerate(lengths):
                (o_shape, o_dtype), (l_shape, l_dtype) = back(n)
                _comm.byte_view(send, offset, o_dtype, o_shape).copy_(out_h[:, rows[r]])
                offset += _comm.nbytes(o_shape, o_dtype)
                if want_lse:
                    _comm.byte_view(send, offset, l_dtype, l_shape).copy_(lse_h[:, :, rows[r]])
                    offset += _comm.nbytes(l_shape, l_dtype)
        except Exception as e:  # noqa: BLE001 - reported to every rank by settle()
            error = e
    out_h = lse_h = None
    recv = _all_to_all(g, send, send_sizes, recv_sizes, f"{what}: output all_to_all")
    del send
    out = lse = None
    if error is None:
        try:
            out = torch.empty((b, s, h, dv), dtype=dtype)
            lse = torch.empty((b, h, s), dtype=torch.float32) if want_lse else None
            (o_shape, o_dtype), (l_shape, l_dtype) = back(s)
            offset = 0
            for r in range(g.size):
                heads = slice(r * hq, (r + 1) * hq)
                out[:, :, heads] = _comm.byte_view(recv, offset, o_dtype, o_shape)
                offset += _comm.nbytes(o_shape, o_dtype)
                if want_lse:
                    lse[:, heads] = _comm.byte_view(recv, offset, l_dtype, l_shape)
                    offset += _comm.nbytes(l_shape, l_dtype)
        except Exception as e:  # noqa: BLE001 - reported to every rank by settle()
            error = e
    _comm.settle(g, error, what)
    return (out, lse, None) if return_attn_probs else out
