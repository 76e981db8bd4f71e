#!/usr/bin/env python3
"""SHA-256 of the outputs of a fixed set of calls through every public entry point, one line each.

For refactors that must not change a bit of any result: run it before and after and diff.

    build/python-venv/bin/python scripts/output_hashes.py > before.txt
    ... change, rebuild (python/run_tests.sh python/tests/test_checks.py) ...
    build/python-venv/bin/python scripts/output_hashes.py | diff before.txt -

Inputs come from a fixed seed; results are bitwise the same for any thread count, so the hashes
depend only on the library and the SIMD target it dispatched to (printed first).
"""

from __future__ import annotations

import hashlib

import flashcte
import numpy as np

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
    E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
except ImportError:  # the bf16 and fp8 calls need ml_dtypes
    BF16 = E4M3 = None


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str(a.dtype).encode() + str(a.shape).encode() + a.tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    rng = np.random.default_rng(42)

    def r(*shape, dtype=np.float32):
        return rng.standard_normal(shape).astype(np.float32).astype(dtype)

    calls = {}
    # attention_cte, rank 3 (Neuron layouts) and FlashAttention's dense call.
    q, k, v = r(4, 96, 64), r(2, 64, 160), r(2, 160, 64)
    calls["attention_cte"] = lambda: flashcte.attention_cte(q, k, v, 0.125, True, sliding_window=40)
    fq, fk, fv = r(2, 70, 4, 64), r(2, 90, 2, 64), r(2, 90, 2, 64)
    calls["flash_attn_func"] = lambda: flashcte.flash_attn_func(
        fq, fk, fv, causal=True, softcap=5.0, return_softmax_lse=True
    )
    calls["flash_attn_func_window"] = lambda: flashcte.flash_attn_func(
        fq, fk, fv, window_size=(16, 3), alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    )
    # Varlen, packed.
    cu = np.array([0, 1, 40, 41, 100], np.int32)
    vq, vk, vv = r(100, 4, 64), r(100, 2, 64), r(100, 2, 64)
    calls["flash_attn_varlen_func"] = lambda: flashcte.flash_attn_varlen_func(
        vq, vk, vv, cu, cu, 59, 59, causal=True, return_softmax_lse=True
    )
    # KV cache: append (rotary) and attend, dense; decode of one token.
    cache_k, cache_v = r(3, 300, 2, 64), r(3, 300, 2, 64)
    seqlens = np.array([0, 17, 250], np.int32)

    def kvcache(tokens):
        ck, cv = cache_k.copy(), cache_v.copy()
        out = flashcte.flash_attn_with_kvcache(
            r(3, tokens, 4, 64), ck, cv, r(3, tokens, 2, 64), r(3, tokens, 2, 64),
            cache_seqlens=seqlens.copy(), causal=True,
        )
        return out, ck, cv

    calls["flash_attn_with_kvcache_prefill"] = lambda: kvcache(20)
    calls["flash_attn_with_kvcache_decode"] = lambda: kvcache(1)
    # Paged mixed batch (vLLM shapes): a decode, a prefill chunk, a whole prompt.
    pages_k, pages_v = r(40, 2, 16, 64), r(40, 2, 16, 64)
    table = rng.permutation(40)[:30].astype(np.int32).reshape(3, 10)
    lens = np.array([100, 60, 33], np.int32)
    qsl = np.array([0, 1, 21, 54], np.int32)
    pq = r(54, 4, 64)
    calls["paged_attention"] = lambda: flashcte.paged_attention(
        pq, pages_k, pages_v, table, lens, qsl, 0.125, sinks=r(4)
    )
    if BF16 is not None:
        bq, bk, bv = r(2, 70, 4, 64, dtype=BF16), r(2, 90, 2, 64, dtype=BF16), r(2, 90, 2, 64, dtype=BF16)
        calls["flash_attn_func_bf16"] = lambda: flashcte.flash_attn_func(bq, bk, bv, causal=True)
        codes = np.empty((40, 2, 16, 64), E4M3)
        scale = np.array([0.05], np.float32)

        def paged_fp8():
            ck, cv = codes.copy(), codes.copy()
            flashcte.quantize_kv(pages_k.reshape(-1, 2, 64), ck.reshape(-1, 2, 64), scale)
            flashcte.quantize_kv(pages_v.reshape(-1, 2, 64), cv.reshape(-1, 2, 64), scale)
            return flashcte.paged_attention(
                pq, ck, cv, table, lens, qsl, 0.125, k_scale=scale, v_scale=scale
            )

        calls["paged_attention_fp8"] = paged_fp8
    # The layer: a prefill and a decode step over its cache.
    hidden, heads, kv_heads, d = 128, 4, 2, 32
    weights = {
        "q_proj": r(heads * d, hidden) * 0.1,
        "k_proj": r(kv_heads * d, hidden) * 0.1,
        "v_proj": r(kv_heads * d, hidden) * 0.1,
        "o_proj": r(hidden, heads * d) * 0.1,
    }
    x = r(2, 24, hidden)

    def layer():
        lay = flashcte.AttentionLayer(hidden, heads, kv_heads, d)
        lay.set_weights(**weights)
        cache = lay.new_cache(2, 64)
        y0 = lay(x, np.tile(np.arange(24), (2, 1)), cache)
        y1 = lay(x[:, -1:], np.full((2, 1), 24), cache)
        return y0, y1

    calls["AttentionLayer"] = layer

    # Chunks of more than 16 queries per sequence over caches with every option the prefill
    # kernel takes from them (inputs drawn when the call runs, after the calls above).
    def kvcache_prefill_options():
        ck, cv = r(4, 120, 2, 64), r(4, 120, 2, 64)
        out, lse = flashcte.flash_attn_with_kvcache(
            r(3, 24, 4, 64), ck, cv, r(3, 24, 2, 64), r(3, 24, 2, 64),
            cache_seqlens=np.array([30, 40, 60], np.int32),
            cache_batch_idx=np.array([2, 0, 3], np.int32),
            cache_leftpad=np.array([0, 5, 10], np.int32),
            causal=True, window_size=(20, 0), softcap=4.0,
            alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4], np.float32), return_softmax_lse=True,
        )
        return out, lse, ck, cv

    calls["kvcache_prefill_options"] = kvcache_prefill_options

    def kvcache_paged_int8_per_token():
        blocks, page = r(30, 8, 2, 64), 8
        ck, cv = np.empty(blocks.shape, np.int8), np.empty(blocks.shape, np.int8)
        ks, vs = np.empty((30, 8, 2), np.float32), np.empty((30, 8, 2), np.float32)
        flashcte.quantize_kv(blocks.reshape(-1, 2, 64), ck.reshape(-1, 2, 64), ks.reshape(-1, 2))
        flashcte.quantize_kv(r(240, 2, 64), cv.reshape(-1, 2, 64), vs.reshape(-1, 2))
        table = rng.permutation(30)[:28].astype(np.int32).reshape(2, 14)
        out = flashcte.flash_attn_with_kvcache(
            r(2, 20, 4, 64), ck, cv, r(2, 20, 2, 64), r(2, 20, 2, 64),
            cache_seqlens=np.array([50, 3], np.int32), block_table=table, causal=True,
            k_scale=ks, v_scale=vs,
        )
        return out, ck, cv, ks, vs

    calls["kvcache_paged_int8_per_token"] = kvcache_paged_int8_per_token

    def kvcache_dense_int8_rows():
        """Dense int8 caches with per-token scales through cache_batch_idx, left padding,
        per-batch ALiBi and a causal window; a sequence whose row reads no slot (-1)."""
        values = r(3 * 90, 2, 64)
        ck, cv = np.empty((3, 90, 2, 64), np.int8), np.empty((3, 90, 2, 64), np.int8)
        ks, vs = np.empty((3, 90, 2), np.float32), np.empty((3, 90, 2), np.float32)
        flashcte.quantize_kv(values, ck.reshape(-1, 2, 64), ks.reshape(-1, 2))
        flashcte.quantize_kv(r(3 * 90, 2, 64), cv.reshape(-1, 2, 64), vs.reshape(-1, 2))
        out, lse = flashcte.flash_attn_with_kvcache(
            r(3, 18, 4, 64), ck, cv, cache_seqlens=np.array([40, 0, 70], np.int32),
            cache_batch_idx=np.array([2, 0, 1], np.int32), cache_leftpad=np.array([3, 0, 9], np.int32),
            causal=True, window_size=(30, 0), alibi_slopes=r(3, 4) * 0.1, k_scale=ks, v_scale=vs,
            return_softmax_lse=True,
        )
        return out, lse

    calls["kvcache_dense_int8_rows"] = kvcache_dense_int8_rows

    def kvcache_no_query_heads():
        ck, cv = r(2, 40, 2, 64), r(2, 40, 2, 64)
        return flashcte.flash_attn_with_kvcache(
            r(2, 20, 0, 64), ck, cv, cache_seqlens=np.array([10, 30], np.int32), causal=True
        )

    calls["kvcache_no_query_heads"] = kvcache_no_query_heads
    if E4M3 is not None:

        def paged_attention_prefill_options():
            # Quantized as (num_blocks, block_size, kv_heads, d), passed in vLLM's HND layout.
            ck, cv = np.empty((40, 16, 2, 64), E4M3), np.empty((40, 16, 2, 64), E4M3)
            ks, vs = np.array([0.03, 0.05], np.float32), np.array([0.04, 0.02], np.float32)
            flashcte.quantize_kv(r(640, 2, 64), ck.reshape(-1, 2, 64), ks)
            flashcte.quantize_kv(r(640, 2, 64), cv.reshape(-1, 2, 64), vs)
            ck, cv = ck.transpose(0, 2, 1, 3).copy(), cv.transpose(0, 2, 1, 3).copy()
            return flashcte.paged_attention(
                r(70, 4, 64), ck, cv, table, np.array([100, 60, 40], np.int32),
                np.array([0, 30, 31, 70], np.int32), 0.125, window=(50, 0), softcap=3.0,
                alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4], np.float32), sinks=r(4),
                k_scale=ks, v_scale=vs,
            )

        calls["paged_attention_prefill_options"] = paged_attention_prefill_options

        def kvcache_prefill_bf16():
            ck, cv = r(2, 100, 2, 64, dtype=BF16), r(2, 100, 2, 64, dtype=BF16)
            out = flashcte.flash_attn_with_kvcache(
                r(2, 33, 4, 64, dtype=BF16), ck, cv, r(2, 33, 2, 64, dtype=BF16),
                r(2, 33, 2, 64, dtype=BF16), cache_seqlens=np.array([40, 0], np.int32),
                causal=True,
            )
            return out, ck, cv

        calls["kvcache_prefill_bf16"] = kvcache_prefill_bf16

    print(f"simd_target {flashcte.simd_target()}")
    for name, fn in calls.items():
        out = fn()
        print(f"{name} {digest(*(out if isinstance(out, tuple) else (out,)))}")


if __name__ == "__main__":
    main()
