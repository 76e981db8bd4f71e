"""vLLM-shaped paged attention on the CPU: ``paged_attention``, a whole mixed batch of prefill
chunks and decoding sequences over a paged cache in one call, and ``plan_paged_attention``, the
same step planned once and run in every layer (FlashInfer's ``plan()`` / ``run()``). Both are the
mixed-batch call of flashcte/kvcache.h (:func:`._kvcache.varlen_over_cache`), with vLLM's
argument names in their errors.
"""

from __future__ import annotations

from typing import Any

from . import _fa_args, _flashcte
from ._errors import ArgumentError
from ._kvcache import _Cache, _int32, _kv8_format, _scale, _writable, varlen_over_cache
from ._tensors import Tensor, empty, give_back, in_names, is_bf16_numpy, native, transpose

ArrayLike = Any


# paged_attention's names (vLLM's) for the arguments of the mixed-batch call it makes.
PAGED_NAMES = {
    "q": "query",
    "k_cache": "key_cache",
    "v_cache": "value_cache",
    "cu_seqlens_q": "query_start_loc",
    "seqused_k": "seq_lens",
    "softmax_scale": "scale",
    "window_size": "window",
    "out": "output",
}


def _nhd_caches(
    query: ArrayLike,
    key_cache: ArrayLike,
    value_cache: ArrayLike,
    k_scale: Any,
    v_scale: Any,
    kv_layout: str,
) -> tuple[list[Any], list[Any]]:
    """paged_attention's caches and their per-token scales as FlashAttention's (num_blocks,
    block_size, heads_k, d) views (vLLM's HND transposed, without a copy). The library reads
    FlashAttention's layout and would print the transposed shapes, so the rules that relate an
    HND cache's axes to the other arguments' are checked here, on the shapes the caller passed."""
    if kv_layout not in ("HND", "NHD"):
        raise ArgumentError(
            f"kv_layout: must be 'HND' (vLLM) or 'NHD' (FlashAttention), got {kv_layout!r}"
        )
    caches, scales, shapes = [], [], []
    hnd = kv_layout == "HND"
    for name, cache, cache_scale in (
        ("key_cache", key_cache, k_scale),
        ("value_cache", value_cache, v_scale),
    ):
        arr = cache if _kv8_format(cache) else Tensor(name, cache).arr
        if arr.ndim != 4:
            layout = "num_blocks, heads_k, block_size" if hnd else "num_blocks, block_size, heads_k"
            raise ArgumentError(
                f"{name}: must have rank 4 ({layout}, head_dim), got shape {tuple(arr.shape)}"
            )
        caches.append(transpose(arr, 1, 2) if hnd else arr)
        shapes.append(tuple(int(n) for n in arr.shape))
        per_token = getattr(cache_scale, "ndim", 0) == 3
        scales.append(transpose(cache_scale, 1, 2) if hnd and per_token else cache_scale)
    if hnd:
        k_shape, v_shape = shapes
        if k_shape[2] < 1:
            raise ArgumentError(
                f"key_cache: block_size (axis 2 of {k_shape}) is 0; a page holds >= 1 slot"
            )
        if v_shape[:3] != k_shape[:3]:
            raise ArgumentError(
                f"value_cache: shape {v_shape} must have key_cache's (num_blocks, heads_k, "
                f"block_size) = {k_shape[:3]}"
            )
        d = int(query.shape[-1]) if getattr(query, "ndim", 0) == 3 else k_shape[3]
        if k_shape[3] != d:
            raise ArgumentError(
                f"key_cache: shape {k_shape} has head_dim {k_shape[3]}, expected query's {d}"
            )
        for name, scale, shape in (("k_scale", k_scale, k_shape), ("v_scale", v_scale, v_shape)):
            if getattr(scale, "ndim", 0) == 3 and tuple(int(n) for n in scale.shape) != shape[:3]:
                raise ArgumentError(
                    f"{name}: shape {tuple(scale.shape)} must be the cache's without its last "
                    f"axis, {shape[:3]} (one scale per token)"
                )
    return caches, scales


