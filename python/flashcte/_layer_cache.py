"""flashcte.KvCache: the KV cache of one AttentionLayer (dense or paged, in the layer's dtype or
an 8-bit format), and the dtype names the layer and its cache accept.

The cache is the C++ ``flashcte::KvCache`` (include/flashcte/layer.h); this module checks the
arguments and hands out numpy views of its storage.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _flashcte
from ._attention import _int
from ._errors import ArgumentTypeError
from ._tensors import BFLOAT16, dtype_name, torch_module

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
# kv_cache_dtype's 8-bit formats by the names users write (torch's, vLLM's, the issue's).
_KV8_DTYPES = {
    "int8": "int8",
    "float8_e4m3": "float8_e4m3fn",
    "float8_e4m3fn": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "fp8_e5m2": "float8_e5m2",
}


def _activation_dtype(dtype: Any) -> str:
    """'float32' | 'bfloat16' | 'float16' from a name, a numpy dtype or a torch dtype."""
    canonical = _DTYPES.get(_dtype_name(dtype))
    if canonical is None:
        raise ArgumentTypeError(f"dtype: must be float32, bfloat16 or float16, got {dtype!r}")
    return canonical


def _dtype_name(dtype: Any) -> str:
    """The name of a dtype given as a string, a numpy dtype or a torch dtype, lower case."""
    if isinstance(dtype, str):
        return dtype.lower()
    torch = torch_module()
    if torch is not None and isinstance(dtype, torch.dtype):
        return dtype_name(dtype)
    try:
        return np.dtype(dtype).name
    except TypeError:
        return repr(dtype)


def _cache_dtype(dtype: Any, argument: str = "dtype") -> str:
    """A KV cache's dtype: an activation dtype or an 8-bit format (canonical names)."""
    fmt = _KV8_DTYPES.get(_dtype_name(dtype))
    if fmt is not None:
        return fmt
    canonical = _DTYPES.get(_dtype_name(dtype))
    if canonical is None:
        raise ArgumentTypeError(
            f"{argument}: must be float32, bfloat16, float16, int8, float8_e4m3 or float8_e5m2, "
            f"got {dtype!r}"
        )
    return canonical


