"""Attention masks on flashcte's kernel: which boolean or additive masks have an exact form as
per-row key intervals and per-key bias, and that form (flashcte.torch's
scaled_dot_product_attention and the transformers integration both use it)."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from ._errors import ArgumentError, ArgumentTypeError
from ._tensors import dtype_name


class MaskPlan:
    """How a boolean mask ``(batch, seqlen_q, seqlen_k)`` runs on the kernel: per row a key
    interval ``[bound_min, bound_max)``, intersected with the keys ``key_bias`` leaves (0) or
    masks (-inf). ``bound_min``/``bound_max`` are None when every row sees every kept key;
    ``key_bias`` is None when no interval holds a masked key."""

    __slots__ = ("bound_min", "bound_max", "key_bias")

    def __init__(self, bound_min, bound_max, key_bias):
        self.bound_min, self.bound_max, self.key_bias = bound_min, bound_max, key_bias


def decompose_mask(allowed: torch.Tensor) -> Optional[MaskPlan]:
    """Exact decomposition of a boolean mask ``(batch, seqlen_q, seqlen_k)`` (True: attend) into
    per-row key intervals and per-key masking, or None when the mask has no such form.

    ``keys[b, j]`` is "some row of batch b sees key j"; row i sees ``A = {j: allowed[b, i, j]}``,
    a subset of ``keys`` and of ``[min A, max A]``. When ``|A|`` equals the number of kept keys
    in ``[min A, max A]`` the row is exactly that interval intersected with ``keys``. Causal,
    sliding-window, chunked and block-diagonal (packed) masks, with left or right padding, all
    have this form. Costs a few passes over the mask.
    """
    batch, seqlen_q, seqlen_k = allowed.shape
    if allowed.dtype != torch.bool:
        raise ArgumentTypeError(f"allowed: dtype must be bool, got {dtype_name(allowed.dtype)}")
    a = allowed.detach().numpy()  # numpy's bool reductions run at memory speed; torch's do not
    keys = a.any(axis=1)  # (batch, seqlen_k)
    count = a.view(np.uint8).sum(axis=-1, dtype=np.int64)  # (batch, seqlen_q)
    empty = count == 0
    lo = np.where(empty, 0, a.argmax(axis=-1))  # first True
    hi = np.where(empty, 0, seqlen_k - a[..., ::-1].argmax(axis=-1))  # last True + 1
    kept = np.zeros((batch, seqlen_k + 1), dtype=np.int64)
    np.cumsum(keys, axis=-1, out=kept[:, 1:])
    inside = np.take_along_axis(kept, hi, 1) - np.take_along_axis(kept, lo, 1)
    if not np.array_equal(inside, count):
        return None
    key_bias = None
    if not np.array_equal(count, hi - lo):  # some interval holds a masked key
        key_bias = torch.zeros((batch, seqlen_k), dtype=torch.float32)
        key_bias.masked_fill_(torch.from_numpy(~keys), -math.inf)
    if bool((lo == 0).all() and (hi == seqlen_k).all()):
        return MaskPlan(None, None, key_bias)
    return MaskPlan(torch.from_numpy(lo), torch.from_numpy(hi), key_bias)


def mask_allowed(mask: torch.Tensor) -> Optional[torch.Tensor]:
    """The boolean form (True: attend) of an attention mask, or None when it has none.

    A boolean mask is its own. An additive float mask is boolean when it holds only 0 (attend)
    and masked values: ``-inf`` or anything at or below the dtype's minimum (the value
    transformers and others write for "masked"). Adding such a value to a score leaves the key
    a probability of exactly 0 in any row that keeps a key, so the two forms agree there. A row
    that keeps no key outputs 0 on flashcte's kernel (as FlashAttention, and as torch's boolean
    masks); PyTorch's softmax over a row of finite minimums averages V instead. This is the one
    rule for every caller (scaled_dot_product_attention, the transformers integration).
    """
    if mask.dtype == torch.bool:
        return mask
    allowed = mask == 0
    if not bool((allowed | (mask <= torch.finfo(mask.dtype).min)).all()):
        return None
    return allowed


def equal_along(t: torch.Tensor, dim: int) -> bool:
    """Whether every slice of `t` along `dim` equals the first (exact, one pass)."""
    t = t.detach()
    if t.shape[dim] <= 1:
        return True
    if t.dtype == torch.bfloat16:  # no numpy dtype: torch's comparison
        return bool((t == t.narrow(dim, 0, 1)).all())
    a = t.numpy()
    first = a[(slice(None),) * (dim % a.ndim) + (slice(0, 1),)]
    return bool((a == first).all())


_SUPPORTED_MASKS = (
    "supported attn_mask forms: (1) a mask that is the same for every query (broadcast over the "
    "query axis, e.g. a padding mask of shape (B, 1, 1, S_kv) or (B, 1, S_q, S_kv) with all rows "
    "equal), boolean or additive, per batch and head; (2) a boolean mask (or an additive one of 0 "
    "and -inf or the dtype's minimum only), the same for every head, "
    "whose every row is one interval of keys intersected with a per-key padding mask (causal, "
    "sliding-window, block-diagonal masks with left or right padding); is_causal=True with no mask"
)


def mask_to_plan(mask, batch, heads, seqlen_q, seqlen_k):
    """attn_mask (broadcastable to (B, H, Sq, Skv)) -> (key_bias, bound_min, bound_max)."""
    if not isinstance(mask, torch.Tensor):
        raise ArgumentTypeError(f"attn_mask: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise ArgumentTypeError(
            f"attn_mask: dtype must be bool or a float type, got {dtype_name(mask.dtype)}"
        )
    if mask.dim() > 4:
        raise ArgumentError(f"attn_mask: rank {mask.dim()} is more than 4")
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # a view
    full = (batch, heads, seqlen_q, seqlen_k)
    if any(s not in (1, f) for s, f in zip(m.shape, full)):
        raise ArgumentError(
            f"attn_mask: shape {tuple(mask.shape)} does not broadcast to (batch, heads, L, S) = "
            f"{full}"
        )
    # The checks run on the mask as given (broadcast axes stay size 1), the results broadcast.
    m = m.expand(-1, -1, -1, seqlen_k)
    compiling = torch.compiler.is_compiling()
    per_key = m.shape[2] == 1
    if not per_key and not compiling:
        per_key = equal_along(m, 2)
    if per_key:
        row = m[:, :, 0, :]
        if mask.dtype == torch.bool:
            bias = torch.zeros(row.shape, dtype=torch.float32).masked_fill_(~row, -math.inf)
        else:
            bias = row.to(torch.float32)
        return bias.expand(batch, heads, seqlen_k), None, None
    if compiling:
        raise ArgumentError(
            "attn_mask: under torch.compile only masks broadcast over the query axis (size 1 "
            "there, e.g. (B, 1, 1, S_kv)) are supported; " + _SUPPORTED_MASKS
        )
    allowed = mask_allowed(m)
    if allowed is not None and equal_along(allowed, 1):
        plan = decompose_mask(allowed[:, 0])
        if plan is not None:
            bias = plan.key_bias
            lo, hi = plan.bound_min, plan.bound_max
            return (
                None if bias is None else bias[:, None, :].expand(batch, heads, seqlen_k),
                None if lo is None else lo.expand(batch, seqlen_q),
                None if hi is None else hi.expand(batch, seqlen_q),
            )
    raise ArgumentError(
        f"attn_mask: this mask (shape {tuple(mask.shape)}, {dtype_name(mask.dtype)}) varies along both the "
        "query and the key axis in a way flashcte cannot express; " + _SUPPORTED_MASKS
    )
