"""The float64 numpy model of optimum-neuron's attention layer and the helpers of the layer tests
(test_layer.py, test_layer_bad_inputs.py): `RefLayer` (written from shared/spec/LAYER.md for these
tests alone; the design and the precision rule in test_layer.py's docstring), the configurations,
weights and layers, and one conversation run through the layer and the model side by side."""

from __future__ import annotations

import math

import flashcte
import numpy as np
import pytest
from conftest import check_close, np_dtype
from semantics import f64

ULP = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


def rtol_of(dtype: str) -> float:
    return 1e-4 if dtype == "float32" else 12 * ULP[dtype]


def rnd(a, dtype: str) -> np.ndarray:
    """float64 values rounded to `dtype` (float32: unchanged, the model stays float64)."""
    a = np.asarray(a, np.float64)
    if dtype == "float32":
        return a
    return a.astype(np_dtype(dtype)).astype(np.float32).astype(np.float64)


# --- the model ------------------------------------------------------------------------------

KV8_LARGEST = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def quantized(rows, fmt: str) -> np.ndarray:
    """An 8-bit cache's write (kv_cache_dtype, the C++ oracle's R8): each row (last axis) as
    code x scale, its float32 scale the row's largest |value| over the format's largest (1 for a
    row of zeros), each value / scale rounded to the format."""
    absmax = np.abs(rows).max(axis=-1, keepdims=True)
    scale = np.where(absmax == 0, 1.0, (absmax / KV8_LARGEST[fmt]).astype(np.float32))
    x = rows / scale
    if fmt == "int8":
        codes = np.clip(np.rint(x), -127, 127)
    else:
        import ml_dtypes

        codes = x.astype(getattr(ml_dtypes, fmt)).astype(np.float64)
    return codes * scale



