"""flashcte.AttentionLayer: optimum-neuron's attention layer (NeuronAttentionBase) with a KV cache.

The layer is the C++ ``flashcte::AttentionLayer`` (include/flashcte/layer.h): QKV projections,
optional per-head q/k RMSNorm, RoPE (rotate_half on the first ``rotary_dim`` channels, Llama-3
frequency remap), the KV cache write at the tokens' positions, causal attention over the cached
positions (sliding window, learned sinks), and the O projection. Calls with up to 16 new tokens per
sequence run on the decode kernel, longer ones (prefill, chunked prefill) on attention_cte with
the cached tokens before the chunk as its prior.

This module checks shapes, converts the weights to float32 once and allocates outputs in the
caller's framework; the native layer (python/src/layer.cc) copies the weights into the C++
layer, and runs forward with the GIL released.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _flashcte
from ._attention import _float, _int
from ._errors import ArgumentError, ArgumentTypeError
from ._layer_cache import KvCache, _activation_dtype, _cache_dtype
from ._layer_weights import WEIGHT_NAMES, checked, rank_sinks, read_shard
from ._layer_weights import float32 as _float32
from ._tensors import (
    BFLOAT16,
    TORCH,
    Tensor,
    dtype_name,
    float32_array,
    give_back,
    is_bf16_numpy,
    native,
    torch_module,
    viewable,
)

ArrayLike = Any  # numpy.ndarray, torch.Tensor or another DLPack tensor

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_scaling(rope_scaling: Any, rope_theta: float) -> Any:
    """transformers' ``rope_scaling`` dict (or transformers 5's ``rope_parameters``, which also
    holds ``rope_theta``: it must then agree with the argument) as the native Llama3RopeScaling,
    or None."""
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, Mapping):
        raise ArgumentTypeError(
            "rope_scaling: expected None or a dict such as {'rope_type': 'llama3', 'factor': 8.0, "
            "'low_freq_factor': 1.0, 'high_freq_factor': 4.0, "
            f"'original_max_position_embeddings': 8192}}, got {type(rope_scaling).__name__}"
        )
    if "rope_theta" in rope_scaling:
        theta = _float("rope_scaling.rope_theta", rope_scaling["rope_theta"])
        if theta != rope_theta:
            raise ArgumentError(
                f"rope_scaling: holds rope_theta {theta:g}, but the layer's rope_theta is "
                f"{rope_theta:g} (pass rope_theta={theta:g})"
            )
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind == "default":  # transformers' name for plain RoPE
        return None
    if kind != "llama3":
        raise ArgumentError(
            f"rope_scaling: rope_type {kind!r} is not supported; flashcte implements 'llama3' "
            "(the Llama-3 frequency remap) only, or None for plain RoPE"
        )
    unknown = sorted(set(rope_scaling) - {"rope_type", "type", "rope_theta", *_LLAMA3_KEYS})
    if unknown:
        raise ArgumentError(
            f"rope_scaling: unknown keys {unknown} for rope_type 'llama3' (known: "
            f"{', '.join(_LLAMA3_KEYS)})"
        )
    s = _flashcte.Llama3RopeScaling()  # the C++ defaults: 8, 1, 4, 8192
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key in rope_scaling:
            setattr(s, key, _float(f"rope_scaling.{key}", rope_scaling[key]))
    if "original_max_position_embeddings" in rope_scaling:
        s.original_max_position_embeddings = _int(
            "rope_scaling.original_max_position_embeddings",
            rope_scaling["original_max_position_embeddings"],
        )
    return s


def _positions(x: Any) -> Any:
    """Positions as int64 (numpy or torch, read in place when already int64)."""
    torch = torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ArgumentError(f"positions: must be a CPU tensor, got device {x.device}")
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise ArgumentTypeError(f"positions: dtype must be int64, got {dtype_name(x.dtype)}")
        return x.detach().to(torch.int64)
    if not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__"):
        x = np.from_dlpack(x)
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.integer):
        raise ArgumentTypeError(f"positions: dtype must be int64, got {a.dtype}")
    return viewable(a.astype(np.int64, copy=False))


class AttentionLayer:
    """optimum-neuron's ``NeuronAttentionBase`` (shared/spec/LAYER.md) on the CPU.

    Args:
        hidden_size: the model's hidden size (in_features of q/k/v_proj).
        num_heads: query heads.
        num_kv_heads: KV heads; divides ``num_heads`` (GQA; 1 is MQA).
        head_dim: channels per head; None for ``hidden_size // num_heads``.
        rope_theta: the RoPE base.
        rotary_dim: channels rotated, the first ``rotary_dim`` of each head (half-split within
            them, as ``partial_rotary_factor`` models do); None for all of them.
        rope_scaling: None, or transformers' dict for Llama 3: ``{"rope_type": "llama3",
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}`` (missing numbers take these defaults;
            ``"type"`` is read as ``"rope_type"``; ``"default"`` means none; a ``"rope_theta"``
            entry, as in transformers 5's ``rope_parameters``, must equal ``rope_theta``). Other
            rope types raise ValueError.
        sliding_window: 0 for none, else key ``j`` is visible to query ``i`` when
            ``i - j < sliding_window``.
        qk_scale: multiplies ``q.k``; None for ``1 / sqrt(head_dim)``.
        sinks: None, or ``num_heads`` learned sink logits (gpt-oss): one value-less, unscaled
            logit per query head in every softmax.
        qkv_bias: q/k/v_proj have biases (Qwen2).
        o_bias: o_proj has a bias.
        qk_norm: per-head RMSNorm of Q and K along head_dim before RoPE (Qwen3), weights
            ``q_norm`` / ``k_norm`` of ``(head_dim,)``, epsilon ``qk_norm_eps``.
        rope: False for a NoPE layer (Q and K are not rotated).
        dtype: the activation dtype: "float32", "bfloat16" or "float16" (or a numpy / torch
            dtype). Weights, inputs, the cache and the outputs are rounded to it where the
            module materializes them (the C++ oracle's R1-R7).
        kv_cache_dtype: None (the cache in ``dtype``), or an 8-bit cache: ``"int8"``,
            ``"float8_e4m3"`` (torch's ``float8_e4m3fn``) or ``"float8_e5m2"`` (or those torch
            dtypes). Each written K and V row of a KV head is quantized with its own float32
            scale, its largest ``|value|`` over the format's largest (as
            :func:`flashcte.quantize_kv`), halving a bf16 cache; attention reads
            ``code * scale``.
        tp_degree, tp_rank: build the layer as rank ``tp_rank`` of a tensor-parallel group of
            ``tp_degree`` (LAYER.md section 4): :meth:`set_weights` takes the full weights and
            keeps this rank's heads after GQA sharding, or the rank's own shard
            (``shard=True``, :meth:`load_safetensors`), :meth:`new_cache` holds this rank's
            KV heads, and forward returns the rank's *partial* output without ``o_bias``: the
            ranks' outputs summed plus ``o_bias`` are the whole layer's
            (:class:`flashcte.distributed.TensorParallelAttention` does the sum).
        gqa_strategy: how a tensor-parallel layer shards its heads, ON's ``GQA`` enum values:
            ``"replicate-to-tp-degree"`` (K/V replicated to one KV head per rank, Q padded
            after each KV group; needs ``tp_degree % num_kv_heads == 0`` when it replicates),
            ``"convert-to-mha"`` (K/V replicated to one KV head per query head, Q/K/V padded at
            the tail; shards every layout), or ``"auto"`` (ON's choice: replicate when
            ``tp_degree % num_kv_heads == 0``, else convert).

    The config is checked here; the weights come with :meth:`set_weights`. Errors raise
    TypeError (dtypes) or ValueError with the library's ``"<argument>: <rule>"`` message.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int | None = None,
        *,
        rope_theta: float = 10000.0,
        rotary_dim: int | None = None,
        rope_scaling: Mapping | None = None,
        sliding_window: int = 0,
        qk_scale: float | None = None,
        sinks: ArrayLike | None = None,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        qk_norm_eps: float = 1e-6,
        rope: bool = True,
        dtype: Any = "float32",
        kv_cache_dtype: Any = None,
        tp_degree: int = 1,
        tp_rank: int = 0,
        gqa_strategy: str = "auto",
    ):
        c = _flashcte.LayerConfig()
        c.hidden_size = _int("hidden_size", hidden_size)
        c.num_heads = _int("num_heads", num_heads)
        c.num_kv_heads = _int("num_kv_heads", num_kv_heads)
        c.head_dim = 0 if head_dim is None else _int("head_dim", head_dim)
        if c.head_dim == 0 and head_dim is not None:
            raise ArgumentError("head_dim: must be >= 1 (None for hidden_size // num_heads)")
        c.rope = bool(rope)
        c.rope_theta = _float("rope_theta", rope_theta)
        c.rotary_dim = 0 if rotary_dim is None else _int("rotary_dim", rotary_dim)
        if c.rotary_dim == 0 and rotary_dim is not None:
            raise ArgumentError("rotary_dim: must be >= 2 (None for head_dim)")
        c.rope_scaling = _rope_scaling(rope_scaling, c.rope_theta)
        if not c.rope and (rotary_dim is not None or c.rope_scaling is not None):
            raise ArgumentError("rope_scaling, rotary_dim: given, but rope=False (a NoPE layer)")
        c.sliding_window = _int("sliding_window", sliding_window)
        c.qk_scale = 0.0 if qk_scale is None else _float("qk_scale", qk_scale)
        if qk_scale is not None and c.qk_scale == 0.0:
            raise ArgumentError("qk_scale: must not be 0 (None for 1 / sqrt(head_dim))")
        c.qkv_bias = bool(qkv_bias)
        c.o_bias = bool(o_bias)
        c.qk_norm = bool(qk_norm)
        c.qk_norm_eps = _float("qk_norm_eps", qk_norm_eps)
        c.sinks = sinks is not None
        c.dtype = _activation_dtype(dtype)
        if kv_cache_dtype is not None:
            c.kv_cache_dtype = _cache_dtype(kv_cache_dtype, "kv_cache_dtype")
        c.tp_degree = _int("tp_degree", tp_degree)
        c.tp_rank = _int("tp_rank", tp_rank)
        if not isinstance(gqa_strategy, str):
            raise ArgumentTypeError(
                "gqa_strategy: must be 'auto', 'replicate-to-tp-degree' or 'convert-to-mha', "
                f"got {type(gqa_strategy).__name__}"
            )
        c.gqa_strategy = gqa_strategy
        _flashcte.layer_check_config(c)
        self._config = c
        self._rank_config = _flashcte.layer_rank_config(c)
        self._head_dim = c.head_dim if c.head_dim else c.hidden_size // c.num_heads
        self._sinks = None
        if sinks is not None:
            s = _float32("sinks", sinks)
            if s.shape not in ((c.num_heads,), (c.num_heads, 1)):
                raise ArgumentError(
                    f"sinks: shape {s.shape} must be (num_heads,) = ({c.num_heads},): one logit "
                    "per query head"
                )
            self._sinks = s.reshape(-1)
        self._native = None

    # --- the config, read back
    @property
    def hidden_size(self) -> int:
        return self._config.hidden_size

    @property
    def num_heads(self) -> int:
        return self._config.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self._config.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def dtype(self) -> str:
        return self._config.dtype

    @property
    def kv_cache_dtype(self) -> str:
        """The cache's dtype: the activation dtype, or the 8-bit format asked for."""
        return self._config.kv_cache_dtype or self._config.dtype

    @property
    def tp_degree(self) -> int:
        return self._config.tp_degree

    @property
    def tp_rank(self) -> int:
        return self._config.tp_rank

    @property
    def gqa_strategy(self) -> str:
        """The strategy asked for: "auto", "replicate-to-tp-degree" or "convert-to-mha"."""
        return self._config.gqa_strategy

    @property
    def local_num_heads(self) -> int:
        """Query heads this rank computes, pad heads included (num_heads at tp_degree 1)."""
        return self._rank_config.num_heads

    @property
    def local_num_kv_heads(self) -> int:
        """KV heads this rank holds in its cache, replicas and pad heads included."""
        return self._rank_config.num_kv_heads

    @property
    def has_weights(self) -> bool:
        return self._native is not None

    def __repr__(self) -> str:
        c = self._config
        parts = [
            f"hidden_size={c.hidden_size}",
            f"num_heads={c.num_heads}",
            f"num_kv_heads={c.num_kv_heads}",
            f"head_dim={self._head_dim}",
            f"dtype={c.dtype!r}",
        ]
        if c.kv_cache_dtype:
            parts.append(f"kv_cache_dtype={c.kv_cache_dtype!r}")
        if not c.rope:
            parts.append("rope=False")
        else:
            parts.append(f"rope_theta={c.rope_theta:g}")
            if c.rotary_dim:
                parts.append(f"rotary_dim={c.rotary_dim}")
            if c.rope_scaling is not None:
                parts.append(f"rope_scaling=llama3(factor={c.rope_scaling.factor:g})")
        for flag in ("qkv_bias", "o_bias", "qk_norm"):
            if getattr(c, flag):
                parts.append(f"{flag}=True")
        if c.sliding_window:
            parts.append(f"sliding_window={c.sliding_window}")
        if c.sinks:
            parts.append("sinks=...")
        if c.tp_degree != 1:
            parts.append(f"tp_degree={c.tp_degree}, tp_rank={c.tp_rank}")
            parts.append(
                f"gqa_strategy={c.gqa_strategy!r} (local heads {self.local_num_heads}/"
                f"{self.local_num_kv_heads})"
            )
        if not self.has_weights:
            parts.append("no weights yet")
        return f"AttentionLayer({', '.join(parts)})"

    def set_weights(
        self,
        q_proj: ArrayLike,
        k_proj: ArrayLike,
        v_proj: ArrayLike,
        o_proj: ArrayLike,
        q_bias: ArrayLike | None = None,
        k_bias: ArrayLike | None = None,
        v_bias: ArrayLike | None = None,
        o_bias: ArrayLike | None = None,
        q_norm: ArrayLike | None = None,
        k_norm: ArrayLike | None = None,
        *,
        shard: bool = False,
    ) -> None:
        """Builds the C++ layer from weights in ``torch.nn.Linear`` layout
        ``(out_features, in_features)``: numpy arrays or torch tensors of any float dtype,
        converted to float32 once (the layer then rounds them to its dtype).

        Args:
            q_proj: ``(num_heads * head_dim, hidden_size)``.
            k_proj, v_proj: ``(num_kv_heads * head_dim, hidden_size)``.
            o_proj: ``(hidden_size, num_heads * head_dim)``.
            q_bias, k_bias, v_bias: ``(out_features,)``; required with ``qkv_bias``, else None.
            o_bias: ``(hidden_size,)``; required with ``o_bias``, else None.
            q_norm, k_norm: ``(head_dim,)`` RMSNorm weights; required with ``qk_norm``.
            shard: the weights are this tensor-parallel rank's own shard rather than the full
                layer's: the blocks of its :attr:`rank_heads` (``head_dim`` rows of q/k/v_proj
                and their biases, ``head_dim`` columns of o_proj per head, zeros for a pad head),
                sized by :attr:`local_num_heads` / :attr:`local_num_kv_heads`; no ``o_bias``
                past ``tp_degree`` 1. The rank never holds the full weights, and computes
                bitwise what it computes from them. :meth:`load_safetensors` reads a shard.

        Calling it again replaces the weights; caches stay valid (they depend on the shapes).
        """
        args = locals()
        weights = {name: args[name] for name in WEIGHT_NAMES}
        config = self._rank_config if shard else self._config
        w = checked(config, self._head_dim, weights, shard)
        sinks = self._sinks
        if shard and sinks is not None:
            sinks = rank_sinks(sinks, self.rank_heads[0])
        self._native = _flashcte.Layer(self._config, sinks=sinks, shard=shard, **w)

    def load_safetensors(self, path: Any, prefix: str = "") -> None:
        """Builds the layer from a safetensors checkpoint of the *full* layer, reading this rank's
        shard only (:meth:`set_weights` with ``shard=True``): the head blocks of its
        :attr:`rank_heads` from ``q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``,
        ``o_proj.weight`` (columns), and with the config's flags ``q_proj.bias`` ... ,
        ``o_proj.bias`` (at tp_degree 1), ``q_norm.weight``, ``k_norm.weight``, each name after
        ``prefix`` (Hugging Face's, e.g. ``"model.layers.0.self_attn."``). Sinks are the
        constructor's. Any float dtype of the file (bfloat16 needs torch)."""
        if not isinstance(prefix, str):
            raise ArgumentTypeError(f"prefix: must be a str, got {type(prefix).__name__}")
        c = self._config
        weights = read_shard(path, prefix, c, self._head_dim, self.rank_heads, c.tp_degree == 1)
        self.set_weights(**weights, shard=True)

    @property
    def rank_heads(self) -> tuple[list[int], list[int]]:
        """The full layer's heads this rank holds: (per local query head its query head, per local
        KV head its KV head), -1 for a pad head (zero weights)."""
        return _flashcte.layer_rank_heads(self._config)

    def new_cache(self, batch: int, max_len: int) -> KvCache:
        """An empty cache for ``batch`` sequences of up to ``max_len`` tokens (this rank's KV
        heads for a tensor-parallel rank)."""
        c = self._rank_config
        return KvCache(batch, max_len, c.num_kv_heads, self._head_dim, self.kv_cache_dtype)

    def new_paged_cache(self, batch: int, num_blocks: int, block_size: int) -> KvCache:
        """An empty block pool of ``num_blocks`` pages of ``block_size`` slots for ``batch``
        sequences (this rank's KV heads for a tensor-parallel rank); :meth:`KvCache.assign`
        gives each sequence its pages."""
        c = self._rank_config
        return KvCache.paged(
            batch, num_blocks, block_size, c.num_kv_heads, self._head_dim, self.kv_cache_dtype
        )

    def __call__(
        self,
        x: ArrayLike,
        positions: ArrayLike,
        cache: KvCache,
        num_threads: int | None = None,
    ) -> ArrayLike:
        """One forward call: ``NeuronAttentionBase.forward`` with the cache write folded in.

        Args:
            x: ``(batch, T, hidden_size)``, float32, float16 or bfloat16 (rounded to the
                layer's dtype); numpy arrays or DLPack tensors (torch), read in place.
            positions: ``(batch, T)`` integer positions (int64; other integer types are
                converted). In each row they go up by 1 from one token to the next, start at
                most at the row's cached length (an earlier start rewrites the slots from there)
                and stay below ``max_len``.
            cache: from :meth:`new_cache`, with ``batch`` sequences.
            num_threads: threads for the attention and the GEMMs; None for OpenMP's default.

        Returns:
            ``(batch, T, hidden_size)`` in the layer's dtype, in the kind of ``x`` (numpy in,
            numpy out, bfloat16 as ``ml_dtypes.bfloat16``; torch in, torch out); for a
            tensor-parallel rank, its partial output (no ``o_bias``). Each token's
            K/V is written into the cache at its position, then every token attends to every
            cached slot at a position <= its own (within the window), and the cache's lengths
            grow to cover the call. The GIL is released while the layer runs.
        """
        layer = self._native
        if layer is None:
            raise RuntimeError(
                "AttentionLayer: no weights yet; call set_weights(q_proj, k_proj, v_proj, o_proj, "
                "...) before forward"
            )
        if not isinstance(cache, KvCache):
            raise ArgumentTypeError(
                f"cache: expected a flashcte.KvCache (layer.new_cache(batch, max_len)), got "
                f"{type(cache).__name__}"
            )
        xt = Tensor("x", x)
        if xt.ndim != 3:
            raise ArgumentError(
                f"x: must have rank 3 (batch, T, hidden_size), got rank {xt.ndim} (shape "
                f"{xt.shape})"
            )
        batch, tokens = xt.shape[0], xt.shape[1]
        out = self._empty(xt, (batch, tokens, self.hidden_size))
        if num_threads is not None and _int("num_threads", num_threads, 32) < 0:
            raise ArgumentError(
                f"num_threads: must be >= 0 (None: OpenMP's default), got {num_threads}"
            )
        layer.forward(
            x=native(xt),
            positions=_positions(positions),
            cache=cache._native,
            out=native(out),
            num_threads=0 if num_threads is None else int(num_threads),
            bf16_bits=is_bf16_numpy(xt.arr) or is_bf16_numpy(out),
        )
        return give_back(xt, out)

    forward = __call__

    def _empty(self, like: Tensor, shape: tuple) -> Any:
        """An output of `like`'s kind in the layer's dtype."""
        dtype = self._config.dtype
        if like.kind == TORCH:
            torch = torch_module()
            return torch.empty(shape, dtype=getattr(torch, dtype))
        if dtype == "bfloat16":
            if BFLOAT16 is None:  # pragma: no cover - exercised only without ml_dtypes
                raise ArgumentTypeError(
                    "x: a bfloat16 layer returns numpy bfloat16 arrays, which need ml_dtypes "
                    "(pip install ml_dtypes); or pass torch tensors"
                )
            return np.empty(shape, dtype=BFLOAT16)
        return np.empty(shape, dtype=np.dtype(dtype))  # numpy also for other DLPack producers


def layer_gemm_backend() -> str:
    """The GEMM library the layer's projections run on and its kernels, e.g.
    ``"OpenBLAS 0.3.21 ..., core Cooperlake (set by flashcte ...)"``. Loads it on first use."""
    return _flashcte.layer_gemm_backend()
