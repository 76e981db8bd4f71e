#!/usr/bin/env python3
"""bench/kv8_accuracy.py: what an 8-bit KV cache costs in accuracy at the attention output, the
format's own error (the kernel adds none beyond it: tests/kv8_prefill_test.cc).

    build/python-venv/bin/python bench/kv8_accuracy.py

One decode step (one query per sequence) of a Llama-3-8B-shaped attention (32/8 heads, d = 128)
over a cache of --cached tokens, through flashcte.flash_attn_with_kvcache, against the same call
on the bfloat16 cache the 8-bit one was quantized from (flashcte.quantize_kv). Keys have a few
outlier channels (x --outlier), as real models' keys do, values do not. Prints, per format and
scale granularity, the relative RMS error of the output and its largest absolute error.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

import flashcte


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cached", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--outlier", type=float, default=8.0)
    return p.parse_args()


def main():
    a = parse_args()
    rng = np.random.default_rng(0)
    heads, kv_heads, d = 32, 8, 128
    bf16 = np.dtype(ml_dtypes.bfloat16)
    k = rng.standard_normal((a.batch, a.cached, kv_heads, d), np.float32)
    k[..., rng.choice(d, 4, replace=False)] *= a.outlier
    v = rng.standard_normal((a.batch, a.cached, kv_heads, d), np.float32)
    q = rng.standard_normal((a.batch, 1, heads, d), np.float32) * 2
    k, v, q = k.astype(bf16), v.astype(bf16), q.astype(bf16)
    lens = np.full(a.batch, a.cached, np.int32)
    want = np.asarray(flashcte.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)).astype(
        np.float64
    )
    print(f"decode over {a.cached} cached tokens, batch {a.batch}, 32/8 heads, d 128, bf16 q, "
          f"key outlier channels x{a.outlier}: output against the bf16 cache's")
    print(f"{'format':14} {'scale':9} {'rel_rms':>9} {'max_abs':>9}")
    for fmt in ("int8", "float8_e4m3fn", "float8_e5m2"):
        for granularity in ("tensor", "token"):
            caches, scales = [], []
            for x in (k, v):
                codes = np.zeros(x.shape, np.dtype(fmt))
                if granularity == "tensor":
                    top = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[fmt]
                    scale = np.array([np.abs(x.astype(np.float32)).max() / top], np.float32)
                    for b in range(a.batch):
                        flashcte.quantize_kv(x[b], codes[b], scale)
                else:
                    scale = np.zeros(x.shape[:3], np.float32)
                    for b in range(a.batch):
                        flashcte.quantize_kv(x[b], codes[b], scale[b])
                caches.append(codes)
                scales.append(scale)
            got = np.asarray(
                flashcte.flash_attn_with_kvcache(
                    q, caches[0], caches[1], cache_seqlens=lens, k_scale=scales[0],
                    v_scale=scales[1],
                )
            ).astype(np.float64)
            err = got - want
            rel = np.sqrt((err**2).mean() / (want**2).mean())
            print(f"{fmt:14} {granularity:9} {rel:9.2e} {np.abs(err).max():9.2e}")


if __name__ == "__main__":
    main()
