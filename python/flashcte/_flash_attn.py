"""FlashAttention's interface (flash_attn_func, flash_attn_varlen_func) mapped onto the library.

Layouts: q ``(batch, seqlen_q, heads, d)``, k/v ``(batch, seqlen_k, heads_k, d)``; varlen packs
the sequences: ``(total, heads, d)``. flash_attn_func is one call of the library's
flash_attn_with_kvcache for the whole batch, k and v as full caches read in place (up to 16
queries per sequence on the decode kernel, more on attention_cte), written straight into the
output: nothing is copied. Varlen is usually a single attention_cte call per problem:
the heads are the batch axis and the sequences become per-row packing bounds (ALiBi with
sequences whose positions one attention_cte call cannot express goes through
flash_attn_varlen_kvcache, the packed keys read as one-slot pages).

Masks follow FlashAttention: with ``seqlen_q != seqlen_k`` the causal diagonal is aligned to the
bottom-right corner, and query ``i`` sees keys ``j`` with
``i + seqlen_k - seqlen_q - window_size[0] <= j <= i + seqlen_k - seqlen_q + window_size[1]``
(``-1`` meaning unbounded; ``causal`` sets the right bound to 0). Rows that see no key output 0.
Scores are ``softcap * tanh(scale * q.k / softcap)`` (without softcap: ``scale * q.k``) plus
the ALiBi bias ``-slope * |i + seqlen_k - seqlen_q - j|``, then masked.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _fa_args, _flashcte
from ._attention import _call
from ._errors import ArgumentError, ArgumentTypeError
from ._kvcache import _kv8_format, varlen_over_cache
from ._tensors import (
    Tensor,
    empty,
    give_back,
    in_names,
    is_bf16_numpy,
    native,
    transpose,
    zeros,
)

ArrayLike = Any


def _bounds(seqlen_q: int, seqlen_k: int, left: int, right: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row allowed key range [lo, hi) of one sequence, FlashAttention's bottom-right
    alignment, clipped to [0, seqlen_k]; empty rows get lo == hi."""
    diag = np.arange(seqlen_q, dtype=np.int64) + (seqlen_k - seqlen_q)
    lo = np.zeros(seqlen_q, np.int64) if left < 0 else np.clip(diag - left, 0, seqlen_k)
    hi = (
        np.full(seqlen_q, seqlen_k, np.int64)
        if right < 0
        else np.clip(diag + right + 1, 0, seqlen_k)
    )
    return lo, np.maximum(hi, lo)


def _packed_alibi_positions(
    cu_q: np.ndarray, cu_k: np.ndarray, total_q: int, total_k: int
) -> tuple[int, bool] | None:
    """How one packed attention_cte call reproduces every sequence's ALiBi distances, or None.

    FlashAttention's distance for packed query row ``i`` and key ``j`` of sequence ``s`` is
    ``|i - j + cu_k[s + 1] - cu_q[s + 1]|`` (positions within the sequence, bottom-right
    aligned); the library's is ``|q_pos_offset + i - j|`` with one offset per call. So one call
    works when ``cu_k[s + 1] - cu_q[s + 1]`` is the same ``c`` for every sequence that has
    queries and keys, and ``c`` is a reachable offset: ``cp_offset = c`` (``c >= 0``), or
    ``bottom_right`` (offset ``total_k - total_q``) plus ``cp_offset = c - (total_k - total_q)``.
    Returns ``(cp_offset, bottom_right)``."""
    live = (np.diff(cu_q) > 0) & (np.diff(cu_k) > 0)
    shifts = np.unique(cu_k[1:][live] - cu_q[1:][live])
    if shifts.size > 1:
        return None
    c = int(shifts[0]) if shifts.size else 0
    if c >= 0:
        return c, False
    base = total_k - total_q
    if c >= base:
        return c - base, True
    return None


def _check_heads(qt: Tensor, kt: Tensor, vt: Tensor, axis: int) -> None:
    heads, heads_k = qt.shape[axis], kt.shape[axis]
    if vt.shape[axis] != heads_k:
        raise ArgumentError(
            f"v: has {vt.shape[axis]} heads (shape {vt.shape}), k has {heads_k} (shape {kt.shape})"
        )
    if heads_k == 0 or heads % heads_k:
        raise ArgumentError(
            f"k: {heads_k} heads must divide q's {heads} heads (grouped-query attention); "
            f"q shape {qt.shape}, k shape {kt.shape}"
        )
    if kt.shape[axis + 1] != qt.shape[axis + 1]:
        raise ArgumentError(
            f"k: head_dim {kt.shape[axis + 1]} differs from q's {qt.shape[axis + 1]} "
            f"(q shape {qt.shape}, k shape {kt.shape})"
        )