class KvCache:
    """The KV cache of one layer: K (after q/k norm and RoPE) and V in the layer's dtype,
    zero-initialised, with the number of filled slots of each sequence. In an 8-bit format
    (``kv_cache_dtype``: int8, float8_e4m3fn, float8_e5m2) each slot of each KV head also holds a
    float32 scale for K and one for V (:attr:`key_scales`, :attr:`value_scales`, 1 until
    written): a code ``c`` stands for ``c * scale``.

    Dense: ``(batch, kv_heads, max_len, head_dim)`` each, from :meth:`AttentionLayer.new_cache`.
    Paged: a block pool ``(num_blocks, kv_heads, block_size, head_dim)`` each (vLLM's layout),
    from :meth:`AttentionLayer.new_paged_cache`; :meth:`assign` gives each sequence its pages. Two
    sequences may name the same pages for a common prompt prefix; those pages are read-only (a
    call that would write into a page another sequence names raises ValueError, the pool as it
    was). A layer accepts any cache of its shape (batch of the call, kv_heads, head_dim, dtype)
    and refuses others; one cache belongs to one layer of a model, as in the module. A cache is
    mutated by forward: a second call on the same cache while one runs (from another thread)
    raises RuntimeError.
    """

    __slots__ = ("_native",)

    def __init__(self, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype="float32"):
        self._native = _flashcte.KvCache(
            _int("batch", batch),
            _int("kv_heads", kv_heads),
            _int("max_len", max_len),
            _int("head_dim", head_dim),
            _cache_dtype(dtype),
        )

    @classmethod
    def paged(cls, batch: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
              dtype="float32") -> KvCache:
        """A block pool of ``num_blocks`` pages of ``block_size`` slots (any size from 1) for
        ``batch`` sequences, none of which has a page until :meth:`assign`."""
        cache = cls.__new__(cls)
        cache._native = _flashcte.KvCache(
            batch=_int("batch", batch),
            num_blocks=_int("num_blocks", num_blocks),
            block_size=_int("block_size", block_size),
            kv_heads=_int("kv_heads", kv_heads),
            head_dim=_int("head_dim", head_dim),
            dtype=_cache_dtype(dtype),
        )
        return cache

    @property
    def is_paged(self) -> bool:
        return self._native.paged

    @property
    def num_blocks(self) -> int:
        """Pages in the pool (0 for a dense cache)."""
        return self._native.num_blocks

    @property
    def block_size(self) -> int:
        """Slots per page (0 for a dense cache)."""
        return self._native.block_size

    def pages(self, b: int) -> list[int]:
        """Sequence ``b``'s pages, in slot order (a paged cache)."""
        return list(self._native.pages(_int("b", b)))

    def assign(self, b: int, pages: Any, length: int = 0) -> None:
        """Gives sequence ``b`` of a paged cache the pages ``pages`` (slot ``j`` is row
        ``j % block_size`` of page ``pages[j // block_size]``), with ``length`` slots already
        filled: 0 for a new request, or the length of a prompt prefix whose pages another
        sequence filled (shared, read-only). Raises ValueError naming the argument (a page out
        of range or repeated, a length past the pages, a dense cache); the cache is then as it
        was."""
        self._native.assign(_int("b", b), [int(p) for p in pages], _int("length", length))

    @property
    def batch(self) -> int:
        return self._native.batch

    @property
    def max_len(self) -> int:
        return self._native.max_len

    @property
    def kv_heads(self) -> int:
        return self._native.kv_heads

    @property
    def head_dim(self) -> int:
        return self._native.head_dim

    @property
    def dtype(self) -> str:
        return self._native.dtype

    @property
    def lengths(self) -> np.ndarray:
        """Filled slots per sequence: int64 ``(batch,)`` (a copy)."""
        return np.asarray(self._native.lengths, dtype=np.int64)

    def reset(self, b: int | None = None) -> None:
        """Forgets every token of sequence ``b`` (all sequences when None); its slots are
        reused by the next prompt."""
        if b is None:
            for i in range(self.batch):
                self._native.reset(i)
        else:
            self._native.reset(_int("b", b))

    def _storage(self, values: bool) -> np.ndarray:
        a = self._native.values() if values else self._native.keys()
        if self.dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            if BFLOAT16 is None:  # pragma: no cover - exercised only without ml_dtypes
                return a  # the bits as uint16 / uint8
            import ml_dtypes

            return a.view(getattr(ml_dtypes, self.dtype))
        return a

    @property
    def keys(self) -> np.ndarray:
        """K: a read-only numpy view ``(batch, kv_heads, max_len, head_dim)`` of the storage, or
        ``(num_blocks, kv_heads, block_size, head_dim)`` of a pool (bfloat16 as
        ``ml_dtypes.bfloat16``; its uint16 bits without ml_dtypes)."""
        return self._storage(False)

    @property
    def values(self) -> np.ndarray:
        """V: a read-only numpy view of the storage, shaped as :attr:`keys`."""
        return self._storage(True)

    @property
    def key_scales(self) -> np.ndarray:
        """An 8-bit cache's K scales: a read-only float32 view shaped as :attr:`keys` without
        head_dim. ValueError for a float cache."""
        return self._native.key_scales()

    @property
    def value_scales(self) -> np.ndarray:
        """An 8-bit cache's V scales, shaped as :attr:`key_scales`."""
        return self._native.value_scales()

    def __repr__(self) -> str:
        if self.is_paged:
            return (
                f"KvCache.paged(batch={self.batch}, num_blocks={self.num_blocks}, "
                f"block_size={self.block_size}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}, dtype={self.dtype!r}, lengths={self.lengths.tolist()})"
            )
        return (
            f"KvCache(batch={self.batch}, max_len={self.max_len}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype!r}, lengths={self.lengths.tolist()})"
        )
