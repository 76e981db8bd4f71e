#!/usr/bin/env python3
"""bench/plan_reuse.py: a serving step's attention over all its layers, planned once and run per
layer (flashcte.plan_paged_attention, PagedAttentionPlan.run) against paged_attention called per
layer (every call checks the whole step again: offsets, lengths, every page of the table).

    build/python-venv/bin/python bench/plan_reuse.py                      # the default steps
    build/python-venv/bin/python bench/plan_reuse.py --layers 32 --rounds 9

Steps (vLLM's HND pages of 16, shuffled in the pool):
    decode_8x4k     8 sequences decoding one token over 4096 cached each (32/8 heads, d 128)
    decode_8x4k_mqa the same with 8/1 heads and d 64: less attention, the checks weigh more
    mixed           4 decodes over 2048 cached and a prefill chunk of 128 over 1024 (32/8, d 128)

Each layer has its own query and output; the layers share one pair of caches (4.3 GB of bf16
K/V for 32 layers of decode_8x4k would not fit most machines; each call still streams its
sequences' pages from memory, the pool being larger than the caches). Each round times one step
per way, A B then B A; it prints the medians and the median over rounds of the per-layer call's
time over the planned one's (> 1: the plan is faster). The plan's own cost (one per step) is
inside its time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import flashcte

STEPS = {
    # name: (query rows per sequence, cached keys per sequence, heads, kv_heads, d)
    "decode_8x4k": ([1] * 8, [4096] * 8, 32, 8, 128),
    "decode_8x4k_mqa": ([1] * 8, [4096] * 8, 8, 1, 64),
    "mixed": ([1, 1, 1, 1, 128], [2048] * 4 + [1024], 32, 8, 128),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=list(STEPS))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args()


def main():
    a = parse_args()
    if a.dtype == "bfloat16":
        import ml_dtypes

        dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        dtype = np.dtype(a.dtype)
    rng = np.random.default_rng(0)
    page = 16
    print(f"flashcte {flashcte.__version__}, SIMD target {flashcte.simd_target()}, {a.dtype}, "
          f"{a.layers} layers, {a.rounds} rounds")
    for name in a.steps:
        q_lens, seq_lens, heads, kv_heads, d = STEPS[name]
        pages = [-(-n // page) for n in seq_lens]
        pool = sum(pages) + 8
        order = rng.permutation(pool).astype(np.int32)
        table = np.zeros((len(seq_lens), max(pages)), np.int32)
        at = 0
        for b, n in enumerate(pages):
            table[b, :n] = order[at : at + n]
            at += n
        k_cache = rng.standard_normal((pool, kv_heads, page, d), np.float32).astype(dtype)
        v_cache = rng.standard_normal((pool, kv_heads, page, d), np.float32).astype(dtype)
        queries = [rng.standard_normal((sum(q_lens), heads, d), np.float32).astype(dtype)
                   for _ in range(a.layers)]
        outs = [np.empty_like(q) for q in queries]
        step = dict(block_table=table, seq_lens=np.array(seq_lens, np.int32),
                    query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                    scale=d**-0.5, num_threads=a.threads)

        def per_layer():
            for q, out in zip(queries, outs):
                flashcte.paged_attention(q, k_cache, v_cache, output=out, **step)

        def planned():
            plan = flashcte.plan_paged_attention(queries[0], k_cache, v_cache, **step)
            for q, out in zip(queries, outs):
                plan.run(q, k_cache, v_cache, output=out)

        expected = None
        for fn in (per_layer, planned):  # warm-up, and the same results both ways
            fn()
            got = np.stack(outs).view(np.uint8).copy()
            assert expected is None or np.array_equal(got, expected), "results differ"
            expected = got
        times = {"per_layer": [], "planned": []}
        for r in range(a.rounds):
            order_of_round = [per_layer, planned] if r % 2 == 0 else [planned, per_layer]
            for fn in order_of_round:
                t = time.perf_counter()
                fn()
                times[fn.__name__].append(time.perf_counter() - t)
        ratios = [x / y for x, y in zip(times["per_layer"], times["planned"])]
        print(f"{name:16s} per-layer {statistics.median(times['per_layer']) * 1e3:8.2f} ms  "
              f"planned {statistics.median(times['planned']) * 1e3:8.2f} ms  "
              f"per-layer / planned {statistics.median(ratios):.3f} "
              f"(rounds {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
