#!/usr/bin/env python3
"""bench/mla.py: MLA attention (DeepSeek-V2/V3, Kimi K2) against the cores' arithmetic peak.

    build/python-venv/bin/python bench/mla.py --cli build/ci/tools/flashcte
    build/python-venv/bin/python bench/mla.py --cli ... --heads 128 --batch 1 --cached 4096 \
        --modes decode --dtypes bfloat16 --rounds 5

MLA caches one latent KV head of d = 576 per token whose first 512 channels are also its value
(dv = 512), under 16-128 query heads. The cache here is vLLM's paged one, (num_blocks, 1,
block_size, 576) at shuffled places, and the value cache is a view of the key cache's first 512
channels (no second copy), through flashcte.paged_attention. Two modes:
  * decode: one new token per sequence (every query head of the sequence against its cache:
    `heads` rows per cached row, a matrix product rather than a bandwidth-bound read);
  * chunk: a prefill chunk of --chunk new tokens per sequence, causal, over the cached ones.

A point's FLOPs are the useful ones, 2 (d + dv) heads per query-key pair the masks leave (QK^T
2d, PV 2dv). Each round measures the peak first, `flashcte bench --impl peak` on --threads
(the fp32 FMA peak of the best SIMD target and, where the CPU has AVX512_BF16, the vdpbf16ps
peak), then every point in turn (one warm-up call, then the median of calls filling about
--seconds). Fractions are taken within a round, the table gives their median over the rounds:
fp32 against the FMA peak, bf16 against the vdpbf16ps peak where it runs (bf16 is widened to
fp32 elsewhere, and then measured against the FMA peak). Each point's output is checked once
against a float64 computation of the same attention.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from tqdm import tqdm

import flashcte

D, DV = 576, 512  # DeepSeek-V3's kv_lora_rank 512 + qk_rope_head_dim 64


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cli", default="build/ci/tools/flashcte",
                   help="the flashcte command line, for `bench --impl peak`")
    p.add_argument("--heads", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--cached", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--modes", nargs="+", default=["decode", "chunk"], choices=["decode", "chunk"])
    p.add_argument("--chunk", type=int, default=64, help="new tokens per sequence in chunk mode")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16"])
    p.add_argument("--block-size", type=int, default=64, help="slots per page (FlashMLA's 64)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=0.5, help="time per point and round")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--json", help="also write the medians as JSON lines here")
    return p.parse_args()


def np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def peaks(cli, threads):
    """GFLOP/s of the FMA peak and, where the CPU has it, the vdpbf16ps peak, on `threads`."""
    r = subprocess.run([cli, "bench", "--impl", "peak", "--threads", str(threads), "--json"],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        sys.exit(f"mla: {cli} bench --impl peak failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    rows = [x for x in rows if x.get("threads") == threads]
    out = {"fma": max(x["gflops"] for x in rows if x["kind"] == "fma_f32")}
    dots = [x["gflops"] for x in rows if x["kind"] == "bf16_dot"]
    if dots:
        out["bf16_dot"] = max(dots)
    return out


class Pool:
    """The latent cache of `batch` sequences of `total` slots: every sequence's pages at
    shuffled places of one pool, as an engine's allocator leaves them, the latents in [-1, 1) so
    that the softmax is not one-hot. Shared by the points that differ in heads only."""

    def __init__(self, rng, dtype, batch, total, block):
        pages = -(-total // block)
        self.key = (dtype, batch, total, block)
        self.table = rng.permutation(batch * pages).astype(np.int32).reshape(batch, pages)
        self.pool = rng.uniform(-1, 1, (batch * pages, 1, block, D)).astype(np.float32)
        self.pool = self.pool.astype(np_dtype(dtype))


class Point:
    """One shape's call: the queries over a pool, in either mode."""

    def __init__(self, rng, pool, heads, cached, new):
        dtype, batch = pool.key[0], pool.key[1]
        dt = np_dtype(dtype)
        self.dtype, self.heads, self.batch, self.cached, self.new = dtype, heads, batch, cached, new
        self.table, self.pool = pool.table, pool.pool
        self.q = rng.uniform(-1, 1, (batch * new, heads, D)).astype(np.float32).astype(dt)
        self.lens = np.full(batch, cached + new, np.int32)
        self.starts = np.arange(batch + 1, dtype=np.int32) * new
        self.out = np.empty((batch * new, heads, DV), dt)
        self.scale = 1.0 / np.sqrt(192.0)  # DeepSeek-V3's qk_nope + qk_rope head dim

    def __call__(self, threads):
        return flashcte.paged_attention(
            self.q, self.pool, self.pool[..., :DV], self.table, self.lens, self.starts,
            self.scale, causal=True, output=self.out, num_threads=threads)

    def flops(self):
        # Query t of a chunk sees the cached slots and the chunk's first t + 1 tokens.
        pairs = self.cached * self.new + self.new * (self.new + 1) // 2
        return 2.0 * (D + DV) * self.heads * pairs * self.batch

    def error(self):
        """Max |flashcte - float64| over sequence 0's first and last head, relative to their
        outputs' largest value (every head is too much float64 at 128 heads over 32K)."""
        heads = [0, self.heads - 1]
        rows = self.table[0]
        kv = self.pool[rows, 0].astype(np.float64).reshape(-1, D)[: self.cached + self.new]
        q = self.q[: self.new, heads].astype(np.float64)  # (new, 2, D)
        s = np.einsum("thd,jd->htj", q, kv) * self.scale
        allowed = np.arange(kv.shape[0])[None, :] <= self.cached + np.arange(self.new)[:, None]
        s = np.where(allowed[None], s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        ref = np.einsum("htj,jd->thd", p / p.sum(axis=-1, keepdims=True), kv[:, :DV])
        got = self.out[: self.new, heads].astype(np.float64)
        return float(np.abs(got - ref).max() / np.abs(ref).max())


def time_point(point, threads, seconds):
    point(threads)  # warm-up
    times = []
    deadline = time.perf_counter() + seconds
    while len(times) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        point(threads)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    a = parse_args()
    rng = np.random.default_rng(0)
    grid = [(m, dt, h, b, c) for m, dt, c, b, h in itertools.product(
        a.modes, a.dtypes, a.cached, a.batch, a.heads)]
    print(f"flashcte {flashcte.__version__}, SIMD {flashcte.simd_target()}, threads {a.threads}, "
          f"pages of {a.block_size}, d {D} / dv {DV}, {a.rounds} rounds")
    fractions = {key: [] for key in grid}
    rates = {key: [] for key in grid}
    errors, round_peaks, pool = {}, [], None
    with tqdm(total=a.rounds * len(grid), unit="pt", leave=False) as bar:
        for _ in range(a.rounds):
            peak = peaks(a.cli, a.threads)
            round_peaks.append(peak)
            for key in grid:
                mode, dtype, heads, batch, cached = key
                bar.set_description(f"{mode} {dtype} {heads}h b{batch} {cached}")
                new = 1 if mode == "decode" else a.chunk
                if pool is None or pool.key != (dtype, batch, cached + new, a.block_size):
                    pool = None  # the last one goes first: 32K x 8 in fp32 is 600 MB
                    pool = Pool(rng, dtype, batch, cached + new, a.block_size)
                point = Point(rng, pool, heads, cached, new)
                seconds = time_point(point, a.threads, a.seconds)
                if key not in errors:
                    errors[key] = point.error()
                gflops = point.flops() / seconds * 1e-9
                roof = peak.get("bf16_dot", peak["fma"]) if dtype == "bfloat16" else peak["fma"]
                rates[key].append(gflops)
                fractions[key].append(gflops / roof)
                del point
                bar.update()
    fma = statistics.median(p["fma"] for p in round_peaks)
    line = f"peak (median of {a.rounds}): fp32 FMA {fma:.0f} GFLOP/s"
    if all("bf16_dot" in p for p in round_peaks):
        line += f", vdpbf16ps {statistics.median(p['bf16_dot'] for p in round_peaks):.0f} GFLOP/s"
    else:
        line += "; no AVX512_BF16: bf16 is widened to fp32 and measured against the FMA peak"
    print(line)
    print(f"{'mode':6} {'dtype':8} {'heads':>5} {'batch':>5} {'cached':>6}  {'GFLOP/s':>8}  "
          f"{'of peak':>7} {'(range)':>13}  rel. error")
    records = []
    for key in grid:
        mode, dtype, heads, batch, cached = key
        f = fractions[key]
        print(f"{mode:6} {dtype:8} {heads:5} {batch:5} {cached:6}  "
              f"{statistics.median(rates[key]):8.1f}  {statistics.median(f):7.3f} "
              f"({min(f):.3f}-{max(f):.3f})  {errors[key]:.1e}")
        records.append({"mode": mode, "dtype": dtype, "heads": heads, "batch": batch,
                        "cached": cached, "new": 1 if mode == "decode" else a.chunk,
                        "gflops": statistics.median(rates[key]),
                        "fraction_of_peak": statistics.median(f), "fractions": f,
                        "rel_error": errors[key]})
    if a.json:
        with open(a.json, "w", encoding="utf-8") as out:
            for r in records:
                out.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