def paged_attention(
    query: ArrayLike,
    key_cache: ArrayLike,
    value_cache: ArrayLike,
    block_table: ArrayLike,
    seq_lens: ArrayLike,
    query_start_loc: ArrayLike,
    scale: float,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    output: ArrayLike | None = None,
    *,
    kv_layout: str = "HND",
    k_scale: ArrayLike | float | None = None,
    v_scale: ArrayLike | float | None = None,
    num_threads: int | None = None,
) -> ArrayLike:
    """Attention over a paged KV cache in vLLM's shapes, for engines that keep vLLM's layout: one
    call for a whole mixed batch of prefill chunks and decoding sequences.

    Args:
        query: ``(num_tokens, heads, d)``, every sequence's new tokens back to back.
        key_cache, value_cache: vLLM's ``(num_blocks, heads_k, block_size, d)`` (``kv_layout``
            "HND", the default) or FlashAttention's ``(num_blocks, block_size, heads_k, d)``
            ("NHD"); any ``block_size`` from 1. The new tokens' keys and values are already in it
            (vLLM writes them first, with ``reshape_and_cache``).
        block_table: ``(num_seqs, max_blocks_per_seq)`` int32.
        seq_lens: ``(num_seqs,)`` int32, each sequence's tokens in the cache, new ones included.
        query_start_loc: ``(num_seqs + 1,)`` int32: sequence ``s`` is rows
            ``[query_start_loc[s], query_start_loc[s + 1])`` of ``query``, the last tokens of
            its ``seq_lens[s]``.
        scale: the softmax scale.
        causal: bottom-right aligned causal mask (vLLM's decoder attention).
        window: ``(left, right)`` as FlashAttention's ``window_size``, ``-1`` unbounded.
        softcap: ``> 0``: logit soft cap before ALiBi.
        alibi_slopes: ``(heads,)`` float32.
        sinks: ``(heads,)`` float32: an attention sink logit per head (gpt-oss).
        output: ``(num_tokens, heads, dv)`` written in place when given, else allocated.
        k_scale, v_scale: for an 8-bit cache (int8, float8_e4m3fn, float8_e5m2, as vLLM's fp8
            cache), its float32 scale: a float or ``(1,)`` (vLLM's per-tensor scale),
            ``(heads_k,)``, or per token the cache's shape without its last axis (in
            ``kv_layout``).

    Returns:
        ``output``. Results are the ones :func:`flash_attn_with_kvcache` gives each sequence,
        bitwise, for any thread count and page size.
    """
    args = locals()
    return _paged(**args)


def _paged(plan: bool = False, output: ArrayLike | None = None, **a: Any) -> Any:
    """paged_attention's call, or its plan: the caches as FlashAttention's views, the mixed batch
    by paged_attention's names."""
    caches, scales = _nhd_caches(
        a["query"], a["key_cache"], a["value_cache"], a["k_scale"], a["v_scale"], a["kv_layout"]
    )
    return varlen_over_cache(
        a["query"],
        caches[0],
        caches[1],
        a["query_start_loc"],
        a["seq_lens"],
        a["block_table"],
        a["scale"],
        a["causal"],
        a["window"],
        a["softcap"],
        a["alibi_slopes"],
        a["sinks"],
        False,
        a["num_threads"],
        out=output,
        k_scale=scales[0],
        v_scale=scales[1],
        names=PAGED_NAMES,
        plan=plan,
    )


