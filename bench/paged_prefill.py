#!/usr/bin/env python3
"""bench/paged_prefill.py: a prefill chunk over a cached prior, the prior in a paged cache
(or an 8-bit cache) against the same rows in a dense cache of the activation dtype, through
flashcte.flash_attn_with_kvcache (chunks longer than 16 queries run on attention_cte with the
cache as its prior, packed from the pages).

    build/python-venv/bin/python bench/paged_prefill.py                  # 2048 over 8192
    build/python-venv/bin/python bench/paged_prefill.py --chunk 1024 --prior 4096 --blocks 16
    build/python-venv/bin/python bench/paged_prefill.py --blocks --kv8 int8 float8_e4m3fn

--kv8 adds dense 8-bit caches of the same rows (quantize_kv, one scale per token and head).

Each round times the dense call and every paged call once, in a rotating order; it prints the
medians and, per block size, the median over rounds of the dense time over the paged time of the
same round (>= 1: as fast as the dense cache). Pages sit at shuffled places in the pool, as a serving
engine's allocator leaves them. Causal, 32/8 heads, d = 128 by default; the chunk's own keys are
in the cache already (cache_seqlens = prior + chunk, no append), so every call reads the same
bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import flashcte


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--prior", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--blocks", type=int, nargs="*", default=[16, 128])
    p.add_argument("--kv8", nargs="*", default=[],
                   choices=["int8", "float8_e4m3fn", "float8_e5m2"])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args()


def np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def main():
    a = parse_args()
    rng = np.random.default_rng(0)
    total = a.prior + a.chunk
    print(f"flashcte {flashcte.simd_target()}, threads {a.threads or os.cpu_count()}, "
          f"chunk {a.chunk} over prior {a.prior}, {a.heads}/{a.kv_heads} heads, d {a.d}, causal")
    for dtype in a.dtypes:
        dt = np_dtype(dtype)
        q = rng.standard_normal((1, a.chunk, a.heads, a.d), np.float32).astype(dt)
        dense_k = rng.standard_normal((1, total, a.kv_heads, a.d), np.float32).astype(dt)
        dense_v = rng.standard_normal((1, total, a.kv_heads, a.d), np.float32).astype(dt)
        calls = {"dense": dict(k_cache=dense_k, v_cache=dense_v)}
        for block in a.blocks:
            pages = -(-total // block)
            order = rng.permutation(pages).astype(np.int32)
            pool_k = np.zeros((pages, block, a.kv_heads, a.d), dt)
            pool_v = np.zeros_like(pool_k)
            for i in range(pages):
                rows = slice(i * block, min(total, (i + 1) * block))
                n = rows.stop - rows.start
                pool_k[order[i], :n] = dense_k[0, rows]
                pool_v[order[i], :n] = dense_v[0, rows]
            calls[f"page{block}"] = dict(k_cache=pool_k, v_cache=pool_v,
                                         block_table=order[None, :])
        for fmt in a.kv8:
            import ml_dtypes  # noqa: F401  (numpy's float8 dtypes)

            cache8 = {}
            for name, dense in (("k", dense_k), ("v", dense_v)):
                codes = np.zeros(dense.shape, np.dtype(fmt))
                scale = np.zeros(dense.shape[:3], np.float32)
                flashcte.quantize_kv(dense[0], codes[0], scale[0])
                cache8[f"{name}_cache"], cache8[f"{name}_scale"] = codes, scale
            calls[fmt] = cache8
        lens = np.array([total], np.int32)
        times = {name: [] for name in calls}
        outs = {}
        for name, kw in calls.items():  # warm-up, and the results to compare
            outs[name] = flashcte.flash_attn_with_kvcache(
                q, cache_seqlens=lens, causal=True, num_threads=a.threads, **kw)
        for name in calls:
            if name in a.kv8:
                continue  # other values: the dequantized cache
            assert np.array_equal(np.asarray(outs[name]).view(np.uint8),
                                  np.asarray(outs["dense"]).view(np.uint8)), name
        names = list(calls)
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                start = time.perf_counter()
                flashcte.flash_attn_with_kvcache(q, cache_seqlens=lens, causal=True,
                                                 num_threads=a.threads, **calls[name])
                times[name].append(time.perf_counter() - start)
        flops = 4 * a.d * a.heads * (a.chunk * a.prior + a.chunk * (a.chunk + 1) / 2)
        for name in names:
            med = statistics.median(times[name])
            line = f"{dtype:9} {name:8} median {med * 1e3:8.2f} ms  {flops / med * 1e-9:7.1f} GFLOP/s"
            if name != "dense":
                ratios = [d / p for d, p in zip(times["dense"], times[name])]
                line += (f"  speed vs dense {statistics.median(ratios):.3f} "
                         f"({min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} rounds)")
            print(line)


if __name__ == "__main__":
    main()
