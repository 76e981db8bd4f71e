"""flashcte for PyTorch: a ``torch.library`` op and a ``scaled_dot_product_attention`` drop-in.

``import flashcte.torch`` registers the operator ``torch.ops.flashcte.flash_attn`` (with a fake
implementation, so ``torch.compile(fullgraph=True)`` traces through it) and provides:

* :func:`flash_attn`: the op, FlashAttention's layout ``(batch, seqlen, heads, head_dim)``,
  returning ``(out, lse)``;
* :func:`scaled_dot_product_attention`: ``torch.nn.functional.scaled_dot_product_attention``'s
  signature, layout ``(batch, heads, seqlen, head_dim)``, top-left causal alignment and defaults.

CPU tensors only (float32, float16, bfloat16). q, k and v are read in place whatever their strides
(contiguous tensors and transposed or sliced views alike); the outputs are allocated with
``torch.empty``; the GIL is released while the kernel runs. There is no backward: calling the op
while autograd records (grad mode on and an input that requires grad) raises ``RuntimeError``;
run under ``torch.no_grad()`` / ``torch.inference_mode()`` or detach the inputs.
"""

from __future__ import annotations

import inspect
import math
from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _kvcache
from ._attention import _call
from ._errors import ArgumentError, ArgumentTypeError
from ._flash_attn import fa_call
from ._tensors import Tensor
from ._torch_checks import check_cpu, op_shapes
from ._torch_masks import MaskPlan, decompose_mask, mask_allowed, mask_to_plan

if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):  # pragma: no cover
    raise ImportError(
        "flashcte.torch needs torch >= 2.4 (torch.library.custom_op); found torch "
        f"{torch.__version__}"
    )

__all__ = [
    "MaskPlan",
    "decompose_mask",
    "flash_attn",
    "flash_attn_with_kvcache",
    "mask_allowed",
    "scaled_dot_product_attention",
]

# ---- the operator -----------------------------------------------------------------------------


# The op's one signature: its schema is inferred from these annotations (torch.library.custom_op),
# and the fake and the public flash_attn take theirs from it.
def _flash_attn_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    bottom_right: bool = True,
    softcap: float = 0.0,
    key_bias: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    bound_min: Optional[torch.Tensor] = None,
    bound_max: Optional[torch.Tensor] = None,
    num_threads: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, heads, seqlen_k, _, dv = op_shapes(
        q, k, v, key_bias, sinks, alibi_slopes, bound_min, bound_max
    )
    out = torch.empty((batch, seqlen_q, heads, dv), dtype=q.dtype)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    if seqlen_k == 0:  # no key at all: every row sees nothing
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.to(torch.float32)
    if sinks is not None:
        sinks = sinks.to(torch.float32)
    # The alignment of unequal lengths matters only to what measures a query's position against
    # a key's: the causal mask, a window, ALiBi. Without them (a transformers decode step: one
    # query, top-left, against the whole cache) both alignments are the same call.
    aligned = bottom_right or seqlen_q == seqlen_k
    positional = causal or window_left >= 0 or window_right >= 0 or alibi_slopes is not None
    aligned = aligned or not positional
    if key_bias is None and bound_min is None and aligned:
        # FlashAttention's own arguments take FlashAttention's one mapping (flash_attn_func's),
        # which also sends short query blocks to the decode kernel: 3.1x faster for one query
        # row over 2,048 keys (9/3 heads of 64, 1 thread: 555 -> 180 us [AMD EPYC Zen 4]).
        qt, kt, vt = Tensor("q", q), Tensor("k", k), Tensor("v", v)
        fa_call(qt, kt, vt, out, lse, scale, bool(causal), int(window_left), int(window_right),
                float(softcap), alibi_slopes, sinks, num_threads)
        return out, lse
    # What that call cannot express (a key bias, per-row bounds, top-left alignment of unequal
    # lengths): attention_cte's rank-4 form, one call for the whole batch, entry b the
    # (heads, seqlen, d) problem of sequence b, every view a transpose of the caller's tensors.
    if key_bias is not None:
        key_bias = key_bias.to(torch.float32)
        if key_bias.dim() == 2:
            key_bias = key_bias[:, None, :]
        key_bias = key_bias.expand(batch, heads, seqlen_k)  # a view (stride 0 over heads)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.expand(batch, heads)
    if sinks is not None:
        sinks = sinks.expand(batch, heads)  # a view (stride 0 over the batch)
    if bound_min is not None:
        bound_min = bound_min.expand(batch, seqlen_q)
        bound_max = bound_max.expand(batch, seqlen_q)
    _call(
        Tensor("q", q.transpose(1, 2)),
        Tensor("k", k.transpose(1, 2)),
        Tensor("v", v.transpose(1, 2)),
        out.transpose(1, 2),
        lse=lse,
        scale=scale,
        causal_mask=bool(causal),
        tp_k=True,
        num_threads=num_threads,
        softcap=float(softcap),
        sink=sinks,
        alibi_slopes=alibi_slopes,
        key_bias=key_bias,
        bound_min=bound_min,
        bound_max=bound_max,
        window_left=int(window_left),
        window_right=int(window_right),
        bottom_right=bool(bottom_right),
    )
    return out, lse


