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

The model and the helpers: layer_model.py; bad input: test_layer_bad_inputs.py.
"""

from __future__ import annotations

import threading
import time

import flashcte
import numpy as np
import pytest
from conftest import np_dtype
from layer_model import (
    CONFIGS,
    CONVERSATION,
    assert_layer_close,
    make_config,
    make_layer,
    make_weights,
    raises,
    rows,
    run_conversation,
    snap,
)
from semantics import BF16, f64


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
