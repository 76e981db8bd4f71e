"""FlashAttention's argument conventions, normalized once per call for every entry point that
takes them (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, paged_attention,
the torch operators, ring attention): ``window_size``, ``softcap``, ``alibi_slopes``,
``s_aux``, ``softmax_scale``, ``cu_seqlens_*`` and ``max_seqlen_*``. It imports nothing of the package but
the tensor plumbing, so every caller imports it at the top."""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from ._errors import ArgumentError, ArgumentTypeError
from ._tensors import float32_array, torch_module

# FlashAttention's calls hand k and v to the library's KV-cache calls as whole caches, which name
# them k_cache and v_cache.
KV_NAMES = {"k_cache": "k", "v_cache": "v"}
# ... and s_aux, FlashAttention 3's (vLLM's) attention sinks, as sinks (attention_cte's sink).
SINK_NAMES = {"sinks": "s_aux", "sink": "s_aux"}


def window(window_size: Any, causal: bool) -> tuple[int, int]:
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ArgumentTypeError(
            f"window_size: must be a pair of ints (left, right), got {window_size!r}"
        ) from None
    if left < -1 or right < -1:
        raise ArgumentError(
            f"window_size: entries must be >= -1 (-1: unbounded), got {window_size!r}"
        )
    if causal:
        right = 0
    # Positions stay far below 2^62, so larger windows are unbounded in effect (and fit int64).
    return min(left, 2**62), min(right, 2**62)


def softcap(softcap: Any) -> float:
    if softcap is None:
        return 0.0
    try:
        return float(softcap)
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"softcap: must be a float, got {softcap!r}") from None


def sinks(s_aux: Any, heads: int | None = None) -> Any:
    """``s_aux``, one sink logit per query head (FlashAttention 3 as vLLM builds it, and what
    transformers passes for gpt-oss, whose sinks are parameters of the model's dtype), as float32;
    with ``heads``, of shape ``(heads,)``. Its values are the library's to check."""
    if s_aux is None:
        return None
    a = float32_array("s_aux", s_aux)
    if heads is not None and tuple(a.shape) != (heads,):
        raise ArgumentError(f"s_aux: shape {tuple(a.shape)} must be (heads,) = ({heads},)")
    return a


def alibi(alibi_slopes: Any, batch: int, heads: int) -> np.ndarray | None:
    """FlashAttention's slopes, ``(heads,)`` or ``(batch, heads)``, as a float32 ``(batch, heads)``
    numpy array (a broadcast view for the first form)."""
    if alibi_slopes is None:
        return None
    a = np.asarray(float32_array("alibi_slopes", alibi_slopes))
    if a.shape != (heads,) and a.shape != (batch, heads):
        raise ArgumentError(
            f"alibi_slopes: shape {a.shape} must be (heads,) = ({heads},) or (batch, heads) = "
            f"({batch}, {heads})"
        )
    # Checked as given, before the broadcast: a batch of no sequence must not hide a NaN.
    bad = ~np.isfinite(a)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        if a.ndim == 1:
            raise ArgumentError(f"alibi_slopes: entry head = {where[0]} is not finite")
        raise ArgumentError(f"alibi_slopes: entry (batch, head) = {where} is not finite")
    # batch is -1 for offsets that hold no entry: the library refuses them by name.
    return a if a.ndim == 2 else np.broadcast_to(a, (max(batch, 0), heads))


def cu_seqlens(name: str, x: Any) -> np.ndarray:
    torch = torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim != 1 or a.size < 1 or not np.issubdtype(a.dtype, np.integer):
        raise ArgumentError(f"{name}: must be a 1-D integer array of batch + 1 offsets, got {a!r}")
    a = a.astype(np.int64)
    if a[0] != 0 or np.any(np.diff(a) < 0):
        raise ArgumentError(f"{name}: must start at 0 and never decrease, got {a.tolist()}")
    return a


def softmax_scale(softmax_scale: Any, d: int) -> float:
    """FlashAttention's ``softmax_scale`` (default ``1 / sqrt(d)``), refused by its own name:
    attention_cte, which takes it next, calls it ``scale``."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError):
        what = type(softmax_scale).__name__
        raise ArgumentTypeError(f"softmax_scale: expected a number, got {what}") from None
    if not math.isfinite(scale):
        raise ArgumentError(f"softmax_scale: must be finite, got {scale}")
    return scale


def max_seqlen(name: str, value: Any, lengths: np.ndarray, what: str) -> None:
    """FlashAttention's ``max_seqlen_q`` / ``max_seqlen_k``: an int no less than the longest
    sequence (``lengths``), checked where there is a sequence."""
    if not lengths.size:
        return
    try:
        value = operator.index(value)  # an int, a numpy or 0-dim torch integer
    except TypeError:
        raise ArgumentTypeError(f"{name}: expected an int, got {type(value).__name__}") from None
    if int(lengths.max()) > value:
        longest = int(lengths.max())
        raise ArgumentError(f"{name}: {value} is less than the longest {what} sequence {longest}")
