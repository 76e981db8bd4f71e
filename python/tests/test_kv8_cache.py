"""8-bit KV caches through the Python entry points: flash_attn_with_kvcache (numpy with ml_dtypes'
float8 types and int8, torch int8 / float8 tensors, the torch operator), its append quantizing
as quantize_kv does, and paged_attention over vLLM's layout with an fp8 cache. Against the
float64 reference (semantics.flash_attn_ref) on the dequantized cache."""

import numpy as np
import pytest

import flashcte
from semantics import flash_attn_ref

ml_dtypes = pytest.importorskip("ml_dtypes")

FORMATS = {
    "int8": np.dtype(np.int8),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
BATCH, HEADS, HEADS_K, D, CACHE = 2, 4, 2, 32, 40


def cache8(rng, fmt, granularity):
    """An 8-bit (batch, cache, heads_k, d) cache of random codes and its scales."""
    codes = rng.standard_normal((BATCH, CACHE, HEADS_K, D)) * (40 if fmt == "int8" else 100)
    if fmt == "int8":
        cache = np.clip(np.rint(codes), -127, 127).astype(np.int8)
    else:
        cache = codes.astype(FORMATS[fmt])
    if granularity == "tensor":
        scale = np.array([0.02], np.float32)
    elif granularity == "head":
        scale = np.array([0.01, 0.03], np.float32)
    else:
        scale = rng.uniform(0.005, 0.03, (BATCH, CACHE, HEADS_K)).astype(np.float32)
    return cache, scale


def dequantized(cache, scale):
    s = scale.astype(np.float64)
    s = s[..., None] if s.ndim == 3 else (s[None, None, :, None] if s.size > 1 else s[0])
    return cache.astype(np.float64) * s


def reference(q, k, v, seqlens, new):
    """Per sequence, bottom-right causal over its seqlen + new slots."""
    outs = []
    for b in range(q.shape[0]):
        n = seqlens[b] + new
        out, _ = flash_attn_ref(q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n], causal=True)
        outs.append(out[0])
    return np.stack(outs)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("granularity", ["tensor", "head", "token"])
@pytest.mark.parametrize("seqlen", [2, 20])
def test_numpy_append_quantizes_and_attends(rng, fmt, granularity, seqlen):
    k_cache, k_scale = cache8(rng, fmt, granularity)
    v_cache, v_scale = cache8(rng, fmt, "token" if granularity == "tensor" else "tensor")
    q = rng.standard_normal((BATCH, seqlen, HEADS, D)).astype(np.float32)
    k = rng.standard_normal((BATCH, seqlen, HEADS_K, D)).astype(np.float32)
    v = rng.standard_normal((BATCH, seqlen, HEADS_K, D)).astype(np.float32)
    seqlens = np.array([7, 15], np.int32)
    # The append's oracle: quantize_kv on each sequence's new rows, into copies.
    k_want, v_want = k_cache.copy(), v_cache.copy()
    ks_want, vs_want = k_scale.copy(), v_scale.copy()
    for b in range(BATCH):
        rows = slice(seqlens[b], seqlens[b] + seqlen)
        for src, dst, sc in ((k, k_want, ks_want), (v, v_want, vs_want)):
            flashcte.quantize_kv(src[b], dst[b, rows], sc[b, rows] if sc.ndim == 3 else sc)
    out = flashcte.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True, k_scale=k_scale,
        v_scale=v_scale,
    )
    np.testing.assert_array_equal(k_cache.view(np.uint8), k_want.view(np.uint8))
    np.testing.assert_array_equal(v_cache.view(np.uint8), v_want.view(np.uint8))
    np.testing.assert_array_equal(k_scale, ks_want)
    np.testing.assert_array_equal(v_scale, vs_want)
    want = reference(q, dequantized(k_cache, k_scale), dequantized(v_cache, v_scale), seqlens,
                     seqlen)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("granularity", ["tensor", "head", "token"])
def test_read_only_scales_without_an_append(rng, granularity):
    """Nothing appended, nothing written: read-only caches and scales are taken (a fuzzer
    finding of issue 41: the scales were refused as not writable)."""
    k_cache, k_scale = cache8(rng, "int8", granularity)
    v_cache, v_scale = cache8(rng, "float8_e4m3fn", granularity)
    for a in (k_cache, v_cache, k_scale, v_scale):
        a.flags.writeable = False
    q = rng.standard_normal((BATCH, 3, HEADS, D)).astype(np.float32)
    seqlens = np.array([CACHE, 11], np.int32)
    out = flashcte.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, causal=True, k_scale=k_scale, v_scale=v_scale
    )
    want = reference(q, dequantized(k_cache, k_scale), dequantized(v_cache, v_scale), seqlens - 3, 3)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    # With an append the scales are written where per token, so they must be writable then.
    if granularity == "token":
        k = rng.standard_normal((BATCH, 1, HEADS_K, D)).astype(np.float32)
        kc, vc = k_cache.copy(), v_cache.copy()
        with pytest.raises(ValueError, match="^k_scale: must be a writable array"):
            flashcte.flash_attn_with_kvcache(
                q[:, :1], kc, vc, k, k, cache_seqlens=seqlens - 1, k_scale=k_scale,
                v_scale=v_scale,
            )
        np.testing.assert_array_equal(kc.view(np.uint8), k_cache.view(np.uint8))