def _inputs(q: Any, k: Any, v: Any, rank: int, layout: str) -> tuple[Tensor, Tensor, Tensor]:
    tensors = []
    for name, x, lay in (("q", q, "q"), ("k", k, "k"), ("v", v, "k")):
        t = Tensor(name, x)
        if t.ndim != rank:
            raise ArgumentError(
                f"{name}: must have rank {rank} {layout.format(h='heads' if lay == 'q' else 'heads_k')}"
                f", got rank {t.ndim} (shape {t.shape})"
            )
        tensors.append(t)
    return tensors[0], tensors[1], tensors[2]


def fa_call(
    qt: Tensor,
    kt: Tensor,
    vt: Tensor,
    out: Any,
    lse: Any,
    scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Any,
    sinks: Any,
    num_threads: int | None,
    names: dict[str, str] = _fa_args.KV_NAMES,
) -> None:
    """FlashAttention's call with its arguments normalised, into caller-allocated ``out``
    ``(batch, seqlen_q, heads, dv)`` and ``lse`` ``(batch, heads, seqlen_q)`` or None: the one
    mapping of FlashAttention's layout onto the library, shared by :func:`flash_attn_func` and
    ``flashcte.torch.flash_attn``.

    The whole batch is one call and one parallel region: the library's flash_attn_with_kvcache
    over k and v as full caches (nothing appended, so they are only read), which sends up to 16
    queries per sequence to the decode kernel and more to attention_cte. Its messages name the
    caches; here they are k and v (``names``: {the library's name: the caller's})."""
    try:
        _flashcte.flash_attn_with_kvcache(
            q=native(qt),
            k_cache=native(kt),
            v_cache=native(vt),
            out=native(out),
            lse=native(lse),
            bf16_bits=is_bf16_numpy(qt.arr),
            softmax_scale=scale,
            causal=causal,
            window_left=window_left,
            window_right=window_right,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            sinks=sinks,
            num_threads=0 if num_threads is None else int(num_threads),
        )
    except (TypeError, ValueError) as e:
        raise in_names(e, names) from None


