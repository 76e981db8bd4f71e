"""FlashAttention's serving call, ``flash_attn_with_kvcache``, on the CPU (flashcte/kvcache.h).

The contract is FlashAttention's ``flash_attn_interface.flash_attn_with_kvcache`` and its test
(``test_flash_attn_kvcache``): new ``k``/``v`` are appended into the cache in place at
``cache_seqlens``, rotary embedding turns them and ``q`` at their absolute positions, and ``q``
attends each sequence's cache, dense or paged. The differences, all deliberate, are listed in
:func:`flash_attn_with_kvcache`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _fa_args, _flashcte
from ._errors import ArgumentError, ArgumentTypeError
from ._tensors import (
    NUMPY,
    Tensor,
    empty,
    give_back,
    in_names,
    is_bf16_numpy,
    native,
    torch_module,
)

ArrayLike = Any


def _writable(name: str, x: Any, why: str) -> Tensor:
    """An argument the call writes in place: refused if reaching it would take a copy."""
    t = Tensor(name, x)
    if t.kind == NUMPY and (t.arr is not x or not t.arr.flags.writeable):
        raise ArgumentError(
            f"{name}: must be a writable array the library can address in place (no negative "
            f"strides, native byte order); {why}"
        )
    return t


_KV8_NAMES = ("int8", "float8_e4m3fn", "float8_e5m2")


def _kv8_format(x: Any) -> str:
    """The 8-bit cache format of a numpy array (ml_dtypes' float8 types) or a torch tensor, or
    "" for any other dtype."""
    if isinstance(x, np.ndarray):
        return x.dtype.name if x.dtype.name in _KV8_NAMES else ""
    torch = torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        fmt = str(x.dtype).replace("torch.", "")
        return fmt if fmt in _KV8_NAMES else ""
    return ""


def _kv8_bytes(name: str, x: Any, written: bool = True) -> tuple[str, Any]:
    """An 8-bit cache array as (its format's name, its bytes as an int8 / uint8 view, in place):
    numpy has no float8 of its own and DLPack producers differ on float8."""
    fmt = _kv8_format(x)
    if isinstance(x, np.ndarray):
        if not fmt:
            raise ArgumentTypeError(
                f"{name}: dtype must be int8, float8_e4m3fn or float8_e5m2 (ml_dtypes), got "
                f"{x.dtype.name}"
            )
        if written and not x.flags.writeable:
            raise ArgumentError(
                f"{name}: must be writable: the call writes the quantized rows there"
            )
        return fmt, x if fmt == "int8" else x.view(np.uint8)
    torch = torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        if not fmt:
            raise ArgumentTypeError(
                f"{name}: dtype must be int8, float8_e4m3fn or float8_e5m2, got {x.dtype}"
            )
        if x.device.type != "cpu":
            raise ArgumentError(f"{name}: must be a CPU tensor, got device {x.device}")
        return fmt, x if fmt == "int8" else x.view(torch.uint8)
    raise ArgumentTypeError(
        f"{name}: expected a numpy array or a torch tensor, got {type(x).__name__}"
    )


class _Cache:
    """A KV cache argument: a float one as a normalised Tensor, an 8-bit one as its bytes with
    its format (the scales then dequantize it)."""

    __slots__ = ("fmt", "arr", "shape", "tensor")

    def __init__(self, name: str, x: Any, written: bool):
        self.fmt = _kv8_format(x)
        self.tensor: Tensor | None = None
        if self.fmt:
            self.fmt, self.arr = _kv8_bytes(name, x, written)
        else:
            why = "new k and v are appended into it"
            self.tensor = _writable(name, x, why) if written else Tensor(name, x)
            self.arr = native(self.tensor)
        shape = self.tensor.shape if self.tensor is not None else self.arr.shape
        self.shape = tuple(int(n) for n in shape)
        if len(self.shape) != 4:
            raise ArgumentError(
                f"{name}: must have rank 4 (batch_cache, seqlen_cache, heads_k, head_dim) or, "
                f"with block_table, (num_blocks, page_block_size, heads_k, head_dim); got shape "
                f"{self.shape}"
            )

    def bf16(self) -> bool:
        return self.tensor is not None and is_bf16_numpy(self.tensor.arr)


def _scale(name: str, x: Any, written: bool) -> Any:
    """An 8-bit cache's float32 scale (None: none): per-token scales are written by an append. A
    number or a 0-dim array or tensor (vLLM's layers hold ``torch.tensor(1.0)``) is the (1,)
    per-tensor scale, only read."""
    if x is None:
        return None
    if isinstance(x, (int, float)):
        return np.full((1,), float(x), np.float32)
    if getattr(x, "ndim", None) == 0:
        return native(Tensor(name, x.reshape(1)))
    t = _writable(name, x, "the append writes the new tokens' scales") if written else Tensor(name, x)
    return native(t)


def _int32(name: str, x: Any, batch: int | None = None) -> Any:
    """An int32 table as the caller gave it (numpy or torch; other integer dtypes are refused by
    the library, naming the argument); a Python int becomes a (batch,) array of it."""
    if x is None:
        return None
    if isinstance(x, (int, np.integer)) and batch is not None:
        return np.full((batch,), int(x), np.int32)
    torch = torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ArgumentError(f"{name}: must be a CPU tensor, got device {x.device}")
        return x.detach()
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, (list, tuple)):
        return np.asarray(x, np.int32)
    raise ArgumentTypeError(f"{name}: expected an int32 array or tensor, got {type(x).__name__}")


def flash_attn_with_kvcache(
    q: ArrayLike,
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    k: ArrayLike | None = None,
    v: ArrayLike | None = None,
    rotary_cos: ArrayLike | None = None,
    rotary_sin: ArrayLike | None = None,
    cache_seqlens: int | ArrayLike | None = None,
    cache_batch_idx: ArrayLike | None = None,
    cache_leftpad: ArrayLike | None = None,
    block_table: ArrayLike | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: ArrayLike | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    k_scale: ArrayLike | float | None = None,
    v_scale: ArrayLike | float | None = None,
    num_threads: int | None = None,
) -> ArrayLike | tuple[ArrayLike, ArrayLike]:
    """FlashAttention's ``flash_attn_with_kvcache`` on the CPU.

    Args:
        q: ``(batch, seqlen_q, heads, d)``.
        k_cache, v_cache: ``(batch_cache, seqlen_cache, heads_k, d / dv)``, or with
            ``block_table`` pages ``(num_blocks, page_block_size, heads_k, d / dv)`` with any
            ``page_block_size`` from 1. q's dtype (float32, float16, bfloat16), or an 8-bit
            cache (int8, float8_e4m3fn, float8_e5m2: torch dtypes, or numpy int8 and ml_dtypes'
            float8 types) with ``k_scale`` / ``v_scale``; numpy arrays or torch tensors,
            written in place when ``k`` and ``v`` are given.
        k, v: optional new tokens ``(batch, seqlen_new, heads_k, d / dv)``, appended at
            ``cache_seqlens`` before the attention.
        rotary_cos, rotary_sin: optional ``(seqlen_ro, rotary_dim / 2)`` (q's dtype or float32),
            only with ``k``/``v``: the new key ``t`` turns at ``cache_seqlens + t``, the queries
            at ``cache_seqlens + i`` when causal or windowed, else all at ``cache_seqlens``;
            ``rotary_interleaved`` pairs channels (0, 1), (2, 3)... (GPT-J), else (i, i + rd/2)
            (GPT-NeoX).
        cache_seqlens: an int or ``(batch,)`` int32: tokens already cached per sequence.
            None: every cache is full (and nothing can be appended).
        cache_batch_idx: ``(batch,)`` int32, dense caches: the cache row of each sequence.
        cache_leftpad: ``(batch,)`` int32: each sequence's cache starts at this slot.
        block_table: ``(batch, max_blocks_per_seq)`` int32: the pages of each sequence.
        softmax_scale: defaults to ``1 / sqrt(d)``.
        causal, window_size: FlashAttention's masks, aligned to the bottom-right corner: query
            ``i`` sees keys ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``
            with ``seqlen_k = cache_seqlens + seqlen_new``; causal sets ``right`` to 0.
        softcap: ``> 0``: scores ``S -> softcap * tanh(S / softcap)``, before ALiBi.
        alibi_slopes: ``(heads,)`` or ``(batch, heads)``: ``S -= slope * |i + seqlen_k -
            seqlen_q - j|``.
        num_splits: accepted for compatibility and not used: the split of the cache over threads
            is the kernel's, and results are bitwise the same for any split and thread count.
        return_softmax_lse: also return the log-sum-exp of the final scores.
        k_scale, v_scale: an 8-bit cache's float32 dequantization scale (element ``c`` stands for
            ``c * scale``; vLLM's ``k_scale``): a float or ``(1,)`` per cache, ``(heads_k,)`` per
            KV head (each finite and > 0; the append quantizes with it), or per token, the
            cache's shape without its last axis, read like the cache and written for the
            appended tokens (their largest ``|value|`` over the format's largest, as
            :func:`quantize_kv`). Required with an 8-bit cache, refused with a float one. An
            int8 cache holds no NaN: appending one is refused.
        num_threads: OpenMP threads; None for OpenMP's default.

    Returns:
        ``out`` ``(batch, seqlen_q, heads, dv)`` in q's dtype and kind, or ``(out, lse)`` with
        ``lse`` float32 ``(batch, heads, seqlen_q)``. A row that sees no key outputs 0 and has
        ``lse = -inf`` (FlashAttention 2 stores +inf there).

    Where this differs from FlashAttention: any ``page_block_size`` (it asks for multiples of
    256) and any even ``rotary_dim`` (multiples of 16); ``cache_leftpad`` with a paged cache
    (which it refuses); refused where it leaves the result undefined: a repeated
    ``cache_batch_idx`` entry, or a page written by one sequence and named by another entry,
    while appending. Every argument is checked before the caches are written; a call that
    raises leaves them as they were.

    Raises:
        TypeError, ValueError: bad inputs; the message names the argument.
    """
    qt = Tensor("q", q)
    if qt.ndim != 4:
        raise ArgumentError(
            f"q: must have rank 4 (batch, seqlen_q, heads, head_dim), got shape {qt.shape}"
        )
    batch, seqlen_q, heads, d = qt.shape
    appending = k is not None
    kc, vc = _Cache("k_cache", k_cache, appending), _Cache("v_cache", v_cache, appending)
    bf16 = is_bf16_numpy(qt.arr) or kc.bf16()
    tensors = {}
    for name, x in (("k", k), ("v", v), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if x is not None:
            tensors[name] = native(Tensor(name, x))
    if int(num_splits) < 0:
        raise ArgumentError(f"num_splits: must be >= 0 (0: automatic), got {num_splits}")
    left, right = _fa_args.window(window_size, causal)
    slopes = _fa_args.alibi(alibi_slopes, batch, heads)
    dv = vc.shape[3]
    out = empty(qt, (batch, seqlen_q, heads, dv))
    lse = empty(qt, (batch, heads, seqlen_q), "float32") if return_softmax_lse else None
    _flashcte.flash_attn_with_kvcache(
        q=native(qt),
        k_cache=kc.arr,
        v_cache=vc.arr,
        out=native(out),
        lse=lse,
        bf16_bits=bf16,
        k_cache_format=kc.fmt,
        v_cache_format=vc.fmt,
        k_scale=_scale("k_scale", k_scale, appending),
        v_scale=_scale("v_scale", v_scale, appending),
        cache_seqlens=native(_int32("cache_seqlens", cache_seqlens, batch)),
        cache_batch_idx=native(_int32("cache_batch_idx", cache_batch_idx)),
        cache_leftpad=native(_int32("cache_leftpad", cache_leftpad)),
        block_table=native(_int32("block_table", block_table)),
        alibi_slopes=slopes,
        softmax_scale=None if softmax_scale is None else float(softmax_scale),
        causal=bool(causal),
        window_left=left,
        window_right=right,
        softcap=_fa_args.softcap(softcap),
        rotary_interleaved=bool(rotary_interleaved),
        num_threads=0 if num_threads is None else int(num_threads),
        **tensors,
    )
    if return_softmax_lse:
        return give_back(qt, out), give_back(qt, lse)
    return give_back(qt, out)


def varlen_over_cache(
    q: ArrayLike,
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    cu_seqlens_q: ArrayLike,
    seqused_k: ArrayLike,
    block_table: ArrayLike | None,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: ArrayLike | None,
    sinks: ArrayLike | None,
    return_softmax_lse: bool,
    num_threads: int | None,
    out: ArrayLike | None = None,
    k_scale: ArrayLike | float | None = None,
    v_scale: ArrayLike | float | None = None,
    names: Mapping[str, str] | None = None,
    plan: bool = False,
) -> Any:
    """The mixed batch (flashcte/kvcache.h, flash_attn_varlen_kvcache): varlen queries
    ``(total_q, heads, d)`` over each sequence's cache (pages with ``block_table``), every
    sequence's queries the last ``seqlen_q`` of its ``seqused_k`` keys; one parallel region.
    ``out``, when given, is written in place (and returned). 8-bit caches take ``k_scale`` /
    ``v_scale`` as :func:`flash_attn_with_kvcache` (read only). Errors name the arguments as
    this function does, or as the caller spells them (``names``: {this name: the caller's}).
    With ``plan``, nothing is computed: the checked step comes back as the native
    ``VarlenKvCachePlan`` (flashcte/kvcache.h, plan_varlen_kvcache)."""
    try:
        qt = Tensor("q", q)
        if qt.ndim != 3:
            raise ArgumentError(
                f"q: must have rank 3 (total_q, heads, head_dim), got shape {qt.shape}"
            )
        total_q, heads, _ = qt.shape
        kc, vc = _Cache("k_cache", k_cache, False), _Cache("v_cache", v_cache, False)
        bf16 = is_bf16_numpy(qt.arr) or kc.bf16()
        cu = _int32("cu_seqlens_q", cu_seqlens_q)
        batch = int(cu.shape[0]) - 1 if cu is not None and len(cu.shape) == 1 else 0
        left, right = _fa_args.window(window_size, causal)
        if out is None:
            result = empty(qt, (total_q, heads, vc.shape[3]))
        else:
            result = _writable("output", out, "the call writes its result there")
        lse = empty(qt, (heads, total_q), "float32") if return_softmax_lse else None
        sink_values = None
        if sinks is not None:
            sink_values = native(Tensor("sinks", sinks))
        call = _flashcte.plan_varlen_kvcache if plan else _flashcte.flash_attn_varlen_kvcache
        made = call(
            q=native(qt),
            k_cache=kc.arr,
            v_cache=vc.arr,
            out=native(result),
            lse=native(lse),
            bf16_bits=bf16,
            k_cache_format=kc.fmt,
            v_cache_format=vc.fmt,
            k_scale=_scale("k_scale", k_scale, False),
            v_scale=_scale("v_scale", v_scale, False),
            cu_seqlens_q=native(cu),
            seqused_k=native(_int32("seqused_k", seqused_k)),
            block_table=native(_int32("block_table", block_table)),
            alibi_slopes=_fa_args.alibi(alibi_slopes, batch, heads),
            sinks=sink_values,
            softmax_scale=None if softmax_scale is None else float(softmax_scale),
            causal=bool(causal),
            window_left=left,
            window_right=right,
            softcap=_fa_args.softcap(softcap),
            num_threads=0 if num_threads is None else int(num_threads),
        )
        if plan:
            return made
        o = give_back(qt, result) if out is None else out
        if return_softmax_lse:
            return o, give_back(qt, lse)
        return o
    except (TypeError, ValueError) as e:
        raise in_names(e, names or {}) from None


def quantize_kv(src: ArrayLike, dst: ArrayLike, scale: ArrayLike) -> tuple[ArrayLike, ArrayLike]:
    """K or V rows into an 8-bit cache format, in place (flashcte/kvcache.h, quantize_kv): for
    engines that write their own 8-bit cache.

    Args:
        src: ``(tokens, kv_heads, d)`` float32, float16 or bfloat16.
        dst: ``(tokens, kv_heads, d)`` int8, float8_e4m3fn or float8_e5m2 (numpy with
            ``ml_dtypes``' float8 types, or torch), any strides (rows of a cache or of pages);
            written only when the call succeeds.
        scale: float32 dequantization scale, ``dst * scale`` standing for ``src``: ``(1,)`` per
            tensor or ``(kv_heads,)`` per KV head, read (each finite and > 0); or
            ``(tokens, kv_heads)`` per token, written with the row's largest finite ``|src|``
            over the format's largest value (127, 448, 57344), 1 for a row of zeros.

    Each element becomes ``src / scale`` rounded to nearest (ties to even) and saturated to the
    format's largest value of its sign (infinities too, where the format has none). NaN stays NaN
    in fp8; a NaN in ``src`` is refused for int8. Returns ``(dst, scale)``.
    """
    st = Tensor("src", src)
    fmt, raw = _kv8_bytes("dst", dst)
    sc = _writable("scale", scale, "per-token scales are written there")
    _flashcte.quantize_kv(
        src=native(st), dst=raw, scale=native(sc), format=fmt, bf16_bits=is_bf16_numpy(st.arr)
    )
    return dst, scale
