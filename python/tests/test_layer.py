"""flashcte.AttentionLayer against a float64 numpy model of optimum-neuron's attention layer.

`RefLayer` below is written from shared/spec/LAYER.md for these tests alone (it shares no code
with the library or with src/reference): q/k/v projections (+ bias), per-head q/k RMSNorm before
RoPE, rotate_half RoPE on the first rotary_dim channels with the Llama-3 frequency remap, the
K/V cache write at the positions, causal attention over the cached slots at positions <= the
query's own (within the window), learned sinks as a value-less logit, o_proj + bias.

Precision. In float32 the model is plain float64 and the layer's own float32 arithmetic (GEMM
sums over <= 64 terms, exp, RoPE angles) is far inside 1e-4 of the largest output. For 16-bit
layers the model rounds to the dtype where the module materializes a tensor (LAYER.md R1-R7:
inputs and weights, projections, norm, cos/sin, rotated Q/K, attention output, o_proj, bias);
each rounded stage may land one ulp of the dtype away, and with unit-gain weights six stages stay
within 6 ulps of the largest output: the bound is twice that, as in
tests/layer/attention_layer_test.cc.
"""

from __future__ import annotations

import math
import threading
import time

import flashcte
import numpy as np
import pytest
from conftest import check_close, np_dtype
from semantics import BF16, f64

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


# --- against the model ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_conversation_float32(name, rng):
    run_conversation(make_config(name, "float32", rng), rng)


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(
            "bfloat16",
            marks=pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed"),
        ),
        "float16",
    ],
)
@pytest.mark.parametrize("name", ["gqa_everything", "mqa"])
def test_conversation_16bit(name, dtype, rng):
    run_conversation(make_config(name, dtype, rng), rng)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("name", ["gqa_everything", "mqa"])
def test_conversation_on_a_paged_cache(name, block_size, rng):
    run_conversation(make_config(name, "float32", rng), rng, block_size=block_size)


@pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed")
@pytest.mark.parametrize("block_size", [0, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3", "float8_e5m2"])
def test_8bit_cache(fmt, dtype, block_size, rng):
    """kv_cache_dtype: the model quantizes each written row as the layer must. Quantizing rounds
    to a coarse grid, so a K value one float32 ulp from the model's (another summation order)
    could cross a rounding boundary: the data make every projection exact (``grid``) and the
    layer has no RoPE or q/k norm after them, so the codes must be the model's."""
    # No q/k/v biases either: this model rounds x W^T and the bias sum separately (the C++ oracle,
    # tests/layer/attention_layer_test.cc, covers biases with one rounding, as the module).
    cfg = dict(CONFIGS["gqa_everything"], dtype=dtype, rope=False, qk_norm=False, qkv_bias=False)
    for key in ("rotary_dim", "rope_scaling"):
        del cfg[key]
    cfg["sinks"] = snap(rng.standard_normal(cfg["num_heads"]), 64, 0.5)
    cfg["kv_cache_dtype"] = {"float8_e4m3": "float8_e4m3fn"}.get(fmt, fmt)
    run_conversation(cfg, rng, block_size=block_size, grid=True)


def test_8bit_cache_api(rng):
    layer = flashcte.AttentionLayer(16, 2, 1, kv_cache_dtype="fp8_e4m3")
    assert layer.kv_cache_dtype == "float8_e4m3fn"
    assert "kv_cache_dtype='float8_e4m3fn'" in repr(layer)
    assert flashcte.AttentionLayer(16, 2, 1).kv_cache_dtype == "float32"
    cache = layer.new_cache(2, 8)
    assert cache.dtype == "float8_e4m3fn" and cache.keys.shape == (2, 1, 8, 8)
    assert str(cache.keys.dtype) == "float8_e4m3fn" and cache.key_scales.shape == (2, 1, 8)
    assert np.all(cache.key_scales == 1) and not cache.key_scales.flags.writeable
    pool = flashcte.AttentionLayer(16, 2, 1, kv_cache_dtype="int8").new_paged_cache(1, 4, 4)
    assert pool.keys.dtype == np.int8 and pool.value_scales.shape == (4, 1, 4)
    with pytest.raises(ValueError, match="^cache: a float32 cache has no scales"):
        flashcte.AttentionLayer(16, 2, 1).new_cache(1, 4).key_scales
    with pytest.raises(TypeError, match="^kv_cache_dtype: must be float32, bfloat16, float16, int8"):
        flashcte.AttentionLayer(16, 2, 1, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: must be int8, .* \(float32\), got "
                       "bfloat16"):
        flashcte.AttentionLayer(16, 2, 1, kv_cache_dtype="bfloat16")
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is optional
        return
    assert flashcte.AttentionLayer(16, 2, 1, kv_cache_dtype=torch.float8_e5m2).kv_cache_dtype == (
        "float8_e5m2"
    )


def test_shared_prefix_pages(rng):
    """A serving engine's prefix cache: request 1 reuses request 0's prompt pages (read-only)
    and decodes as if it had prefilled the prompt itself; writing into them raises ValueError
    with the pool unchanged; bad pages are refused by name."""
    cfg = make_config("gqa_everything", "float32", rng)
    layer = make_layer(cfg, make_weights(cfg, rng))
    hidden = cfg["hidden_size"]
    pool = layer.new_paged_cache(2, 12, 8)
    pool.assign(0, [3, 7, 1, 0])
    pool.assign(1, [9, 4, 5, 2])
    prompt = rng.standard_normal((1, 16, hidden)).astype(np.float32)
    junk = rng.standard_normal((1, 16, hidden)).astype(np.float32)
    layer(np.concatenate([prompt, junk]), rows((0, 16), (0, 16)), pool)
    pool.assign(1, [3, 7, 11, 6], length=16)  # request 0's prompt pages, then its own
    assert pool.pages(1) == [3, 7, 11, 6] and pool.lengths.tolist() == [16, 16]
    # The reference: a dense cache whose row 1 holds the same prompt K/V as row 0.
    dense = layer.new_cache(2, 32)
    layer(np.concatenate([prompt, prompt]), rows((0, 16), (0, 16)), dense)
    for step in range(3):
        x = rng.standard_normal((2, 1, hidden)).astype(np.float32)
        got = layer(x, rows((16 + step, 1), (16 + step, 1)), pool)
        want = layer(x, rows((16 + step, 1), (16 + step, 1)), dense)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    before = (pool.keys.copy(), pool.values.copy(), pool.lengths.copy())
    x = rng.standard_normal((2, 2, hidden)).astype(np.float32)
    raises(ValueError, "positions: row 1 writes into page 7", layer, x, rows((19, 2), (14, 2)),
           pool)
    assert all(np.array_equal(a, b) for a, b in zip(before, (pool.keys, pool.values, pool.lengths)))
    raises(ValueError, "pages: [1] = 12 must be in [0, num_blocks = 12)", pool.assign, 0, [1, 12])
    raises(ValueError, "pages: page 1 is named twice", pool.assign, 0, [1, 2, 1])
    raises(ValueError, "length: must be in [0, 16]", pool.assign, 0, [1, 2], 17)
    raises(ValueError, "cache: a dense cache", dense.assign, 0, [1])


def test_float32_input_into_a_bfloat16_layer(rng):
    """x in another float dtype is rounded to the layer's; the output is the layer's dtype."""
    if BF16 is None:
        pytest.skip("ml_dtypes is not installed")
    run_conversation(make_config("gqa_everything", "bfloat16", rng), rng, x_dtype="float32")


def test_decode_chunks_match_one_prefill(rng):
    """Token by token through the decode kernel equals one prefill of the same tokens, up to
    float32 summation order."""
    cfg = make_config("gqa_everything", "float32", rng)
    layer = make_layer(cfg, make_weights(cfg, rng))
    x = rng.standard_normal((1, 30, cfg["hidden_size"])).astype(np.float32)
    whole = layer(x, rows((0, 30)), layer.new_cache(1, 30))
    cache = layer.new_cache(1, 30)
    steps = [layer(x[:, i : i + 1], rows((i, 1)), cache) for i in range(30)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, rtol=0, atol=1e-5)


def test_threads_do_not_change_the_result(rng):
    """The attention is bitwise the same for any thread count; the projections' GEMMs may sum in
    another order with another thread split (OpenBLAS's Haswell kernel, which the machine forces
    through OPENBLAS_CORETYPE on a Zen 4 EPYC: 1 of 5120 outputs moved by 1.2e-6, 5.7e-7
    relative), so the outputs agree to a few float32 roundings."""
    cfg = make_config("mqa", "float32", rng)
    layer = make_layer(cfg, make_weights(cfg, rng))
    x = rng.standard_normal((2, 40, cfg["hidden_size"])).astype(np.float32)
    one = layer(x, rows((0, 40), (0, 40)), layer.new_cache(2, 64), num_threads=1)
    two = layer(x, rows((0, 40), (0, 40)), layer.new_cache(2, 64), num_threads=2)
    np.testing.assert_allclose(one, two, rtol=4e-6, atol=1e-6)


def test_api_surface(rng):
    cfg = make_config("gqa_everything", "float32", rng)
    layer = make_layer(cfg)
    assert not layer.has_weights and "no weights yet" in repr(layer)
    assert (layer.hidden_size, layer.num_heads, layer.num_kv_heads, layer.head_dim) == (32, 4, 2, 8)
    assert layer.dtype == "float32"
    cache = layer.new_cache(3, 16)  # caches depend on the shapes only: fine before the weights
    assert (cache.batch, cache.max_len, cache.kv_heads, cache.head_dim) == (3, 16, 2, 8)
    assert cache.dtype == "float32" and cache.lengths.tolist() == [0, 0, 0]
    assert cache.keys.shape == (3, 2, 16, 8) and not cache.keys.flags.writeable
    layer.set_weights(**make_weights(cfg, rng))
    assert layer.has_weights
    layer(np.ones((3, 4, 32), np.float32), rows((0, 4), (0, 4), (0, 4)), cache)
    assert cache.lengths.tolist() == [4, 4, 4]
    cache.reset(1)
    assert cache.lengths.tolist() == [4, 0, 4]
    cache.reset()
    assert cache.lengths.tolist() == [0, 0, 0]
    assert "lengths=[0, 0, 0]" in repr(cache)
    assert flashcte.AttentionLayer(64, 4, 4).head_dim == 16  # head_dim None: hidden / heads
    assert flashcte.AttentionLayer(8, 2, 1, 4, dtype=np.float16).dtype == "float16"
    assert flashcte.AttentionLayer(8, 2, 1, 4, rope_scaling={"rope_type": "default"})
    backend = flashcte.layer_gemm_backend()
    assert isinstance(backend, str) and backend


def test_positions_of_any_integer_type(rng):
    cfg = make_config("mqa", "float32", rng)
    weights = make_weights(cfg, rng)
    x = rng.standard_normal((1, 5, cfg["hidden_size"])).astype(np.float32)
    layer = make_layer(cfg, weights)
    want = layer(x, rows((0, 5)), layer.new_cache(1, 8))
    for positions in (rows((0, 5)).astype(np.int32), [[0, 1, 2, 3, 4]], rows((0, 5))[:, ::1]):
        np.testing.assert_array_equal(layer(x, positions, layer.new_cache(1, 8)), want)


class DLPackOnly:
    """A minimal DLPack producer that is neither numpy nor torch."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_generic_dlpack_input(rng):
    cfg = make_config("mqa", "float32", rng)
    layer = make_layer(cfg, make_weights(cfg, rng))
    x = rng.standard_normal((1, 5, cfg["hidden_size"])).astype(np.float32)
    want = layer(x, rows((0, 5)), layer.new_cache(1, 8))
    got = layer(DLPackOnly(x), DLPackOnly(rows((0, 5))), layer.new_cache(1, 8))
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, want)


def spin(seconds: float) -> float:
    """Iterations per second of a pure-Python loop, over `seconds`."""
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        count += 1
    return count / seconds


def test_gil_released(rng):
    """Python threads run while the layer computes: the main thread's loop keeps a good part of
    its speed during a forward call (holding the GIL would stop it but for the interpreter's
    switch interval around the call's Python part)."""
    cfg = {"hidden_size": 1024, "num_heads": 16, "num_kv_heads": 4, "head_dim": 64}
    cfg.update(dtype="float32", sinks=None)
    layer = make_layer(cfg, make_weights(cfg, rng))
    x = rng.standard_normal((1, 2048, 1024)).astype(np.float32)
    positions = rows((0, 2048))
    t0 = time.perf_counter()
    layer(x, positions, layer.new_cache(1, 2048), num_threads=1)
    if time.perf_counter() - t0 < 0.1:
        pytest.skip("layer too fast on this machine to observe the GIL")
    alone = spin(0.05)
    worker = threading.Thread(
        target=layer, args=(x, positions, layer.new_cache(1, 2048)), kwargs={"num_threads": 1}
    )
    count = 0
    t0 = time.perf_counter()  # before start(): it waits for the worker, which may hold the GIL
    worker.start()
    while worker.is_alive():
        count += 1
    during = count / (time.perf_counter() - t0)
    worker.join()
    assert during > 0.1 * alone, (
        f"main thread ran at {during:.3g} steps/s during forward, {alone:.3g} alone"
    )


# --- torch ----------------------------------------------------------------------------------


def torch_or_skip():
    return pytest.importorskip("torch", reason="PyTorch is not installed (optional interop tests)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_torch_in_torch_out(dtype, rng):
    torch = torch_or_skip()
    if dtype == "bfloat16" and BF16 is None:
        pytest.skip("ml_dtypes is not installed")
    cfg = make_config("gqa_everything", dtype, rng)
    weights = make_weights(cfg, rng)
    numpy_layer = make_layer(cfg, weights)
    # Weights as torch parameters (requires_grad, the nn.Linear layout) in the layer's dtype: the
    # layer rounds float32 weights to it anyway, so both layers hold the same values.
    torch_weights = {
        k: None if v is None else torch.nn.Parameter(torch.from_numpy(v).to(getattr(torch, dtype)))
        for k, v in weights.items()
    }
    torch_layer = make_layer(cfg, torch_weights)
    numpy_cache, torch_cache = numpy_layer.new_cache(2, 96), torch_layer.new_cache(2, 96)
    for what, positions in CONVERSATION[:6]:
        x = rng.standard_normal((2, positions.shape[1], cfg["hidden_size"])).astype(np_dtype(dtype))
        xt = torch.from_numpy(x.astype(np.float32)).to(getattr(torch, dtype)).requires_grad_()
        y = numpy_layer(x, positions, numpy_cache)
        yt = torch_layer(xt, torch.from_numpy(positions), torch_cache)
        assert isinstance(yt, torch.Tensor) and yt.dtype == getattr(torch, dtype), what
        assert yt.shape == (2, positions.shape[1], cfg["hidden_size"])
        np.testing.assert_array_equal(yt.float().numpy(), f64(y).astype(np.float32), err_msg=what)


def test_torch_strided_input(rng):
    torch = torch_or_skip()
    cfg = make_config("mqa", "float32", rng)
    layer = make_layer(cfg, make_weights(cfg, rng))
    x = torch.randn(2, 7, 3 * cfg["hidden_size"])[:, :, ::3]  # a strided view
    want = layer(x.contiguous().numpy(), rows((0, 7), (0, 7)), layer.new_cache(2, 8))
    got = layer(x, torch.tensor(rows((0, 7), (0, 7)), dtype=torch.int32), layer.new_cache(2, 8))
    np.testing.assert_array_equal(got.numpy(), want)


def test_matches_transformers_llama_attention(rng):
    """Hugging Face's LlamaAttention (eager, Llama-3 rope scaling) on a prefill, when installed."""
    torch = torch_or_skip()
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from transformers.models.llama import modeling_llama

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=500000.0,
        rope_scaling=dict(scaling),
        max_position_embeddings=256,
        attention_bias=False,
    )
    config._attn_implementation = "eager"
    try:
        attention = modeling_llama.LlamaAttention(config, layer_idx=0).eval()
        rotary = modeling_llama.LlamaRotaryEmbedding(config=config)
    except TypeError as e:  # pragma: no cover - an older transformers API
        pytest.skip(f"transformers {transformers.__version__}: {e}")
    tokens = 48
    x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(5))
    positions = torch.arange(tokens)[None]
    cos, sin = rotary(x, positions)
    mask = torch.full((tokens, tokens), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = attention(x, position_embeddings=(cos, sin), attention_mask=mask)[0]
    layer = flashcte.AttentionLayer(64, 4, 2, 16, rope_theta=500000.0, rope_scaling=scaling)
    layer.set_weights(
        attention.q_proj.weight,
        attention.k_proj.weight,
        attention.v_proj.weight,
        attention.o_proj.weight,
    )
    got = layer(x, positions, layer.new_cache(1, tokens))
    assert isinstance(got, torch.Tensor)
    assert_layer_close(got.numpy(), want.double().numpy(), "float32", "LlamaAttention")


# --- bad input ------------------------------------------------------------------------------


def raises(exc, prefix, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert str(info.value).startswith(prefix), str(info.value)
    return str(info.value)


@pytest.fixture
def small(rng):
    cfg = {"hidden_size": 16, "num_heads": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32"}
    layer = make_layer(cfg, make_weights(cfg, rng))
    return layer, layer.new_cache(1, 8)


def test_forward_before_set_weights():
    layer = flashcte.AttentionLayer(16, 2, 1, 8)
    cache = layer.new_cache(1, 8)
    raises(
        RuntimeError,
        "AttentionLayer: no weights yet",
        layer,
        np.zeros((1, 1, 16), np.float32),
        [[0]],
        cache,
    )


def test_bad_positions(small):
    layer, cache = small
    x = np.zeros((1, 5, 16), np.float32)
    raises(
        ValueError,
        "positions: row 0 token 0 is 1; a row must start in [0, cached length = 0]",
        layer,
        x[:, :2],
        [[1, 2]],
        cache,
    )
    raises(
        ValueError,
        "positions: row 0 token 1 is 2; positions within a row must go up by 1",
        layer,
        x[:, :2],
        [[0, 2]],
        cache,
    )
    layer(x[:, :4], rows((0, 4)), cache)
    raises(
        ValueError,
        "positions: row 0 token 0 is 5; a row must start in [0, cached length = 4]",
        layer,
        x[:, :1],
        [[5]],
        cache,
    )  # skipping slot 4
    raises(
        ValueError,
        "positions: row 0 token 4 is 8, past the cache's max_len = 8",
        layer,
        x,
        rows((4, 5)),
        cache,
    )
    assert cache.lengths.tolist() == [4]  # failed calls add no tokens
    raises(
        ValueError,
        "positions: must be an int64 tensor of shape (batch, T) = (1, 5)",
        layer,
        x,
        rows((4, 4)),
        cache,
    )
    raises(
        ValueError,
        "positions: must be an int64 tensor of shape (batch, T) = (1, 5)",
        layer,
        x,
        np.arange(4, 9),
        cache,
    )
    raises(
        TypeError,
        "positions: dtype must be int64, got float64",
        layer,
        x,
        rows((4, 5)).astype(np.float64),
        cache,
    )
    layer(x[:, :2], rows((2, 2)), cache)  # an earlier start rewrites slots 2, 3
    assert cache.lengths.tolist() == [4]


def test_bad_x(small):
    layer, cache = small
    raises(
        ValueError,
        "x: must have rank 3 (batch, T, hidden_size), got rank 2",
        layer,
        np.zeros((4, 16), np.float32),
        rows((0, 4)),
        cache,
    )
    raises(
        ValueError,
        "x: last dimension 15 must be hidden_size = 16",
        layer,
        np.zeros((1, 4, 15), np.float32),
        rows((0, 4)),
        cache,
    )
    raises(
        TypeError,
        "x: dtype must be float32, float16 or bfloat16, got int64",
        layer,
        np.zeros((1, 4, 16), np.int64),
        rows((0, 4)),
        cache,
    )
    raises(
        TypeError,
        "x: expected a numpy array or a DLPack tensor",
        layer,
        [[[0.0] * 16]],
        rows((0, 1)),
        cache,
    )


def test_cache_of_another_layer(small, rng):
    layer, _ = small
    x = np.zeros((1, 1, 16), np.float32)
    other = flashcte.AttentionLayer(16, 2, 2, 8)  # 2 KV heads
    raises(
        ValueError,
        "cache: holds (batch 1, kv_heads 2, head_dim 8, float32) but this call "
        "needs (batch 1, kv_heads 1",
        layer,
        x,
        [[0]],
        other.new_cache(1, 8),
    )
    raises(
        ValueError,
        "cache: holds (batch 1, kv_heads 1, head_dim 4",
        layer,
        x,
        [[0]],
        flashcte.AttentionLayer(8, 2, 1, 4).new_cache(1, 8),
    )
    raises(
        ValueError,
        "cache: holds (batch 1, kv_heads 1, head_dim 8, bfloat16)",
        layer,
        x,
        [[0]],
        flashcte.AttentionLayer(16, 2, 1, 8, dtype="bfloat16").new_cache(1, 8),
    )
    raises(ValueError, "cache: holds (batch 2,", layer, x, [[0]], layer.new_cache(2, 8))
    raises(TypeError, "cache: expected a flashcte.KvCache", layer, x, [[0]], object())


def test_bad_config():
    L = flashcte.AttentionLayer
    raises(ValueError, "num_kv_heads: must divide num_heads", L, 16, 4, 3, 4)
    raises(ValueError, "hidden_size: must be >= 1", L, 0, 4, 2, 4)
    raises(ValueError, "rotary_dim: must be even", L, 16, 2, 1, 8, rotary_dim=5)
    raises(ValueError, "rotary_dim: must be even", L, 16, 2, 1, 8, rotary_dim=10)
    raises(ValueError, "rope_theta: must be finite and > 0", L, 16, 2, 1, 8, rope_theta=0)
    raises(ValueError, "sliding_window: must be >= 0", L, 16, 2, 1, 8, sliding_window=-1)
    raises(ValueError, "qk_scale: must not be 0", L, 16, 2, 1, 8, qk_scale=0)
    raises(
        TypeError,
        "dtype: must be float32, bfloat16 or float16, got 'int8'",
        L,
        16,
        2,
        1,
        8,
        dtype="int8",
    )
    raises(TypeError, "hidden_size: must be an int", L, 16.5, 2, 1, 8)
    raises(
        ValueError,
        "rope_scaling: rope_type 'yarn' is not supported",
        L,
        16,
        2,
        1,
        8,
        rope_scaling={"rope_type": "yarn", "factor": 4.0},
    )
    raises(
        ValueError,
        "rope_scaling: rope_type 'linear' is not supported",
        L,
        16,
        2,
        1,
        8,
        rope_scaling={"type": "linear", "factor": 2.0},
    )
    raises(
        ValueError,
        "rope_scaling: unknown keys ['beta_fast']",
        L,
        16,
        2,
        1,
        8,
        rope_scaling={"rope_type": "llama3", "beta_fast": 32},
    )
    # transformers 5's rope_parameters carry rope_theta: it must agree.
    raises(
        ValueError,
        "rope_scaling: holds rope_theta 500000, but the layer's rope_theta is 10000",
        L,
        16,
        2,
        1,
        8,
        rope_scaling={"rope_type": "llama3", "rope_theta": 500000.0},
    )
    assert L(16, 2, 1, 8, rope_theta=5e5, rope_scaling={"rope_type": "default", "rope_theta": 5e5})
    raises(
        ValueError,
        "rope_scaling: low_freq_factor and high_freq_factor must differ",
        L,
        16,
        2,
        1,
        8,
        rope_scaling={"rope_type": "llama3", "low_freq_factor": 2.0, "high_freq_factor": 2.0},
    )
    raises(TypeError, "rope_scaling: expected None or a dict", L, 16, 2, 1, 8, rope_scaling=8.0)
    raises(
        ValueError,
        "rope_scaling, rotary_dim: given, but rope=False",
        L,
        16,
        2,
        1,
        8,
        rope=False,
        rotary_dim=4,
    )
    raises(
        ValueError,
        "sinks: shape (3,) must be (num_heads,) = (2,)",
        L,
        16,
        2,
        1,
        8,
        sinks=np.zeros(3),
    )


def test_bad_weights(rng):
    cfg = {
        "hidden_size": 16,
        "num_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 4,
        "dtype": "float32",
        "qkv_bias": True,
    }
    w = make_weights(cfg, rng)
    layer = make_layer(cfg)
    raises(
        ValueError,
        "k_proj: shape (16, 4) must be (out_features, in_features) = (4, 16); this "
        "is the transpose",
        layer.set_weights,
        **dict(w, k_proj=w["k_proj"].T),
    )
    raises(
        ValueError,
        "q_proj: shape (8, 15) must be",
        layer.set_weights,
        **dict(w, q_proj=w["q_proj"][:, :15]),
    )
    raises(
        ValueError,
        "q_bias: required, the layer was built with qkv_bias=True",
        layer.set_weights,
        **dict(w, q_bias=None),
    )
    raises(
        ValueError,
        "o_bias: given, but the layer was built with o_bias=False",
        layer.set_weights,
        **dict(w, o_bias=np.zeros(16)),
    )
    raises(
        ValueError,
        "v_bias: shape (5,) must be (out_features,) = (4,)",
        layer.set_weights,
        **dict(w, v_bias=np.zeros(5)),
    )
    bad = w["q_proj"].copy()
    bad[1, 2] = np.nan
    raises(ValueError, "q_proj: element 18 is not finite", layer.set_weights, **dict(w, q_proj=bad))
    raises(
        TypeError,
        "o_proj: dtype must be a float type, got bool",
        layer.set_weights,
        **dict(w, o_proj=w["o_proj"] > 0),
    )
    assert not layer.has_weights  # a failed set_weights keeps the layer as it was
    layer.set_weights(**w)
    assert layer.has_weights


def test_bad_cache_use(small):
    layer, cache = small
    raises(ValueError, "b: must be in [0, batch = 1), got 1", cache.reset, 1)
    raises(ValueError, "max_len: must be >= 1, got 0", layer.new_cache, 1, 0)
    raises(ValueError, "batch: must be >= 1, got 0", layer.new_cache, 0, 8)
    with pytest.raises(ValueError):
        cache.keys[0, 0, 0, 0] = 1.0  # read-only view
