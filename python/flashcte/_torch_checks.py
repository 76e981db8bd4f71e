"""The argument checks of ``torch.ops.flashcte.flash_attn`` that its real and its fake (meta)
implementation share: what a fake tensor can tell, ranks, shapes, dtypes and devices."""

from __future__ import annotations

from typing import Optional

import torch

from ._errors import ArgumentError, ArgumentTypeError
from ._tensors import dtype_name

FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # what the op computes in
INTS = (torch.int32, torch.int64)  # what bound_min and bound_max may be


def check_cpu(name: str, t: Optional[torch.Tensor]) -> None:
    if t is not None and t.device.type not in ("cpu", "meta"):
        raise ArgumentError(
            f"{name}: flashcte runs on the CPU only, got a tensor on {t.device}; move the inputs "
            "with .cpu() (or use torch's own attention on that device)"
        )


def op_shapes(q, k, v, key_bias, sinks, alibi_slopes, bound_min, bound_max):
    """Checks the op's arguments (what a fake tensor can tell: ranks, shapes, dtypes, devices) and
    returns (batch, seqlen_q, heads, seqlen_k, heads_k, dv)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_cpu(name, t)
        if t.dim() != 4:
            raise ArgumentError(
                f"{name}: must have rank 4 (batch, seqlen, heads, head_dim), got shape "
                f"{tuple(t.shape)}"
            )
        if t.dtype not in FLOATS:
            raise ArgumentTypeError(
                f"{name}: dtype must be float32, float16 or bfloat16, got {dtype_name(t.dtype)}"
            )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        bad = "k" if k.dtype != q.dtype else "v"
        raise ArgumentTypeError(
            f"{bad}: dtype {dtype_name((k if bad == 'k' else v).dtype)} differs from q's dtype "
            f"{dtype_name(q.dtype)}"
        )
    batch, seqlen_q, heads, d = q.shape
    _, seqlen_k, heads_k, dk = k.shape
    dv = v.shape[3]
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ArgumentError(
            f"k, v: batch {k.shape[0]}, {v.shape[0]} must equal q's batch {batch} "
            f"(q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)})"
        )
    if v.shape[1] != seqlen_k or v.shape[2] != heads_k:
        raise ArgumentError(
            f"v: shape {tuple(v.shape)} must match k's {tuple(k.shape)} but for head_dim"
        )
    if dk != d:
        raise ArgumentError(f"k: head_dim {dk} differs from q's {d}")
    if heads_k == 0 or heads % heads_k:
        raise ArgumentError(
            f"k: {heads_k} heads must divide q's {heads} heads (grouped-query attention)"
        )
    for name, t, shapes in (
        ("key_bias", key_bias, "(batch, seqlen_k) or (batch, heads, seqlen_k)"),
        ("sinks", sinks, "(heads,)"),
        ("alibi_slopes", alibi_slopes, "(heads,) or (batch, heads)"),
        ("bound_min", bound_min, "(seqlen_q,) or (batch, seqlen_q)"),
        ("bound_max", bound_max, "(seqlen_q,) or (batch, seqlen_q)"),
    ):
        if t is None:
            continue
        check_cpu(name, t)
        want = {
            "key_bias": [(batch, seqlen_k), (batch, heads, seqlen_k)],
            "sinks": [(heads,)],
            "alibi_slopes": [(heads,), (batch, heads)],
            "bound_min": [(seqlen_q,), (batch, seqlen_q)],
            "bound_max": [(seqlen_q,), (batch, seqlen_q)],
        }[name]
        if tuple(t.shape) not in want:
            raise ArgumentError(
                f"{name}: shape {tuple(t.shape)} must be {shapes} = "
                f"{' or '.join(map(str, want))}"
            )
        if name.startswith("bound"):
            if t.dtype not in INTS:
                raise ArgumentTypeError(
                    f"{name}: dtype must be int32 or int64, got {dtype_name(t.dtype)}"
                )
        elif not t.dtype.is_floating_point:
            raise ArgumentTypeError(
                f"{name}: dtype must be a float type, got {dtype_name(t.dtype)}"
            )
    if (bound_min is None) != (bound_max is None):
        raise ArgumentError("bound_min, bound_max: pass both or neither")
    return batch, seqlen_q, heads, seqlen_k, heads_k, dv