_flash_attn_op = torch.library.custom_op("flashcte::flash_attn", mutates_args=())(_flash_attn_impl)
_FLASH_ATTN_SIGNATURE = inspect.signature(_flash_attn_impl)


@_flash_attn_op.register_fake
def _flash_attn_fake(*args, **kwargs):
    a = _FLASH_ATTN_SIGNATURE.bind(*args, **kwargs).arguments
    extras = (a.get(name) for name in ("key_bias", "sinks", "alibi_slopes", "bound_min", "bound_max"))
    batch, seqlen_q, heads, _, _, dv = op_shapes(a["q"], a["k"], a["v"], *extras)
    out = a["q"].new_empty((batch, seqlen_q, heads, dv))
    lse = a["q"].new_empty((batch, heads, seqlen_q), dtype=torch.float32)
    return out, lse


def _no_backward(ctx, inputs, output):
    # Called by the op's autograd kernel only when grad mode is on and an input requires grad.
    raise RuntimeError(
        "flashcte.flash_attn: the backward pass is not implemented, and an input requires grad. "
        "Run inference under torch.no_grad() or torch.inference_mode(), or detach the inputs."
    )


def _backward(ctx, *grads):  # pragma: no cover - _no_backward refuses first
    raise RuntimeError("flashcte.flash_attn: the backward pass is not implemented")


_flash_attn_op.register_autograd(_backward, setup_context=_no_backward)


_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)


def _dispatcher_idle(args: tuple, kwargs: dict) -> bool:
    """Whether nothing torch's dispatcher adds to the op is in play for this call, so that the
    public function may run the op's implementation directly: not compiling or tracing, no
    dispatch mode (fake tensors, functionalization), no functorch transform (vmap), plain
    tensors only (no subclass), and none that autograd would record (the op refuses those).
    The dispatcher took 11 us of a 45 us decode call through transformers (one query row over
    16 keys, keyword arguments; AMD EPYC Zen 4)."""
    if (
        torch.compiler.is_compiling()
        or _get_current_dispatch_mode() is not None
        or _functorch_active()
    ):
        return False
    grad = torch.is_grad_enabled()
    tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
    return all(type(x) is torch.Tensor and not (grad and x.requires_grad) for x in tensors)