def flash_attn_func(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    return_softmax_lse: bool = False,
    *,
    s_aux: ArrayLike | None = None,
    num_threads: int | None = None,
) -> ArrayLike | tuple[ArrayLike, ArrayLike]:
    """FlashAttention's ``flash_attn_func`` on the CPU.

    Args:
        q: ``(batch, seqlen_q, heads, d)``.
        k: ``(batch, seqlen_k, heads_k, d)``; ``heads_k`` divides ``heads`` (GQA/MQA: query head
            ``h`` reads KV head ``h // (heads // heads_k)``).
        v: ``(batch, seqlen_k, heads_k, dv)``.
            float32, float16 or bfloat16; numpy arrays or DLPack tensors (torch included), read
            in place whatever their strides.
        softmax_scale: defaults to ``1 / sqrt(d)``.
        causal: causal mask aligned to the bottom-right corner when ``seqlen_q != seqlen_k``
            (for seqlen_q=2, seqlen_k=5 the mask is [[1,1,1,1,0],[1,1,1,1,1]]; for seqlen_q=5,
            seqlen_k=2 it is [[0,0],[0,0],[0,0],[1,0],[1,1]]).
        window_size: ``(left, right)``, -1 for unbounded: query ``i`` sees keys
            ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``. With
            ``causal`` the right bound is 0.
        softcap: ``> 0`` caps the scaled scores: ``S -> softcap * tanh(S / softcap)``
            (Gemma 2, Grok), before ALiBi and the masks; 0 (or None) disables it.
        alibi_slopes: ``(heads,)`` or ``(batch, heads)`` (float32 in FlashAttention; other real
            dtypes are converted): a bias ``-slope * |i + seqlen_k - seqlen_q - j|`` is added
            to the score of query ``i`` and key ``j`` after soft-capping. FlashAttention's CUDA
            kernels, under plain causal masking (no left window), add ``slope * j`` instead,
            which differs by a per-row constant: the output is the same, but their ``lse`` is
            larger by ``slope * (i + seqlen_k - seqlen_q)``; the ``lse`` returned here is the
            one of the documented bias in every mode.
        return_softmax_lse: also return the log-sum-exp of the final scores (scaled, capped,
            biased).
        s_aux: ``(heads,)``: an attention sink per query head, FlashAttention 3's argument as
            vLLM's build has it and transformers passes it for gpt-oss: a logit (not scaled)
            that joins every row's softmax without a value, so the row's weights sum to less
            than 1; ``lse`` includes it; -inf: no sink. Any float dtype (converted to float32).
            Not in FlashAttention 2's call.
        num_threads: OpenMP threads; None for OpenMP's default.

    Returns:
        ``out`` ``(batch, seqlen_q, heads, dv)`` in q's dtype and kind, or ``(out, lse)`` with
        ``lse`` float32 ``(batch, heads, seqlen_q)``. A query row that sees no key outputs 0
        and has ``lse = -inf`` (FlashAttention's CUDA kernels store +inf there; -inf is the
        log of an empty sum and merges correctly when combining partial results).

    Raises:
        TypeError, ValueError: bad inputs; the message names the argument.

    The batch is one call into the library (flash_attn_with_kvcache's, with ``k`` and ``v``
    as full caches): up to 16 queries per sequence on the decode kernel, more on attention_cte,
    every sequence's work in one parallel region.
    """
    qt, kt, vt = _inputs(q, k, v, 4, "(batch, seqlen, {h}, head_dim)")
    _check_heads(qt, kt, vt, 2)
    batch, seqlen_q, heads, d = qt.shape
    seqlen_k, dv = kt.shape[1], vt.shape[3]
    for t in (kt, vt):
        if t.shape[0] != batch:
            raise ArgumentError(f"{t.name}: batch {t.shape[0]} differs from q's batch {batch}")
    if vt.shape[1] != seqlen_k:
        raise ArgumentError(f"v: seqlen {vt.shape[1]} differs from k's seqlen {seqlen_k}")
    scale = _fa_args.softmax_scale(softmax_scale, d)
    left, right = _fa_args.window(window_size, causal)
    cap = _fa_args.softcap(softcap)
    slopes = _fa_args.alibi(alibi_slopes, batch, heads)

    out = empty(qt, (batch, seqlen_q, heads, dv))
    lse = empty(qt, (batch, heads, seqlen_q), "float32") if return_softmax_lse else None
    sink_logits = _fa_args.sinks(s_aux, heads)
    names = {**_fa_args.KV_NAMES, **_fa_args.SINK_NAMES}
    fa_call(qt, kt, vt, out, lse, scale, bool(causal), left, right, cap, slopes, sink_logits,
            num_threads, names)
    if return_softmax_lse:
        return give_back(qt, out), give_back(qt, lse)
    return give_back(qt, out)


def _view(t: Tensor, index: int | slice | None) -> Tensor:
    """(seqlen, heads, d) of batch element `index`, of the packed rows `index` (a slice) or of the
    whole varlen tensor (None), as (heads, seqlen, d)."""
    view = Tensor.__new__(Tensor)
    view.name, view.kind, view.source = t.name, t.kind, t.source
    view.arr = transpose(t.arr if index is None else t.arr[index], 0, 1)
    return view


