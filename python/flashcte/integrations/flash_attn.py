"""FlashAttention's private forward functions on flashcte, and a ``flash_attn`` module made of them.

Ring and context-parallel implementations written for FlashAttention on GPUs
(ring-flash-attention's ``ring_flash_attn_func`` and its zigzag, stripe and varlen variants;
others that import the same names) call FlashAttention's *private* per-block forward,
``flash_attn.flash_attn_interface._flash_attn_forward``, because it returns the block's
log-sum-exp, which merging blocks needs. This module provides those functions with FlashAttention
2.6+'s signatures and return values, computed by flashcte on the CPU:

    _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1,
                        window_size_right=-1, softcap=0.0, alibi_slopes=None,
                        return_softmax=False) -> (out, softmax_lse, None, None)
    _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p, softmax_scale, causal, window_size_left=-1,
                               window_size_right=-1, softcap=0.0, alibi_slopes=None,
                               return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False)
        -> (out, softmax_lse, None, None)

``out`` is ``(batch, seqlen_q, heads, dv)`` in q's dtype (varlen: ``(total_q, heads, dv)``),
``softmax_lse`` float32 ``(batch, heads, seqlen_q)`` (varlen: ``(heads, total_q)``, as
FlashAttention 2.6+), the last two (``S_dmask``, ``rng_state``) None: no dropout, no attention
probabilities. Callers that inspect the signature to choose between ``window_size`` (older
FlashAttention) and ``window_size_left`` / ``window_size_right`` find the latter, and callers
that accept both the 4-tuple and older versions' 8-tuple take the 4-tuple.

:func:`install` puts a ``flash_attn`` package into ``sys.modules`` (``flash_attn`` with
``flash_attn_func``, ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``, and
``flash_attn.flash_attn_interface`` with those and the private functions), so
``import flash_attn`` and
``from flash_attn.flash_attn_interface import _flash_attn_forward`` resolve to flashcte:

    import flashcte.integrations.flash_attn as fa
    with fa.install():
        from ring_flash_attn import ring_flash_attn_func   # unchanged, now on flashcte
    out = ring_flash_attn_func(q, k, v, causal=True, group=group)

Forward only: the backward functions raise NotImplementedError, as do dropout, returned attention
probabilities and the left-padded varlen argument (``leftpad_k``); the paged one (``block_table``
with ``seqused_k`` or ``cu_seqlens_k``) runs the mixed batch of ``flash_attn_varlen_func``.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

from .._flash_attn import flash_attn_func, flash_attn_varlen_func
from .._kvcache import flash_attn_with_kvcache

ArrayLike = Any

#: The FlashAttention version whose private signatures this module has (reported as
#: ``flash_attn.__version__`` with a ``+flashcte`` local label).
FLASH_ATTN_VERSION = "2.6.3"


def _window(left: Any, right: Any) -> tuple[int, int]:
    return (-1 if left is None else int(left), -1 if right is None else int(right))


def _check_forward_only(dropout_p: Any, return_softmax: Any) -> None:
    if dropout_p not in (None, 0, 0.0):
        raise NotImplementedError(
            f"dropout_p: flashcte computes inference attention without dropout, got {dropout_p}"
        )
    if return_softmax:
        raise NotImplementedError(
            "return_softmax: flashcte does not materialize the attention probabilities (S_dmask)"
        )


def _flash_attn_forward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    return_softmax: bool = False,
) -> tuple[ArrayLike, ArrayLike, None, None]:
    """FlashAttention 2.6+'s ``_flash_attn_forward`` on flashcte: q ``(batch, seqlen_q, heads,
    d)``, k/v ``(batch, seqlen_k, heads_k, d)``; returns ``(out, softmax_lse, None, None)`` with
    ``softmax_lse`` float32 ``(batch, heads, seqlen_q)``. ``softmax_scale`` None: 1/sqrt(d)."""
    _check_forward_only(dropout_p, return_softmax)
    out, lse = flash_attn_func(
        q,
        k,
        v,
        softmax_scale=softmax_scale,
        causal=bool(causal),
        window_size=_window(window_size_left, window_size_right),
        softcap=0.0 if softcap is None else softcap,
        alibi_slopes=alibi_slopes,
        return_softmax_lse=True,
    )
    return out, lse, None, None


def _flash_attn_varlen_forward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    return_softmax: bool = False,
    block_table: Any = None,
    leftpad_k: Any = None,
    seqused_k: Any = None,
    zero_tensors: bool = False,
) -> tuple[ArrayLike, ArrayLike, None, None]:
    """FlashAttention 2.6+'s ``_flash_attn_varlen_forward`` on flashcte: packed sequences
    ``(total, heads, d)`` with ``cu_seqlens``; returns ``(out, softmax_lse, None, None)`` with
    ``softmax_lse`` float32 ``(heads, total_q)``."""
    _check_forward_only(dropout_p, return_softmax)
    if leftpad_k is not None:
        raise NotImplementedError("leftpad_k: left-padded varlen KV is not supported")
    out, lse = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        int(max_seqlen_q),
        int(max_seqlen_k),
        softmax_scale=softmax_scale,
        causal=bool(causal),
        window_size=_window(window_size_left, window_size_right),
        softcap=0.0 if softcap is None else softcap,
        alibi_slopes=alibi_slopes,
        return_softmax_lse=True,
        block_table=block_table,
        seqused_k=seqused_k,
    )
    return out, lse, None, None


def _no_backward(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(
        "flashcte's flash_attn is forward only (inference): no backward pass; run the forward "
        "under torch.no_grad() or torch.inference_mode()"
    )


_flash_attn_backward = _no_backward
_flash_attn_varlen_backward = _no_backward

_INTERFACE = {
    "flash_attn_func": flash_attn_func,
    "flash_attn_varlen_func": flash_attn_varlen_func,
    "flash_attn_with_kvcache": flash_attn_with_kvcache,
    "_flash_attn_forward": _flash_attn_forward,
    "_flash_attn_varlen_forward": _flash_attn_varlen_forward,
    "_flash_attn_backward": _flash_attn_backward,
    "_flash_attn_varlen_backward": _flash_attn_varlen_backward,
}
_NAMES = ("flash_attn", "flash_attn.flash_attn_interface")


def modules() -> dict[str, types.ModuleType]:
    """New ``flash_attn`` and ``flash_attn.flash_attn_interface`` modules on flashcte."""
    interface = types.ModuleType(
        "flash_attn.flash_attn_interface", "FlashAttention's interface on flashcte (CPU)."
    )
    package = types.ModuleType("flash_attn", "FlashAttention's interface on flashcte (CPU).")
    for m in (interface, package):
        m.__dict__.update(_INTERFACE)
        m.__flashcte__ = True
    package.__path__ = []  # a package: submodules resolve through sys.modules
    package.__version__ = FLASH_ATTN_VERSION + "+flashcte"
    package.flash_attn_interface = interface
    return {"flash_attn": package, "flash_attn.flash_attn_interface": interface}


def _is_ours(module: Any) -> bool:
    return getattr(module, "__flashcte__", False) is True


class _Installed(contextlib.AbstractContextManager):
    """What :func:`install` returns: used as a context manager, it restores the previous
    ``sys.modules`` entries on exit; otherwise the modules stay installed."""

    def __init__(self, previous: dict[str, Any]):
        self._previous = previous

    def uninstall(self) -> None:
        for name in _NAMES:
            old = self._previous.get(name)
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def install(replace: bool = False) -> _Installed:
    """Puts flashcte's ``flash_attn`` and ``flash_attn.flash_attn_interface`` into
    ``sys.modules``. A real FlashAttention already imported is kept (RuntimeError) unless
    ``replace=True``; an installed shim is replaced by a fresh one. Returns an object that, as
    a context manager (``with install(): ...``), restores the previous entries on exit; modules
    that imported names from the shim meanwhile keep them."""
    previous = {name: sys.modules.get(name) for name in _NAMES}
    real = [n for n, m in previous.items() if m is not None and not _is_ours(m)]
    if real and not replace:
        raise RuntimeError(
            f"replace: {real[0]} is already imported (the real FlashAttention?); pass "
            "replace=True to shadow it with flashcte's"
        )
    sys.modules.update(modules())
    return _Installed(previous)


__all__ = [
    "FLASH_ATTN_VERSION",
    "_flash_attn_backward",
    "_flash_attn_forward",
    "_flash_attn_varlen_backward",
    "_flash_attn_varlen_forward",
    "install",
    "modules",
]
