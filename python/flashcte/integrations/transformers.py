"""Hugging Face transformers: flashcte as the attention implementation ``"attention_cte"``.

    import flashcte.integrations.transformers as fct
    fct.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attention_cte")
    model.set_attn_implementation("attention_cte")   # or switch a loaded model

(transformers refuses registered names containing "flash", hence the kernel's own name.)
``enable_continuous_batching()`` (``_continuous_batching.py``) also lets transformers' continuous
batching (``model.generate_batch``) run ``attention_cte`` over its pages, read in place.

``register()`` adds :func:`attention_cte_forward` to transformers' ``AttentionInterface`` and, where
transformers has one (``masking_utils.AttentionMaskInterface``, 4.53 and later), gives the name the
``sdpa`` mask builder: the model then builds exactly the masks it builds for ``sdpa`` -- none for
an unpadded causal prefill or decode step, a boolean ``(batch, 1, q_len, kv_len)`` mask otherwise
(padding, sliding windows, static caches, packed sequences). Older versions build their eager
float masks for custom names; those work too.

What the attention function does with what transformers passes (the decisions of transformers'
``sdpa_attention_forward``, which it replaces):

* no mask: causal (top-left, as sdpa's ``is_causal``) when the layer is causal and
  ``q_len > 1``; a decode step (``q_len == 1``) or an encoder sees every key;
* a mask: it is the whole truth (``is_causal`` and ``sliding_window`` are already in it), and
  it runs on the kernel when it decomposes exactly into per-row key intervals intersected with a
  per-key mask (see :func:`flashcte.torch.decompose_mask`; causal and sliding-window masks with
  left or right padding, decode against a cache -- bottom-right by construction --, static
  caches, packed sequences) or, for an additive mask, when it is the same for every query
  (``key_bias``). The decomposition is computed once per mask tensor and reused by every layer;
* ``scaling``, ``softcap`` (Gemma 2), ``s_aux`` (gpt-oss's per-head sinks) and GQA go to the
  kernel as they are; q, k and v are read in place.

Anything else falls back, with a one-time ``FlashcteFallbackWarning`` naming the reason, to
transformers' ``sdpa_attention_forward``, or to the model's own ``eager_attention_forward`` when
the call needs soft-capping, sinks or attention weights (which sdpa cannot do): autograd
(an input requires grad with grad mode on: there is no backward), dropout, ``position_bias``,
``head_mask``, ``output_attentions``, non-CPU tensors or other dtypes, masks that differ between
heads or that have no exact decomposition, and masks under ``torch.compile`` (the decomposition
reads the mask's values; the unmasked path compiles, through ``torch.ops.flashcte.flash_attn``).
Query rows that see no key (left padding's pad positions) output 0, as sdpa's boolean masks do.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any, Optional

import torch

from .._flashcte import MAX_HEAD_DIM
from .._torch_masks import MaskPlan, decompose_mask, equal_along, mask_allowed
from .._torch_checks import FLOATS
from . import _continuous_batching
from ._continuous_batching import enable_continuous_batching
from ..torch import flash_attn

__all__ = [
    "NAME",
    "FlashcteFallbackWarning",
    "attention_cte_forward",
    "enable_continuous_batching",
    "register",
]

NAME = "attention_cte"


class FlashcteFallbackWarning(UserWarning):
    """A call that flashcte cannot run exactly went to transformers' sdpa or eager attention."""


_warned: set = set()


def _warn_once(reason: str) -> None:
    if reason in _warned or torch.compiler.is_compiling():
        return
    _warned.add(reason)
    warnings.warn(
        f"flashcte attention_cte: {reason}; this call and others like it run on transformers' "
        "own attention instead (warned once)",
        FlashcteFallbackWarning,
        stacklevel=4,
    )


def register(name: str = NAME) -> str:
    """Registers :func:`attention_cte_forward` under ``name`` with transformers' attention
    interface (and the sdpa mask builder under the same name, where transformers has a mask
    interface). Idempotent; returns the name to pass as ``attn_implementation``."""
    try:
        from transformers import AttentionInterface
    except ImportError:  # pragma: no cover - transformers < 4.52: a plain dict
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        ALL_ATTENTION_FUNCTIONS[name] = attention_cte_forward
    else:
        AttentionInterface.register(name, attention_cte_forward)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # pragma: no cover - transformers < 4.53: models build eager masks
        pass
    else:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name


# ---- masks ------------------------------------------------------------------------------------


_plans: dict = {}


def _analyse(mask: torch.Tensor, kv_len: int) -> Optional[MaskPlan]:
    """A (b, 1|h, rows, kv_len) mask as kernel arguments at the mask's own batch (1 or batch) and
    row count (1 or q_len): key_bias (b, kv_len) float32, bound_min/bound_max (b, rows) int64,
    each possibly None; or None when the mask has no exact kernel form."""
    m = mask[..., :kv_len]
    if not equal_along(m, 1):  # masks that differ between heads
        return None
    m = m[:, 0]  # (b, rows, kv_len)
    if m.dtype != torch.bool and equal_along(m, 1):
        return MaskPlan(None, None, m[:, 0].to(torch.float32))  # additive, every query
    allowed = mask_allowed(m)  # eager-style masks: 0 attends, the dtype's minimum masks
    return None if allowed is None else decompose_mask(allowed)