def flash_attn(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.flashcte.flash_attn``: attention in FlashAttention's layout.

    Args:
        q: ``(batch, seqlen_q, heads, d)``; k: ``(batch, seqlen_k, heads_k, d)``;
            v: ``(batch, seqlen_k, heads_k, dv)``. One dtype (float32, float16, bfloat16), CPU,
            any strides (a ``(batch, heads, seqlen, d)`` tensor passes as ``x.transpose(1, 2)``,
            without a copy). ``heads_k`` divides ``heads`` (GQA: query head ``h`` reads KV head
            ``h // (heads // heads_k)``, torch's ``repeat_interleave``).
        softmax_scale: multiplies ``q.k``; None for ``1/sqrt(d)``.
        causal: keep key ``j`` for query ``i`` only when ``j <= i + offset``, where ``offset``
            is ``seqlen_k - seqlen_q`` with ``bottom_right`` (FlashAttention's alignment, the
            default) and 0 without (torch's ``is_causal``).
        window_left, window_right: keep ``-window_left <= j - i - offset <= window_right``
            (-1: unbounded), intersected with ``causal``.
        softcap: ``> 0``: scores ``S -> softcap * tanh(S / softcap)``.
        key_bias: ``(batch, seqlen_k)`` or ``(batch, heads, seqlen_k)``, added to the scores
            after soft-capping; ``-inf`` masks a key (padding). Converted to float32.
        sinks: ``(heads,)``: one extra logit per head, not scaled, that enters the softmax's
            max and denominator and has no value (gpt-oss's sinks).
        alibi_slopes: ``(heads,)`` or ``(batch, heads)``: ``S += -slope * |i + offset - j|``.
        bound_min, bound_max: ``(seqlen_q,)`` or ``(batch, seqlen_q)`` int32/int64: query row
            ``i`` sees only keys ``bound_min[i] <= j < bound_max[i]`` (per batch element).
        num_threads: OpenMP threads; None for OpenMP's default.

    Returns:
        ``(out, lse)``: ``out`` ``(batch, seqlen_q, heads, dv)`` contiguous in q's dtype, ``lse``
        float32 ``(batch, heads, seqlen_q)``, the log-sum-exp of the final scores (sink
        included). Rows that see no key (and no sink) output 0 with ``lse = -inf``.

    Raises:
        ValueError: non-CPU tensors, shapes; TypeError: dtypes; RuntimeError: autograd.
    """
    try:
        if _dispatcher_idle(args, kwargs):
            return _flash_attn_impl(*args, **kwargs)
        return torch.ops.flashcte.flash_attn(*args, **kwargs)
    except (RuntimeError, TypeError):
        # A wrong argument is the TypeError of Python's binding, whichever way the call went (the
        # op's schema says RuntimeError). Bound here, after the fact, rather than before every
        # call: binding costs 10-30 us, a third of a short decode call's time (AMD EPYC Zen 4).
        _FLASH_ATTN_SIGNATURE.bind(*args, **kwargs)
        raise


# help() and IDEs show the op's signature.
flash_attn.__signature__ = _FLASH_ATTN_SIGNATURE


# ---- flash_attn_with_kvcache: the serving call, caches mutated in place -------------------------

@torch.library.custom_op(
    "flashcte::flash_attn_with_kvcache",
    mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"),
)
def _kvcache_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[torch.Tensor] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    num_threads: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kvcache.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale, causal, (window_left, window_right), softcap,
        rotary_interleaved, alibi_slopes, return_softmax_lse=True, k_scale=k_scale,
        v_scale=v_scale, num_threads=num_threads,
    )


@_kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, *args, **kwargs):
    batch, seqlen_q, heads, _ = q.shape
    out = q.new_empty((batch, seqlen_q, heads, v_cache.shape[3]))
    return out, q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens=None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    k_scale=None,
    v_scale=None,
    num_threads: Optional[int] = None,
):
    """``torch.ops.flashcte.flash_attn_with_kvcache``: :func:`flashcte.flash_attn_with_kvcache`
    (FlashAttention's signature and semantics) as a torch operator that declares its writes to
    ``k_cache`` and ``v_cache`` (and to per-token ``k_scale`` / ``v_scale`` of an 8-bit cache);
    ``cache_seqlens`` and the scales may be numbers."""
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32)
    if isinstance(k_scale, (int, float)):
        k_scale = torch.full((1,), float(k_scale), dtype=torch.float32)
    if isinstance(v_scale, (int, float)):
        v_scale = torch.full((1,), float(v_scale), dtype=torch.float32)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.to(torch.float32)
    left, right = (int(w) for w in window_size)
    out, lse = torch.ops.flashcte.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, block_table, softmax_scale, causal, left, right, softcap,
        rotary_interleaved, alibi_slopes, k_scale, v_scale, num_threads,
    )
    return (out, lse) if return_softmax_lse else out


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` on flashcte's kernel.

    Same signature, layout and defaults: ``query (B, H, L, E)``, ``key (B, H_kv, S, E)``,
    ``value (B, H_kv, S, Ev)`` (rank 3 ``(H, L, E)`` too), ``scale`` None for ``1/sqrt(E)``,
    ``is_causal`` top-left aligned (query ``i`` sees keys ``j <= i``), ``enable_gqa`` for
    ``H % H_kv == 0`` (``repeat_interleave`` grouping). ``key``/``value`` with batch 1 broadcast.

    ``attn_mask`` (broadcastable to ``(B, H, L, S)``; boolean True = attend, or additive float):
    a mask that is the same for every query (a padding mask, ``(B, 1, 1, S)``, or ``(B, 1, L, S)``
    whose rows are equal -- checked, one pass over the mask) becomes the kernel's per-key bias;
    a boolean mask whose rows are key intervals intersected with a per-key mask (causal or
    sliding-window plus padding) becomes per-row bounds, and so does an additive one of 0 and
    masked values (:func:`mask_allowed`). Other masks raise ValueError saying which masks are
    supported. ``dropout_p`` must be 0.

    Returns ``(B, H, L, Ev)`` in query's dtype: a ``transpose(1, 2)`` view of a contiguous
    ``(B, L, H, Ev)`` tensor (``out.transpose(1, 2).reshape(B, L, H * Ev)`` is then free).
    Rows that see no key output 0 (as torch's boolean masks do; where an additive mask puts the
    dtype's minimum on every key of a row, torch averages V instead).
    """
    if dropout_p:
        raise ArgumentError(f"dropout_p: flashcte has no dropout, got {dropout_p}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    rank = query.dim()
    if rank not in (3, 4) or key.dim() != rank or value.dim() != rank:
        raise ArgumentError(
            "query, key, value: must all have rank 4 (B, H, L, E) or rank 3 (H, L, E), got "
            f"shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if rank == 3:
        query, key, value = query[None], key[None], value[None]
    batch, heads, seqlen_q, _ = query.shape
    heads_k, seqlen_k = key.shape[1], key.shape[2]
    if key.shape[0] != batch:
        if key.shape[0] != 1 or value.shape[0] != 1:
            raise ArgumentError(
                f"key, value: batch {key.shape[0]} must equal query's batch {batch} (or be 1)"
            )
        key = key.expand(batch, -1, -1, -1)
        value = value.expand(batch, -1, -1, -1)
    if heads_k != heads and not enable_gqa:
        raise ArgumentError(
            f"key: {heads_k} heads differ from query's {heads}; pass enable_gqa=True for "
            "grouped-query attention"
        )
    if attn_mask is not None and is_causal:
        raise ArgumentError(
            "attn_mask: pass either attn_mask or is_causal=True, not both (as torch)"
        )
    key_bias = bound_min = bound_max = None
    if attn_mask is not None:
        if rank == 3 and attn_mask.dim() == 4:
            raise ArgumentError("attn_mask: rank 4 with rank-3 query, key and value")
        check_cpu("attn_mask", attn_mask)
        key_bias, bound_min, bound_max = mask_to_plan(attn_mask, batch, heads, seqlen_q, seqlen_k)
    out, _ = flash_attn(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        softmax_scale=scale,
        causal=bool(is_causal),
        bottom_right=False,
        key_bias=key_bias,
        bound_min=bound_min,
        bound_max=bound_max,
    )
    out = out.transpose(1, 2)
    return out[0] if rank == 3 else out
