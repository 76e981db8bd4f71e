"""Tensor plumbing shared by the public functions: kinds, dtypes, zero-copy views, allocation.

Every tensor argument is normalised to something the native layer imports without copying:

* numpy arrays pass as they are (float32, float16), bfloat16 arrays (``ml_dtypes.bfloat16``) as a
  uint16 view of the same memory with the ``bf16_bits`` flag set; arrays whose strides the
  library cannot express (negative, or not a multiple of the item size) and non-native byte
  orders are the only ones copied;
* torch tensors pass as they are (DLPack, bfloat16 included) after ``detach()``;
* any other DLPack producer is read through ``numpy.from_dlpack`` (zero copy) and its result is
  handed back through the producer's array-API namespace when it has one.

Outputs are allocated in the kind of ``q``: numpy in, numpy out; torch in, torch out.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._errors import ArgumentError, ArgumentTypeError

try:  # bfloat16 for numpy; optional
    import ml_dtypes as _ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - exercised only without ml_dtypes
    BFLOAT16 = None

NUMPY, TORCH, DLPACK = "numpy", "torch", "dlpack"
_FLOAT_NAMES = ("float32", "float16", "bfloat16")


def torch_module():
    """The torch module if the caller has imported it (we never import torch ourselves)."""
    return sys.modules.get("torch")


def in_names(e: TypeError | ValueError, names: Mapping[str, str]) -> TypeError | ValueError:
    """`e` in the caller's names for the arguments: the library's messages ("<argument>: <rule>")
    name the native call's arguments, and an entry point that spells them otherwise
    (paged_attention's ``key_cache`` for ``k_cache``) re-raises with ``{native name: its name}``;
    each name is replaced as a whole word, wherever the message has it. A try/except at the call
    rather than a context manager: nothing is spent on a call that succeeds."""
    if not names:
        return e
    words = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    return type(e)(words.sub(lambda m: names[m.group(1)], str(e)))


def kind_of(name: str, x: Any) -> str:
    if isinstance(x, np.ndarray):
        return NUMPY
    torch = torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        return TORCH
    if hasattr(x, "__dlpack__"):
        return DLPACK
    raise ArgumentTypeError(
        f"{name}: expected a numpy array or a DLPack tensor (torch.Tensor, ...), "
        f"got {type(x).__name__}"
    )


class Tensor:
    """One normalised tensor argument: `arr` is a numpy array or a torch tensor."""

    __slots__ = ("arr", "kind", "name", "source")

    def __init__(self, name: str, x: Any, float_only: bool = True):
        self.name = name
        self.kind = kind_of(name, x)
        self.source = x
        if self.kind == TORCH:
            if x.device.type != "cpu":
                raise ArgumentError(f"{name}: must be a CPU tensor, got device {x.device}")
            if float_only and str(x.dtype).replace("torch.", "") not in _FLOAT_NAMES:
                raise ArgumentTypeError(
                    f"{name}: dtype must be float32, float16 or bfloat16, got "
                    f"{str(x.dtype).replace('torch.', '')}"
                )
            self.arr = x.detach()
            return
        if self.kind == DLPACK:
            try:
                x = np.from_dlpack(x)
            except (TypeError, BufferError, RuntimeError, ValueError) as e:
                raise ArgumentTypeError(
                    f"{name}: cannot read this DLPack tensor through numpy ({e}); pass a numpy "
                    "array or a torch tensor (bfloat16 DLPack tensors are read only from torch)"
                ) from None
        if float_only and dtype_name(x.dtype) not in _FLOAT_NAMES:
            raise ArgumentTypeError(
                f"{name}: dtype must be float32, float16 or bfloat16, got {dtype_name(x.dtype)}"
            )
        self.arr = viewable(x)

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.arr.dtype)

    @property
    def shape(self) -> tuple:
        return tuple(self.arr.shape)

    @property
    def ndim(self) -> int:
        return len(self.arr.shape)


def dtype_name(dtype: Any) -> str:
    """'float32', 'bfloat16', ... for numpy and torch dtypes alike."""
    return str(dtype).replace("torch.", "")


def viewable(a: np.ndarray) -> np.ndarray:
    """`a` itself when the library can read it in place, else a C-contiguous copy."""
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    size = a.dtype.itemsize
    if any(s < 0 or s % size for s in a.strides):
        a = np.ascontiguousarray(a)
    return a


def native(t: Any) -> Any:
    """What the native layer receives for a normalised array, for one call: bfloat16 numpy as
    uint16 bits; a torch tensor as its DLPack capsule, which the call consumes (so a result is
    passed once). The capsule comes from torch's C function: otherwise nanobind calls
    ``Tensor.__dlpack__``, Python code that took 3.0 us a tensor against 0.3 (AMD EPYC Zen 4),
    ~13 us of a decode call through the torch op."""
    if t is None:
        return None
    a = t.arr if isinstance(t, Tensor) else t
    if isinstance(a, np.ndarray):
        return a.view(np.uint16) if BFLOAT16 is not None and a.dtype == BFLOAT16 else a
    torch = torch_module()
    if torch is not None and isinstance(a, torch.Tensor):
        return torch.utils.dlpack.to_dlpack(a)
    return a


def is_bf16_numpy(a: Any) -> bool:
    return isinstance(a, np.ndarray) and BFLOAT16 is not None and a.dtype == BFLOAT16


def empty(like: Tensor, shape: Sequence[int], dtype: str | None = None) -> Any:
    """An uninitialised output of `like`'s kind (numpy for DLPack producers), `like`'s dtype
    unless `dtype` is given ('float32')."""
    shape = tuple(int(s) for s in shape)
    if like.kind == TORCH:
        torch = torch_module()
        dt = like.arr.dtype if dtype is None else getattr(torch, dtype)
        return torch.empty(shape, dtype=dt)
    dt = like.arr.dtype if dtype is None else np.dtype(dtype)
    return np.empty(shape, dtype=dt)


def zeros(like: Tensor, shape: Sequence[int], dtype: str | None = None) -> Any:
    out = empty(like, shape, dtype)
    out[...] = 0
    return out


def transpose(a: Any, i: int, j: int) -> Any:
    """A view of `a` with axes i and j swapped (numpy or torch)."""
    if isinstance(a, np.ndarray):
        return a.swapaxes(i, j)
    return a.transpose(i, j)


def give_back(like: Tensor, result: Any) -> Any:
    """Hands an output to the caller in the kind of `like`: unchanged for numpy and torch; for
    other DLPack producers through their array-API namespace's from_dlpack when possible."""
    if like.kind != DLPACK:
        return result
    namespace = getattr(like.source, "__array_namespace__", None)
    if namespace is None:
        return result
    try:
        return namespace().from_dlpack(result)
    except Exception:  # noqa: BLE001 - any failure falls back to numpy, as documented
        return result


def int_list(name: str, x: Any) -> list:
    """An int or a sequence/array of ints as a list of Python ints."""
    if x is None:
        return []
    torch = torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return [int(x)]
    a = np.asarray(x)
    if a.ndim > 1 or not (np.issubdtype(a.dtype, np.integer) or a.size == 0):
        raise ArgumentTypeError(f"{name}: must be an int or a sequence of ints, got {x!r}")
    return [int(v) for v in a.reshape(-1)]


def index_array(name: str, x: Any) -> Any:
    """Packing bounds: int32/int64/float32 numpy arrays and torch tensors pass as they are
    (the library reads them); other integer arrays and sequences become int64; float64 values
    become int64 when they are integral."""
    torch = torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ArgumentError(f"{name}: must be a CPU tensor, got device {x.device}")
        if x.dtype in (torch.int32, torch.int64, torch.float32):
            return x.detach()
        x = x.detach().cpu().numpy()
    if not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__"):
        x = np.from_dlpack(x)
    a = np.asarray(x)
    if a.dtype in (np.int32, np.int64, np.float32):
        return viewable(a)
    if np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.bool_):
        return a.astype(np.int64)
    if np.issubdtype(a.dtype, np.floating):
        bad = ~np.isfinite(a) | (a != np.floor(a))
        if np.any(bad):
            row = int(np.flatnonzero(bad.reshape(-1))[0])
            raise ArgumentError(
                f"{name}: row {row} holds {a.reshape(-1)[row]}, which is not an integral index"
            )
        return a.astype(np.int64)
    raise ArgumentTypeError(f"{name}: dtype must be int32, int64 or float32, got {a.dtype}")


def float32_array(name: str, x: Any) -> Any:
    """A float32 side input (sink logits, ALiBi slopes, key bias) of any shape: float32 numpy
    arrays and torch tensors pass as they are, other real dtypes (float16, bfloat16, float64,
    integers) and sequences are converted to float32."""
    torch = torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ArgumentError(f"{name}: must be a CPU tensor, got device {x.device}")
        if not x.dtype.is_floating_point:
            raise ArgumentTypeError(
                f"{name}: dtype must be a float type, got {dtype_name(x.dtype)}"
            )
        return x.detach().to(torch.float32)
    if not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__"):
        x = np.from_dlpack(x)
    a = np.asarray(x)
    numeric = np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)
    if not (numeric or (BFLOAT16 is not None and a.dtype == BFLOAT16)):
        raise ArgumentTypeError(f"{name}: dtype must be a float type, got {a.dtype}")
    return viewable(a.astype(np.float32, copy=False))