def flash_attn_varlen_func(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    return_softmax_lse: bool = False,
    *,
    block_table: ArrayLike | None = None,
    seqused_k: ArrayLike | None = None,
    s_aux: ArrayLike | None = None,
    num_threads: int | None = None,
) -> ArrayLike | tuple[ArrayLike, ArrayLike]:
    """FlashAttention's ``flash_attn_varlen_func`` on the CPU: packed variable-length sequences.

    Args:
        q: ``(total_q, heads, d)``: the batch's query sequences back to back.
        k: ``(total_k, heads_k, d)``; ``heads_k`` divides ``heads`` (GQA/MQA).
        v: ``(total_k, heads_k, dv)``.
        cu_seqlens_q, cu_seqlens_k: ``(batch + 1,)`` integer offsets (int32 in FlashAttention):
            sequence ``s`` is rows ``[cu[s], cu[s + 1])``. Query rows past ``cu_seqlens_q[-1]``
            output 0.
        max_seqlen_q, max_seqlen_k: the longest sequences; checked against the offsets (an
            understated maximum raises ValueError), otherwise unused.
        softmax_scale, causal, window_size, softcap, return_softmax_lse, num_threads: as in
            :func:`flash_attn_func`, per sequence (the causal diagonal is aligned to each
            sequence's bottom-right corner).
        alibi_slopes: ``(heads,)`` or ``(batch, heads)``, ``batch`` the number of sequences;
            the distances are taken within each sequence, ``|i + seqlen_k - seqlen_q - j|`` with
            ``i``, ``j`` and the lengths those of the sequence, as in :func:`flash_attn_func`.
        block_table: ``(batch, max_blocks_per_seq)`` int32: ``k`` and ``v`` are then a paged KV
            cache, ``(num_blocks, page_block_size, heads_k, d / dv)`` with any
            ``page_block_size`` from 1, and sequence ``s`` has ``seqused_k[s]`` keys (else
            ``cu_seqlens_k[s + 1] - cu_seqlens_k[s]``, which may then be None) in its pages. This
            is the serving engine's mixed batch: prefill chunks and decoding sequences in one
            call and one parallel region, each sequence's queries the last of its keys.
        seqused_k: ``(batch,)`` int32, with ``block_table``: the keys of each sequence in its
            pages (FlashAttention 3's ``seqused_k``; not taken with packed ``k``, where
            ``cu_seqlens_k`` says it).
        s_aux: ``(heads,)`` attention sinks, as in :func:`flash_attn_func`, every sequence's
            rows with the same per-head sinks.

    Returns:
        ``out`` ``(total_q, heads, dv)``, or ``(out, lse)`` with ``lse`` float32
        ``(heads, total_q)``.

    Usually one attention_cte call covers the whole batch: heads are its batch axis and each
    query row's allowed key range (sequence, causal diagonal and window) is a packing bound.
    The library's ALiBi distance uses one position offset per call, which reproduces every
    sequence's distance only when ``cu_seqlens_k[s + 1] - cu_seqlens_q[s + 1]`` is the same for
    all sequences (self-attention with ``cu_seqlens_q == cu_seqlens_k``, for one) and the slopes
    are the same for all sequences; otherwise ALiBi goes through the mixed-batch call (the packed
    keys as a paged cache of one-slot pages), still one call and one parallel region.
    """
    if block_table is not None:
        for name, cache in (("k", k), ("v", v)):
            if _kv8_format(cache):
                raise ArgumentTypeError(
                    f"{name}: dtype {_kv8_format(cache)} is an 8-bit cache format, which "
                    "flash_attn_varlen_func does not read (it takes no scales); paged_attention "
                    "and flash_attn_with_kvcache do, with k_scale and v_scale"
                )

        if seqused_k is None:
            if cu_seqlens_k is None:
                raise ArgumentError(
                    "seqused_k: with block_table, seqused_k or cu_seqlens_k gives each "
                    "sequence's keys"
                )
            seqused_k = np.diff(_fa_args.cu_seqlens("cu_seqlens_k", cu_seqlens_k)).astype(np.int32)
        len_q = np.diff(_fa_args.cu_seqlens("cu_seqlens_q", cu_seqlens_q))
        _fa_args.max_seqlen("max_seqlen_q", max_seqlen_q, len_q, "query")
        used = np.asarray(seqused_k)
        if used.ndim == 1 and np.issubdtype(used.dtype, np.integer):  # else refused by name below
            _fa_args.max_seqlen("max_seqlen_k", max_seqlen_k, used, "key")
        return varlen_over_cache(
            q,
            k,
            v,
            cu_seqlens_q,
            seqused_k,
            block_table,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            _fa_args.sinks(s_aux),
            return_softmax_lse,
            num_threads,
            names={**_fa_args.KV_NAMES, **_fa_args.SINK_NAMES},
        )
    if seqused_k is not None:
        raise ArgumentError(
            "seqused_k: is taken with block_table (a paged cache) only; cu_seqlens_k gives "
            "packed keys"
        )
    qt, kt, vt = _inputs(q, k, v, 3, "(total, {h}, head_dim)")
    _check_heads(qt, kt, vt, 1)
    total_q, heads, d = qt.shape
    total_k, dv = kt.shape[0], vt.shape[2]
    if vt.shape[0] != total_k:
        raise ArgumentError(f"v: total {vt.shape[0]} differs from k's total {total_k}")
    cu_q = _fa_args.cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    cu_k = _fa_args.cu_seqlens("cu_seqlens_k", cu_seqlens_k)
    if cu_q.size != cu_k.size:
        raise ArgumentError(
            f"cu_seqlens_k: holds {cu_k.size} offsets, cu_seqlens_q {cu_q.size} (batch + 1 each)"
        )
    if cu_q[-1] > total_q:
        raise ArgumentError(f"cu_seqlens_q: ends at {cu_q[-1]} past q's total {total_q}")
    if cu_k[-1] > total_k:
        raise ArgumentError(f"cu_seqlens_k: ends at {cu_k[-1]} past k's total {total_k}")
    len_q, len_k = np.diff(cu_q), np.diff(cu_k)
    _fa_args.max_seqlen("max_seqlen_q", max_seqlen_q, len_q, "query")
    _fa_args.max_seqlen("max_seqlen_k", max_seqlen_k, len_k, "key")
    scale = _fa_args.softmax_scale(softmax_scale, d)
    left, right = _fa_args.window(window_size, causal)
    cap = _fa_args.softcap(softcap)
    slopes = _fa_args.alibi(alibi_slopes, len_q.size, heads)
    sink_logits = _fa_args.sinks(s_aux, heads)
    common = {"scale": scale, "tp_k": True, "num_threads": num_threads, "softcap": cap}

    packed: tuple[int, bool] | None = (0, False)
    if slopes is not None:
        live = (len_q > 0) & (len_k > 0)
        rows = slopes[live] if live.any() else slopes[:1]
        packed = _packed_alibi_positions(cu_q, cu_k, total_q, total_k)
        if packed is not None and rows.size and np.all(rows == rows[:1]):
            common["alibi_slopes"] = rows[0]
        else:
            packed = None

    if packed is not None:
        # One call: per-row packing bounds, ALiBi positions shifted by one common offset.
        lo = np.zeros(total_q, np.int64)
        hi = np.zeros(total_q, np.int64)
        for s in range(len_q.size):
            qs, ks = int(cu_q[s]), int(cu_k[s])
            row_lo, row_hi = _bounds(int(len_q[s]), int(len_k[s]), left, right)
            lo[qs : qs + len_q[s]] = row_lo + ks
            hi[qs : qs + len_q[s]] = row_hi + ks
        out = empty(qt, (total_q, heads, dv))
        lse = empty(qt, (heads, total_q), "float32") if return_softmax_lse else None
        cp_offset, bottom_right = packed
        try:
            _call(
                _view(qt, None),
                _view(kt, None),
                _view(vt, None),
                transpose(out, 0, 1),
                lse=lse,
                causal_mask=False,
                bound_min=lo,
                bound_max=hi,
                cp_offset=cp_offset or None,
                bottom_right=bottom_right,
                sink=None if sink_logits is None else sink_logits.reshape(heads, 1),
                **common,
            )
        except (TypeError, ValueError) as e:
            raise in_names(e, _fa_args.SINK_NAMES) from None
        if lse is not None and sink_logits is not None:
            lse[:, int(cu_q[-1]) :] = -math.inf  # rows of no sequence: no sink either
    else:
        # One call for the whole batch all the same (flash_attn_varlen_kvcache, whose ALiBi
        # distances are each sequence's own): packed k and v are a paged cache of one-slot pages,
        # and sequence s's block table is its own key rows cu_k[s] .. cu_k[s + 1]. Query rows
        # past cu_q[-1] keep out = 0, lse = -inf.
        end = int(cu_q[-1])
        table = cu_k[:-1, None] + np.arange(max(1, int(len_k.max(initial=0))))[None, :]
        table = np.minimum(table, max(total_k - 1, 0)).astype(np.int32)
        out = zeros(qt, (total_q, heads, dv))
        result = varlen_over_cache(
            q[:end],
            k[:, None],
            v[:, None],
            cu_q.astype(np.int32),
            len_k.astype(np.int32),
            table,
            scale,
            causal,
            window_size,
            softcap,
            slopes,
            sink_logits,
            return_softmax_lse,
            num_threads,
            out=out[:end],
            names={**_fa_args.KV_NAMES, **_fa_args.SINK_NAMES},
        )
        lse = None
        if return_softmax_lse:
            lse = empty(qt, (heads, total_q), "float32")
            lse[...] = -math.inf
            lse[:, :end] = result[1]
    if return_softmax_lse:
        return give_back(qt, out), give_back(qt, lse)
    return give_back(qt, out)