class PagedAttentionPlan:
    """A serving step's :func:`paged_attention`, planned once and run in every layer
    (FlashInfer's ``plan()`` / ``run()``), from :func:`plan_paged_attention`.

    The plan holds the step: ``query_start_loc``, ``seq_lens`` and ``block_table`` (checked and
    copied: later changes to those arrays do not reach it), each sequence's key ranges and kernel,
    and the scalar options. :meth:`run` takes one layer's arrays, in the planned dtypes, shapes and
    strides at any address, checks what may differ between layers (the layouts against the plan,
    outputs over inputs, the values of the scales, slopes and sinks) and attends: bitwise what
    :func:`paged_attention` gives with that layer's arrays. A plan may run from several threads.
    """

    __slots__ = ("_plan", "_kv_layout", "_batch", "_heads", "_shapes")

    def __init__(self, plan: Any, kv_layout: str, batch: int, heads: int, arrays: dict[str, Any]):
        self._plan, self._kv_layout, self._batch, self._heads = plan, kv_layout, batch, heads
        self._shapes = _shapes(arrays)

    def run(
        self,
        query: ArrayLike,
        key_cache: ArrayLike,
        value_cache: ArrayLike,
        *,
        alibi_slopes: ArrayLike | None = None,
        sinks: ArrayLike | None = None,
        k_scale: ArrayLike | float | None = None,
        v_scale: ArrayLike | float | None = None,
        output: ArrayLike | None = None,
    ) -> ArrayLike:
        """One layer of the step: ``query``, ``key_cache`` and ``value_cache`` as
        :func:`paged_attention` takes them, with this layer's ``alibi_slopes``, ``sinks`` and
        8-bit scales, each given exactly when the plan's was. Returns ``output`` (allocated when
        not given)."""
        given = _shapes(dict(query=query, key_cache=key_cache, value_cache=value_cache,
                             alibi_slopes=alibi_slopes, sinks=sinks, k_scale=k_scale, v_scale=v_scale))
        for name, shape in given.items():
            planned = self._shapes[name]
            # Shapes as the caller passes them (vLLM's HND caches, slopes before their
            # broadcast); presence, dtypes and strides are the library's to compare.
            if shape is not None and planned is not None and shape != planned:
                raise ArgumentError(f"{name}: shape {shape} differs from the plan's {planned}")
        caches, scales = _nhd_caches(query, key_cache, value_cache, k_scale, v_scale, self._kv_layout)
        try:
            qt = Tensor("q", query)
            if qt.ndim != 3:
                raise ArgumentError(
                    f"q: must have rank 3 (total_q, heads, head_dim), got shape {qt.shape}"
                )
            kc, vc = _Cache("k_cache", caches[0], False), _Cache("v_cache", caches[1], False)
            if output is None:
                result = empty(qt, (qt.shape[0], qt.shape[1], vc.shape[3]))
            else:
                result = _writable("output", output, "the call writes its result there")
            _flashcte.run_varlen_kvcache(
                plan=self._plan,
                q=native(qt),
                k_cache=kc.arr,
                v_cache=vc.arr,
                out=native(result),
                lse=None,
                bf16_bits=is_bf16_numpy(qt.arr) or kc.bf16(),
                k_cache_format=kc.fmt,
                v_cache_format=vc.fmt,
                k_scale=_scale("k_scale", scales[0], False),
                v_scale=_scale("v_scale", scales[1], False),
                alibi_slopes=_fa_args.alibi(alibi_slopes, self._batch, self._heads),
                sinks=None if sinks is None else native(Tensor("sinks", sinks)),
            )
            return give_back(qt, result) if output is None else output
        except (TypeError, ValueError) as e:
            raise in_names(e, PAGED_NAMES) from None


def plan_paged_attention(
    query: ArrayLike,
    key_cache: ArrayLike,
    value_cache: ArrayLike,
    block_table: ArrayLike,
    seq_lens: ArrayLike,
    query_start_loc: ArrayLike,
    scale: float,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    *,
    kv_layout: str = "HND",
    k_scale: ArrayLike | float | None = None,
    v_scale: ArrayLike | float | None = None,
    num_threads: int | None = None,
) -> PagedAttentionPlan:
    """Plans a serving step of :func:`paged_attention` once for all its layers: the arguments
    are :func:`paged_attention`'s (one layer's arrays stand for every layer's layout), everything
    is checked as that call checks it, and nothing is computed. Run each layer with
    :meth:`PagedAttentionPlan.run`::

        plan = flashcte.plan_paged_attention(q[0], k_caches[0], v_caches[0], block_table,
                                             seq_lens, query_start_loc, scale)
        for layer in range(num_layers):
            out[layer] = plan.run(q[layer], k_caches[layer], v_caches[layer])
    """
    made = _paged(plan=True, **locals())  # first: locals() are the arguments
    arrays = dict(query=query, key_cache=key_cache, value_cache=value_cache,
                  alibi_slopes=alibi_slopes, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    cu = _int32("query_start_loc", query_start_loc)
    heads = int(Tensor("q", query).shape[1])
    return PagedAttentionPlan(made, kv_layout, int(cu.shape[0]) - 1, heads, arrays)


def _shapes(arrays: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """Each array's shape as given (None: absent, or a number)."""
    return {name: None if getattr(x, "shape", None) is None else tuple(int(n) for n in x.shape)
            for name, x in arrays.items()}