def _plan_for(mask: torch.Tensor, kv_len: int) -> Optional[MaskPlan]:
    """_analyse, cached per mask tensor (the model hands every layer the same one): the entry is
    used only for the same live object at the same version (no in-place change since). Tensors
    made under torch.inference_mode() have no version, so their masks are analysed at every
    call (a few passes over the mask, ~1-3 ms for 2048 x 2048)."""
    try:
        version = mask._version
    except RuntimeError:  # an inference-mode tensor has no version counter: no cache
        return _analyse(mask, kv_len)
    key = (version, tuple(mask.shape), mask.dtype, kv_len)
    ident = id(mask)
    hit = _plans.get(ident)
    if hit is not None and hit[0]() is mask and hit[1] == key:
        return hit[2]
    plan = _analyse(mask, kv_len)
    if len(_plans) > 32:
        _plans.clear()
    _plans[ident] = (weakref.ref(mask, lambda _, i=ident: _plans.pop(i, None)), key, plan)
    return plan


# ---- the attention function -------------------------------------------------------------------


def _unsupported(module, query, key, value, attention_mask, dropout, kwargs) -> Optional[str]:
    tensors = [query, key, value]
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        tensors.append(sinks)
    if any(t.device.type != "cpu" for t in tensors):
        return f"tensors on {query.device} (flashcte runs on the CPU)"
    if query.dtype not in FLOATS or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtype {query.dtype} (flashcte takes float32, float16, bfloat16)"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "an input requires grad and grad mode is on (flashcte has no backward)"
    if dropout:
        return "attention dropout (training mode)"
    if kwargs.get("position_bias") is not None:
        return "a position_bias (per query and key)"
    if kwargs.get("head_mask") is not None:
        return "a head_mask"
    if kwargs.get("output_attentions"):
        return "output_attentions=True (flashcte returns no attention weights)"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "query, key and value of rank other than 4"
    if query.shape[-1] > MAX_HEAD_DIM or query.shape[-1] != key.shape[-1]:
        return f"head_dim {query.shape[-1]} (at most {MAX_HEAD_DIM}, equal for query and key)"
    if key.shape[1] == 0 or query.shape[1] % key.shape[1] or key.shape[0] != query.shape[0]:
        return "query and key heads or batches that GQA cannot pair"
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        return f"s_aux of shape {tuple(sinks.shape)} (expected one sink per head)"
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
            return "an attention mask that is not a 4-D tensor"
        if attention_mask.device.type != "cpu":
            return f"an attention mask on {attention_mask.device}"
        b, _, rows, cols = attention_mask.shape
        if b not in (1, query.shape[0]) or rows not in (1, query.shape[2]) or cols < key.shape[2]:
            return (
                f"an attention mask of shape {tuple(attention_mask.shape)} for query "
                f"{tuple(query.shape)} and key {tuple(key.shape)}"
            )
        if torch.compiler.is_compiling():
            return "a mask under torch.compile"
    return None


def _fallback(
    reason, module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs
):
    _warn_once(reason)
    if kwargs.get("softcap") or kwargs.get("s_aux") is not None or kwargs.get("output_attentions"):
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise NotImplementedError(
                f"flashcte attention_cte: {reason}, and {type(module).__name__}'s module has no "
                "eager_attention_forward to fall back to for soft-capping, sinks or attention "
                "weights"
            )
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            # eager adds the mask: a boolean (sdpa-style) one becomes 0 / the dtype's minimum
            attention_mask = torch.where(
                attention_mask,
                torch.zeros((), dtype=query.dtype, device=query.device),
                torch.finfo(query.dtype).min,
            )
        return eager(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )


def attention_cte_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query ``(batch, heads, q_len, d)``, key and
    value ``(batch, kv_heads, kv_len, d)``, the mask the model built (see the module docstring);
    returns ``(out (batch, q_len, heads, dv) contiguous, None)``."""
    reason = _unsupported(module, query, key, value, attention_mask, dropout, kwargs)
    if _continuous_batching.is_step(kwargs):
        if reason is not None:  # key and value hold only the step's new tokens: no fallback
            raise NotImplementedError(f"flashcte attention_cte in continuous batching: {reason}")
        return _continuous_batching.step_forward(module, query, key, value, scaling, kwargs)
    plan = None
    if reason is None and attention_mask is not None:
        plan = _plan_for(attention_mask, key.shape[2])
        if plan is None:
            reason = "an attention mask that is not per-row key intervals and per-key padding"
    if reason is not None:
        return _fallback(
            reason, module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs
        )

    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    causal = False
    key_bias = bound_min = bound_max = None
    if plan is None:  # sdpa's decision: is_causal only without a mask and for q_len > 1
        causal_layer = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(q_len > 1 and causal_layer)
    else:
        if plan.key_bias is not None:
            key_bias = plan.key_bias.expand(batch, kv_len)
        if plan.bound_min is not None:
            bound_min = plan.bound_min.expand(batch, q_len)
            bound_max = plan.bound_max.expand(batch, q_len)
    softcap = kwargs.get("softcap") or 0.0
    out, _ = flash_attn(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        softmax_scale=None if scaling is None else float(scaling),
        causal=causal,
        bottom_right=False,
        softcap=float(softcap),
        key_bias=key_bias,
        sinks=kwargs.get("s_aux"),
        bound_min=bound_min,
        bound_max=bound_max,
    )
    return out, None