def inv_frequencies(cfg: dict) -> np.ndarray:
    d = cfg["head_dim"]
    rd = cfg.get("rotary_dim") or d
    inv = 1.0 / cfg.get("rope_theta", 10000.0) ** (np.arange(0, rd, 2, dtype=np.float64) / rd)
    s = cfg.get("rope_scaling")
    if s is None:
        return inv
    # transformers' _compute_llama3_parameters (LAYER.md section 3).
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    original = s["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv
    remapped = np.where(wavelength > original / low, inv / factor, inv)
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * remapped / factor + smooth * remapped
    medium = ~(wavelength < original / high) & ~(wavelength > original / low)
    return np.where(medium, smoothed, remapped)


class RefLayer:
    """The layer and its cache in float64, one sequence row of a batch at a time."""

    def __init__(self, cfg: dict, weights: dict, batch: int, max_len: int):
        self.cfg = cfg
        self.t = cfg.get("dtype", "float32")
        self.w = {k: None if v is None else rnd(v, self.t) for k, v in weights.items()}
        self.sinks = None if cfg.get("sinks") is None else rnd(cfg["sinks"], self.t)
        kv, d = cfg["num_kv_heads"], cfg["head_dim"]
        self.k = np.zeros((batch, kv, max_len, d))
        self.v = np.zeros((batch, kv, max_len, d))
        self.lengths = np.zeros(batch, np.int64)
        self.inv_freq = inv_frequencies(cfg)

    def linear(self, x, name):
        y = rnd(x @ self.w[name].T, self.t)
        bias = self.w.get(name.replace("proj", "bias"))
        return y if bias is None else rnd(y + bias, self.t)

    def rms_norm(self, x, weight):
        inv = 1.0 / np.sqrt(
            np.mean(x * x, axis=-1, keepdims=True) + self.cfg.get("qk_norm_eps", 1e-6)
        )
        return rnd(x * inv * weight, self.t)

    def rope(self, x, positions):
        """x (T, heads, d): rotate_half on the first rotary_dim channels."""
        rd = 2 * self.inv_freq.size
        half = rd // 2
        theta = positions[:, None].astype(np.float64) * self.inv_freq[None, :]  # (T, rd/2)
        cos = rnd(np.cos(theta), self.t)[:, None, :]
        sin = rnd(np.sin(theta), self.t)[:, None, :]
        lo, hi = x[..., :half], x[..., half:rd]
        out = x.copy()
        out[..., :half] = rnd(lo * cos - hi * sin, self.t)
        out[..., half:rd] = rnd(hi * cos + lo * sin, self.t)
        return out

    def forward(self, x, positions):
        cfg, t = self.cfg, self.t
        heads, kv, d = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
        x = rnd(f64(x), t)
        batch, tokens, _ = x.shape
        out = np.zeros((batch, tokens, cfg["hidden_size"]))
        scale = cfg.get("qk_scale") or 1.0 / math.sqrt(d)
        window = cfg.get("sliding_window", 0)
        for b in range(batch):
            pos = np.asarray(positions[b], np.int64)
            assert pos[0] <= self.lengths[b] and np.all(np.diff(pos) == 1)
            q = self.linear(x[b], "q_proj").reshape(tokens, heads, d)
            k = self.linear(x[b], "k_proj").reshape(tokens, kv, d)
            v = self.linear(x[b], "v_proj").reshape(tokens, kv, d)
            if cfg.get("qk_norm"):
                q, k = self.rms_norm(q, self.w["q_norm"]), self.rms_norm(k, self.w["k_norm"])
            if cfg.get("rope", True):
                q, k = self.rope(q, pos), self.rope(k, pos)
            if cfg.get("kv_cache_dtype"):
                k, v = quantized(k, cfg["kv_cache_dtype"]), quantized(v, cfg["kv_cache_dtype"])
            self.k[b, :, pos] = k  # (T, kv, d) into slots pos
            self.v[b, :, pos] = v
            self.lengths[b] = max(self.lengths[b], pos[-1] + 1)
            attn = np.zeros((tokens, heads, d))
            for i, p in enumerate(pos):
                first = max(0, p - window + 1) if window else 0
                for h in range(heads):
                    g = h // (heads // kv)
                    keys, values = self.k[b, g, first : p + 1], self.v[b, g, first : p + 1]
                    logits = scale * (keys @ q[i, h])
                    top = logits.max()
                    if self.sinks is not None:
                        top = max(top, self.sinks[h])
                    e = np.exp(logits - top)
                    total = e.sum() + (0.0 if self.sinks is None else np.exp(self.sinks[h] - top))
                    attn[i, h] = (e @ values) / total
            out[b] = self.linear(rnd(attn, t).reshape(tokens, heads * d), "o_proj")
        return out


# --- helpers --------------------------------------------------------------------------------

CONFIGS = {
    # GQA 4/2 with everything on: partial rotary, Llama-3 scaling, window, sinks, biases, norm.
    "gqa_everything": {
        "hidden_size": 32,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "rotary_dim": 6,
        "rope_theta": 500.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 2.0,
            "original_max_position_embeddings": 16,
        },
        "sliding_window": 20,
        "qkv_bias": True,
        "o_bias": True,
        "qk_norm": True,
        "sinks": True,
    },
    "mqa": {"hidden_size": 64, "num_heads": 8, "num_kv_heads": 1, "head_dim": 16},
    "mha_nope_scale": {
        "hidden_size": 24,
        "num_heads": 3,
        "num_kv_heads": 3,
        "head_dim": 8,
        "rope": False,
        "qk_scale": 0.2,
    },
    "llama3_shape": {
        "hidden_size": 64,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
}


def make_config(name: str, dtype: str, rng) -> dict:
    cfg = dict(CONFIGS[name], dtype=dtype)
    if cfg.get("sinks"):
        cfg["sinks"] = rng.standard_normal(cfg["num_heads"]).astype(np.float32)
    else:
        cfg["sinks"] = None
    return cfg


def make_weights(cfg: dict, rng) -> dict:
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_heads"] * d, cfg["num_kv_heads"] * d

    def linear(out_f, in_f):  # unit gain: N(0, 1/in_f)
        return (rng.standard_normal((out_f, in_f)) / math.sqrt(in_f)).astype(np.float32)

    def vec(n, scale=0.5):
        return (rng.standard_normal(n) * scale).astype(np.float32)

    w = {
        "q_proj": linear(q, h),
        "k_proj": linear(kv, h),
        "v_proj": linear(kv, h),
        "o_proj": linear(h, q),
    }
    bias, norm = cfg.get("qkv_bias"), cfg.get("qk_norm")
    w.update(
        q_bias=vec(q) if bias else None,
        k_bias=vec(kv) if bias else None,
        v_bias=vec(kv) if bias else None,
        o_bias=vec(h) if cfg.get("o_bias") else None,
        q_norm=1 + vec(d, 0.3) if norm else None,
        k_norm=1 + vec(d, 0.3) if norm else None,
    )
    return w


def make_layer(cfg: dict, weights: dict | None = None) -> flashcte.AttentionLayer:
    layer = flashcte.AttentionLayer(
        cfg["hidden_size"],
        cfg["num_heads"],
        cfg["num_kv_heads"],
        cfg["head_dim"],
        rope_theta=cfg.get("rope_theta", 10000.0),
        rotary_dim=cfg.get("rotary_dim"),
        rope_scaling=cfg.get("rope_scaling"),
        sliding_window=cfg.get("sliding_window", 0),
        qk_scale=cfg.get("qk_scale"),
        sinks=cfg.get("sinks"),
        qkv_bias=cfg.get("qkv_bias", False),
        o_bias=cfg.get("o_bias", False),
        qk_norm=cfg.get("qk_norm", False),
        rope=cfg.get("rope", True),
        dtype=cfg["dtype"],
        kv_cache_dtype=cfg.get("kv_cache_dtype"),
    )
    if weights is not None:
        layer.set_weights(**weights)
    return layer


def rows(*start_and_count) -> np.ndarray:
    return np.stack([np.arange(s, s + n, dtype=np.int64) for s, n in start_and_count])


def assert_layer_close(got, ref, dtype: str, what: str) -> None:
    check_close(got, ref, rtol=rtol_of(dtype), floor=1e-3, what=f"{what} ({dtype})")


# The calls of one conversation (batch 2, max_len 128): a 40-token prefill (attention_cte); a
# second chunk that continues row 0 and rewrites row 1 from position 30 (prefix caching at two
# prior lengths); decode steps at two positions (decode kernel); a 5-token speculation chunk;
# then row 1 is reset and starts a new prompt while row 0 goes on, in one 20-token call.
CONVERSATION = [
    ("prefill", rows((0, 40), (0, 40))),
    ("second chunk", rows((40, 24), (30, 24))),
    ("decode 0", rows((64, 1), (54, 1))),
    ("decode 1", rows((65, 1), (55, 1))),
    ("decode 2", rows((66, 1), (56, 1))),
    ("speculation chunk", rows((67, 5), (57, 5))),
    ("reset row 1", None),
    ("new prompt beside a running row", rows((72, 20), (0, 20))),
    ("decode 3", rows((92, 1), (20, 1))),
]


def run_conversation(
    cfg: dict, rng, x_dtype: str | None = None, block_size: int = 0, grid: bool = False
) -> None:
    """The conversation against the model; with ``block_size``, on a block pool (the sequences'
    pages at shuffled places) and bitwise the same outputs as on a dense cache. ``grid``: x on
    multiples of 1/16 in [-1, 1] and the weights on multiples of 1/64 in [-1/2, 1/2], so that
    every projection is exact (see test_8bit_cache)."""
    weights = make_weights(cfg, rng)
    if grid:
        weights = {k: None if w is None else snap(w, 64, 0.5) for k, w in weights.items()}
    layer = make_layer(cfg, weights)
    ref = RefLayer(cfg, weights, batch=2, max_len=128)
    cache = dense = layer.new_cache(2, 128)
    if block_size:
        pages = -(-128 // block_size)
        cache = layer.new_paged_cache(2, 2 * pages + 3, block_size)
        order = rng.permutation(2 * pages + 3)
        for b in range(2):
            cache.assign(b, order[b * pages : (b + 1) * pages])
    dtype = cfg["dtype"]
    for what, positions in CONVERSATION:
        if positions is None:
            cache.reset(1)
            dense.reset(1)
            ref.lengths[1] = 0
            continue
        x = rng.standard_normal((2, positions.shape[1], cfg["hidden_size"]))
        if grid:
            x = snap(x, 16, 1.0)
        x = x.astype(np_dtype(x_dtype or dtype))
        y = layer(x, positions, cache)
        assert isinstance(y, np.ndarray) and y.dtype == np_dtype(dtype), (what, y.dtype)
        assert_layer_close(y, ref.forward(x, positions), dtype, what)
        np.testing.assert_array_equal(cache.lengths, ref.lengths, err_msg=what)
        if block_size:
            assert layer(x, positions, dense).tobytes() == y.tobytes(), f"{what}: paged != dense"
    if block_size:
        return
    # The cache holds K after norm and RoPE, and V, at every filled slot; an 8-bit one codes
    # whose code x scale is exactly the model's.
    if cfg.get("kv_cache_dtype"):
        for b, n in enumerate(ref.lengths):
            for got, scales, want in ((cache.keys, cache.key_scales, ref.k),
                                      (cache.values, cache.value_scales, ref.v)):
                deq = got[b, :, :n].astype(np.float64) * scales[b, :, :n, None]
                np.testing.assert_array_equal(deq, want[b, :, :n], err_msg=f"cache row {b}")
        return
    for b, n in enumerate(ref.lengths):
        assert_layer_close(cache.keys[b, :, :n], ref.k[b, :, :n], dtype, f"cache K row {b}")
        assert_layer_close(cache.values[b, :, :n], ref.v[b, :, :n], dtype, f"cache V row {b}")


def snap(a, grid: int, bound: float) -> np.ndarray:
    """`a` rounded to multiples of 1 / grid and clipped to [-bound, bound]."""
    return (np.clip(np.rint(np.asarray(a, np.float64) * grid) / grid, -bound, bound)).astype(
        np.float32
    )


def raises(exc, prefix, fn, *args, **kwargs):
    """Calls fn, expecting `exc` with a message that starts with `prefix`; returns the message."""
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert str(info.value).startswith(prefix), str(info.value)
    return str(info.value)


# A layer's weights by their names in a Hugging Face checkpoint, after the layer's prefix.
HF_NAMES = {
    "q_proj": "q_proj.weight",
    "k_proj": "k_proj.weight",
    "v_proj": "v_proj.weight",
    "o_proj": "o_proj.weight",
    "q_bias": "q_proj.bias",
    "k_bias": "k_proj.bias",
    "v_bias": "v_proj.bias",
    "o_bias": "o_proj.bias",
    "q_norm": "q_norm.weight",
    "k_norm": "k_norm.weight",
}


def cut_shard(full: dict, layer: flashcte.AttentionLayer, o_bias: bool | None = None) -> dict:
    """A tensor-parallel rank's shard cut from the full weights by its rank_heads, written here
    apart from the library: head_dim rows of q/k/v_proj and their biases and head_dim columns of
    o_proj per head, zeros for a pad head; the norms whole; o_bias (whole) at tp_degree 1, or
    as ``o_bias`` says."""
    query_heads, kv_heads = layer.rank_heads
    d = layer.head_dim

    def blocks(a, of, axis=0):
        zero = np.zeros_like(np.take(a, range(d), axis=axis))
        parts = [np.take(a, range(h * d, (h + 1) * d), axis=axis) if h >= 0 else zero for h in of]
        return np.concatenate(parts, axis=axis)

    of = {"q_proj": query_heads, "k_proj": kv_heads, "v_proj": kv_heads, "q_bias": query_heads,
          "k_bias": kv_heads, "v_bias": kv_heads}
    shard = {k: blocks(v, of[k]) for k, v in full.items() if k in of}
    shard["o_proj"] = blocks(full["o_proj"], query_heads, axis=1)
    for k in ("q_norm", "k_norm"):
        if k in full:
            shard[k] = full[k]
    if "o_bias" in full and (layer.tp_degree == 1 if o_bias is None else o_bias):
        shard["o_bias"] = full["o_bias"]
    return shard