def test_torch_caches_and_the_operator(rng):
    torch = pytest.importorskip("torch")
    import flashcte.torch as ft

    for fmt in ("int8", "float8_e4m3fn", "float8_e5m2"):
        k_np, ks = cache8(rng, fmt, "token")
        v_np, vs = cache8(rng, fmt, "head")
        torch_dtype = getattr(torch, fmt)
        k_cache = torch.from_numpy(k_np.view(np.uint8).copy()).view(torch_dtype)
        v_cache = torch.from_numpy(v_np.view(np.uint8).copy()).view(torch_dtype)
        k_scale, v_scale = torch.from_numpy(ks.copy()), torch.from_numpy(vs.copy())
        q = torch.randn(BATCH, 3, HEADS, D)
        k, v = torch.randn(BATCH, 3, HEADS_K, D), torch.randn(BATCH, 3, HEADS_K, D)
        seqlens = torch.tensor([4, 30], dtype=torch.int32)
        out = ft.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True, k_scale=k_scale,
            v_scale=v_scale,
        )
        assert out.dtype == torch.float32
        kd = dequantized(k_cache.view(torch.uint8).numpy().view(FORMATS[fmt]), k_scale.numpy())
        vd = dequantized(v_cache.view(torch.uint8).numpy().view(FORMATS[fmt]), v_scale.numpy())
        # The append wrote through the operator: the new slots hold the new rows' codes.
        assert not np.array_equal(k_scale.numpy(), ks)
        want = reference(q.numpy(), kd, vd, seqlens.numpy(), 3)
        np.testing.assert_allclose(out.numpy(), want, atol=1e-5, rtol=1e-5)


def test_paged_attention_over_a_vllm_fp8_cache(rng):
    """vLLM's (num_blocks, heads_k, block_size, d) fp8 cache with one scale per tensor."""
    block, pages = 4, BATCH * CACHE // 4
    k_dense, _ = cache8(rng, "float8_e4m3fn", "tensor")
    v_dense, _ = cache8(rng, "float8_e4m3fn", "tensor")
    table = rng.permutation(pages).astype(np.int32).reshape(BATCH, CACHE // block)
    key_cache = np.zeros((pages, HEADS_K, block, D), FORMATS["float8_e4m3fn"])
    value_cache = np.zeros_like(key_cache)
    for b in range(BATCH):
        for j in range(CACHE):
            key_cache[table[b, j // block], :, j % block] = k_dense[b, j]
            value_cache[table[b, j // block], :, j % block] = v_dense[b, j]
    seq_lens = np.array([9, 33], np.int32)
    starts = np.array([0, 1, 7], np.int32)
    query = rng.standard_normal((7, HEADS, D)).astype(np.float32)
    out = flashcte.paged_attention(
        query, key_cache, value_cache, table, seq_lens, starts, D**-0.5, k_scale=0.02,
        v_scale=0.05,
    )
    kd, vd = k_dense.astype(np.float64) * np.float32(0.02), v_dense.astype(np.float64) * np.float32(0.05)
    for b in range(BATCH):
        n = seq_lens[b]
        q = query[starts[b] : starts[b + 1]][None]
        want, _ = flash_attn_ref(q, kd[b : b + 1, :n], vd[b : b + 1, :n], causal=True)
        np.testing.assert_allclose(out[starts[b] : starts[b + 1]], want[0], atol=1e-5, rtol=1e-5)


def test_refusals_name_the_argument_and_leave_the_cache(rng):
    k_cache, k_scale = cache8(rng, "int8", "token")
    v_cache, v_scale = cache8(rng, "int8", "token")
    before = (k_cache.copy(), v_cache.copy(), k_scale.copy(), v_scale.copy())
    q = rng.standard_normal((BATCH, 2, HEADS, D)).astype(np.float32)
    k = rng.standard_normal((BATCH, 2, HEADS_K, D)).astype(np.float32)
    v = k.copy()
    v[1, 1, 0, 3] = np.nan  # int8 holds no NaN
    seqlens = np.array([3, 4], np.int32)
    with pytest.raises(ValueError, match=r"^v: element \(1, 1, 0, 3\) is NaN"):
        flashcte.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                         k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="^k_scale: is required"):
        flashcte.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                         v_scale=v_scale)
    with pytest.raises(ValueError, match=r"^k_scale: entry 0 = 0\.0+ must be finite and > 0"):
        flashcte.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k_scale=0.0,
                                         v_scale=v_scale)
    for got, want in zip((k_cache, v_cache, k_scale, v_scale), before):
        np.testing.assert_array_equal(got, want)
