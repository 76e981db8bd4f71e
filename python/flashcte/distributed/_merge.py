"""merge_attn_states: two attention results over disjoint key sets into the result over their
union (include/flashcte/merge.h, the library's KV-split merge)."""

from __future__ import annotations

from typing import Any

from .. import _flashcte
from .._errors import ArgumentError, ArgumentTypeError
from .._tensors import NUMPY, TORCH, Tensor, empty, give_back, is_bf16_numpy, native, transpose

ArrayLike = Any


def _output(name: str, x: Any, shape: tuple, like: Tensor) -> Any:
    """A caller-given output: written in place, so it must be of q's kind and viewable as is."""
    t = Tensor(name, x)
    if t.kind != like.kind or t.kind not in (NUMPY, TORCH):
        raise ArgumentTypeError(
            f"{name}: must be a {like.kind} array like out_a, got {type(x).__name__}"
        )
    if t.kind == NUMPY and t.arr is not x:
        raise ArgumentError(f"{name}: numpy array with strides the library cannot write in place")
    if t.shape != shape:
        raise ArgumentError(f"{name}: shape {t.shape} must be {shape}")
    return t.arr


def merge_attn_states(
    out_a: ArrayLike,
    lse_a: ArrayLike,
    out_b: ArrayLike,
    lse_b: ArrayLike,
    *,
    out: ArrayLike | None = None,
    lse: ArrayLike | None = None,
) -> tuple[ArrayLike, ArrayLike]:
    """Merges two attention results over disjoint sets of keys into the result over their union.

    ``lse = log(exp(lse_a) + exp(lse_b))``, ``out = exp(lse_a - lse) out_a + exp(lse_b - lse)
    out_b``, computed by the library's own KV-split merge (exact up to a few float32 roundings per
    element). A row with ``lse = -inf`` on one side (it saw no key there; its out is ignored) is
    the other side's row unchanged; empty on both sides it is ``out 0``, ``lse -inf``. NaN in
    either side gives NaN, and so does ``lse = +inf`` (FlashAttention's CUDA kernels store +inf
    for empty rows: replace it by -inf first).

    Layouts (out_a, out_b and out alike, lse_a, lse_b and lse alike):

    * attention_cte: ``out (bs, Sq, dv)`` with ``lse (bs, Sq)``, or ``(rows, dv)`` with
      ``(rows,)``: lse has out's shape without its last axis;
    * FlashAttention: ``out (batch, seqlen, heads, dv)`` with ``lse (batch, heads, seqlen)``, as
      ``flash_attn_func(..., return_softmax_lse=True)`` returns them. (Varlen's
      ``(total, heads, dv)`` with ``(heads, total)``: pass ``lse.T``, a view.)

    Args:
        out_a, out_b: float32, float16 or bfloat16 (each its own); numpy arrays or torch
            tensors, read in place whatever their strides.
        lse_a, lse_b: float32.
        out, lse: optional outputs to write into, e.g. ``out=out_a, lse=lse_a`` to accumulate
            in place (an output may be exactly one of the inputs, not partly overlap one).

    Returns:
        ``(out, lse)`` in out_a's kind: out in out_a's dtype when out_b has the same dtype, else
        float32 (unless ``out`` is given), lse float32.
    """
    ta, tb = Tensor("out_a", out_a), Tensor("out_b", out_b)
    la, lb = Tensor("lse_a", lse_a), Tensor("lse_b", lse_b)
    shape = ta.shape
    if ta.ndim == 4:
        batch, seqlen, heads, _ = shape
        lse_shape = (batch, heads, seqlen)
        for t, want, what in (
            (tb, shape, "out_a's"),
            (la, lse_shape, "(batch, heads, seqlen) ="),
            (lb, lse_shape, "(batch, heads, seqlen) ="),
        ):
            if t.shape != want:
                raise ArgumentError(
                    f"{t.name}: shape {t.shape} must be {what} {want} (FlashAttention layout: "
                    f"out (batch, seqlen, heads, dv), lse (batch, heads, seqlen))"
                )
    elif ta.ndim in (2, 3):
        lse_shape = shape[:-1]
    else:
        raise ArgumentError(
            f"out_a: must have rank 2 (rows, dv), 3 (bs, Sq, dv) or 4 (batch, seqlen, heads, dv), "
            f"got shape {shape}"
        )
    if out is None:
        dtype = ta.dtype_name if ta.dtype_name == tb.dtype_name else "float32"
        out_arr = empty(ta, shape, dtype)
    else:
        out_arr = _output("out", out, shape, ta)
    lse_arr = empty(ta, lse_shape, "float32") if lse is None else _output("lse", lse, lse_shape, ta)
    bf16_bits = any(is_bf16_numpy(a) for a in (ta.arr, tb.arr, out_arr))

    def call(oa, la_, ob, lb_, o, l_):
        _flashcte.merge_attn_states(
            out_a=native(oa),
            lse_a=la_,
            out_b=native(ob),
            lse_b=lb_,
            out=native(o),
            lse=l_,
            bf16_bits=bf16_bits,
        )

    if ta.ndim == 4:  # (batch, seqlen, heads, dv) as the native (batch, heads, seqlen, dv)
        call(
            transpose(ta.arr, 1, 2),
            la.arr,
            transpose(tb.arr, 1, 2),
            lb.arr,
            transpose(out_arr, 1, 2),
            lse_arr,
        )
    else:
        call(ta.arr, la.arr, tb.arr, lb.arr, out_arr, lse_arr)
    return give_back(ta, out if out is not None else out_arr), give_back(
        ta, lse if lse is not None else lse_arr
    )
