"""flashcte.attention_cte: the Neuron kernel's signature on numpy arrays and DLPack tensors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import _flashcte
from ._errors import ArgumentError, ArgumentTypeError
from ._tensors import Tensor, empty, float32_array, give_back, index_array, int_list, native

ArrayLike = Any  # numpy.ndarray, torch.Tensor or another DLPack tensor


def _rank3(t: Tensor, layout: str) -> None:
    if t.ndim != 3:
        raise ArgumentError(
            f"{t.name}: must have rank 3 {layout}, got rank {t.ndim} (shape {t.shape})"
        )


def stats_shape(bs: int, seqlen_q: int) -> tuple[int, ...]:
    """The cache_softmax statistics' shape: the Neuron layout (bs, 128, Sq/128) when Sq is a
    multiple of 128, else row-major (bs, Sq)."""
    if seqlen_q % 128 == 0:
        return (bs, 128, seqlen_q // 128)
    return (bs, seqlen_q)


def attention_cte(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    scale: float = 1.0,
    causal_mask: bool = True,
    k_prior: ArrayLike | None = None,
    v_prior: ArrayLike | None = None,
    prior_used_len: None | int | Sequence[int] | ArrayLike = None,
    sink: ArrayLike | None = None,
    sliding_window: int = 0,
    tp_q: bool = True,
    tp_k: bool = False,
    tp_out: bool = False,
    cache_softmax: bool = False,
    cp_offset: int | None = None,
    global_cp_deg: int | None = None,
    cp_strided_q_slicing: bool = False,
    bound_min: ArrayLike | None = None,
    bound_max: ArrayLike | None = None,
    num_threads: int | None = None,
    *,
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    key_bias: ArrayLike | None = None,
    window_left: int = -1,
    window_right: int = -1,
    bottom_right: bool = False,
) -> ArrayLike | tuple[ArrayLike, ArrayLike, ArrayLike]:
    """Prefill flash attention with the Neuron ``attention_cte`` kernel's arguments.

    Batch and heads are folded into one batch axis ``bs`` (``bs_kv`` for keys/values).

    Args:
        q: ``(bs, Sq, d)`` when ``tp_q`` (the default), else ``(bs, d, Sq)``.
        k: ``(bs_kv, d, Skv)`` by default, ``(bs_kv, Skv, d)`` when ``tp_k``.
        v: ``(bs_kv, Skv, dv)``.
            q, k, v (and priors) share one dtype: float32, float16 or bfloat16 (numpy bfloat16
            through ``ml_dtypes``). numpy arrays and DLPack tensors (torch included) are read in
            place whatever their strides (only negative strides force a copy).
            GQA: ``bs % bs_kv == 0``; query batch ``b`` reads KV batch ``b // (bs // bs_kv)``.
        scale: multiplies ``q @ k^T`` (any value, in every mode).
        causal_mask: mask keys whose position is after the query's.
        k_prior, v_prior: prefix cache laid out like ``k`` and ``v``, ``S_prior`` long; the keys
            are ``concat(k_prior[:, :prior_used_len], k)`` and prior positions are negative.
        prior_used_len: valid prior length: an int for the whole batch, or ``bs_kv`` ints (one
            per KV batch). Default: all of ``S_prior``.
        sink: ``(bs, 1)`` or ``(bs,)``: one extra logit per query batch, not scaled, entering the
            max and the denominator with no value vector. Converted to float32.
        sliding_window: 0 for none, else keep the ``sliding_window`` most recent positions
            (the query's own included).
        tp_q, tp_k, tp_out: layouts as above; the output is ``(bs, Sq, dv)``, or ``(bs, dv, Sq)``
            with ``tp_out``.
        cache_softmax: also return ``neg_max`` and ``sum_recip`` (float32).
        cp_offset: context parallelism: global position of local query row 0.
        global_cp_deg, cp_strided_q_slicing: with strided slicing local row ``i`` is global row
            ``cp_offset + i * global_cp_deg``.
        bound_min, bound_max: sequence packing, ``(Sq,)`` or ``(Sq, 1)``: query row ``i`` sees
            only the concatenated-KV indices ``[bound_min[i], bound_max[i])``. int32, int64 or
            integral float32 (other integer types and sequences are converted to int64).
        num_threads: OpenMP threads; None for OpenMP's default. Results are bitwise identical
            for every thread count.

    Extensions beyond the Neuron kernel (keyword-only; FlashAttention-family score modifiers and
    masks, combinable with every mode above). Scores are built in this order:
    ``S = scale * q.k -> softcap -> + alibi -> + key_bias -> masks``.

        softcap: ``> 0``: ``S -> softcap * tanh(S / softcap)`` (Gemma 2, Grok); 0 disables it.
        alibi_slopes: ``(bs,)`` or ``(bs, 1)``, one slope per query batch (batch*head):
            ``S += -slope * |q_pos - kv_pos|`` with the positions of SEMANTICS.md step 2
            (shifted by ``bottom_right``). Converted to float32.
        key_bias: ``(bs, L)`` additive bias per key over the concatenated KV axis, ``L`` the
            longest ``prior_used_len`` plus ``Skv``; query batch ``b`` reads its first
            ``prior_used_len(b) + Skv`` entries. ``-inf`` masks a key. Converted to float32.
        window_left, window_right: FlashAttention's ``window_size``: key ``j`` is kept for
            query ``i`` only when ``-window_left <= kv_pos - q_pos <= window_right``; -1 is
            unbounded. Intersected with ``causal_mask`` (right 0) and ``sliding_window``
            (left ``sliding_window - 1``).
        bottom_right: FlashAttention's causal alignment when ``Sq != Skv``: every query position
            moves by ``Skv - Sq`` (added to the context-parallel positions), so the last query
            row sits at the last key; under causal the first ``Sq - Skv`` rows see nothing when
            ``Sq > Skv``.

    Returns:
        ``out`` in q's dtype and kind (numpy in, numpy out; torch in, torch out; other DLPack
        producers get their own kind back through their array-API namespace when they have one,
        else numpy). With ``cache_softmax``: ``(out, neg_max, sum_recip)``, where
        ``neg_max = -max_j S[i, j]`` and ``sum_recip = 1 / sum_j exp(S[i, j] - max)`` (the sink
        included in both), laid out as the Neuron kernel does, ``(bs, 128, Sq // 128)`` with
        element ``[b, p, g]`` belonging to query row ``g * 128 + p``, when ``Sq % 128 == 0``,
        and row-major ``(bs, Sq)`` otherwise. ``lse = -(neg_max + log(sum_recip))``.

        A query row with no unmasked key and no sink has output 0, ``neg_max = +inf`` and
        ``sum_recip = +inf``.

    Raises:
        TypeError: a dtype the library does not take, or dtypes that differ.
        ValueError: any other broken rule; the message reads ``"<argument>: <rule>"``.

    The GIL is released while the kernel runs.
    """
    options = dict(locals())  # the parameters, before any other local: OPTIONS picks the options
    qt = Tensor("q", q)
    kt = Tensor("k", k)
    vt = Tensor("v", v)
    _rank3(qt, "(bs, Sq, d) with tp_q" if tp_q else "(bs, d, Sq)")
    _rank3(vt, "(bs_kv, Skv, dv)")
    bs = qt.shape[0]
    seqlen_q = qt.shape[1] if tp_q else qt.shape[2]
    dv = vt.shape[2]
    out = empty(qt, (bs, dv, seqlen_q) if tp_out else (bs, seqlen_q, dv))
    neg_max = sum_recip = None
    if cache_softmax:
        neg_max = empty(qt, stats_shape(bs, seqlen_q), "float32")
        sum_recip = empty(qt, stats_shape(bs, seqlen_q), "float32")
    _call(
        qt,
        kt,
        vt,
        out,
        neg_max=neg_max,
        sum_recip=sum_recip,
        k_prior=k_prior,
        v_prior=v_prior,
        **{name: options[name] for name in OPTIONS if name in options},
    )
    if cache_softmax:
        return give_back(qt, out), give_back(qt, neg_max), give_back(qt, sum_recip)
    return give_back(qt, out)


def _call(
    qt: Tensor,
    kt: Tensor,
    vt: Tensor,
    out: Any,
    *,
    neg_max: Any = None,
    sum_recip: Any = None,
    lse: Any = None,
    k_prior: Any = None,
    v_prior: Any = None,
    **options: Any,
) -> None:
    """One native call with already normalised q/k/v, caller-allocated outputs and the options
    by their names in :data:`OPTIONS` (an option not given keeps ``flashcte::Options``'
    default)."""
    unknown = sorted(options.keys() - OPTIONS.keys())
    if unknown:
        raise ArgumentTypeError(f"attention_cte: unknown options {unknown}")
    kp = Tensor("k_prior", k_prior) if k_prior is not None else None
    vp = Tensor("v_prior", v_prior) if v_prior is not None else None
    tensors = [qt, kt, vt, kp, vp]
    bf16_bits = any(
        t is not None and t.kind != "torch" and t.dtype_name == "bfloat16" for t in tensors
    )
    _flashcte.attention_cte(
        q=native(qt),
        k=native(kt),
        v=native(vt),
        out=native(out),
        neg_max=neg_max,
        sum_recip=sum_recip,
        lse=lse,
        k_prior=native(kp),
        v_prior=native(vp),
        bf16_bits=bf16_bits,
        **{name: OPTIONS[name](name, value) for name, value in options.items()},
    )


def _int(name: str, x: Any, bits: int = 64) -> int:
    try:
        if isinstance(x, bool) or int(x) != x:
            raise TypeError
        value = int(x)
    except (TypeError, ValueError, OverflowError):
        raise ArgumentTypeError(f"{name}: must be an int, got {x!r}") from None
    if not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
        raise ArgumentError(f"{name}: {value} does not fit in a {bits}-bit integer")
    return value


def _float(name: str, x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"{name}: must be a float, got {x!r}") from None


def _optional(convert: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda name, x: None if x is None else convert(name, x)


def _bool(name: str, x: Any) -> bool:
    return bool(x)


# attention_cte's options by their library names (flashcte::Options), each with the conversion of
# a Python value into what the binding takes: the one place an option is named here besides
# attention_cte's signature. None keeps the library's default where the library has no None.
OPTIONS: dict[str, Callable[[str, Any], Any]] = {
    "scale": _float,
    "causal_mask": _bool,
    "prior_used_len": int_list,
    "sink": _optional(float32_array),
    "sliding_window": _int,
    "tp_q": _bool,
    "tp_k": _bool,
    "tp_out": _bool,
    "cache_softmax": _bool,
    "cp_offset": _optional(_int),
    "global_cp_deg": _optional(_int),
    "cp_strided_q_slicing": _bool,
    "bound_min": _optional(index_array),
    "bound_max": _optional(index_array),
    "num_threads": lambda name, x: 0 if x is None else _int(name, x, 32),
    "softcap": lambda name, x: 0.0 if x is None else _float(name, x),
    "alibi_slopes": _optional(float32_array),
    "key_bias": _optional(float32_array),
    "window_left": _int,
    "window_right": _int,
    "bottom_right": _bool,
}
