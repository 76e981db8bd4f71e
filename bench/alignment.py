#!/usr/bin/env python3
"""bench/alignment.py: flashcte's speed on inputs wherever the caller's allocator put them.

    build/python-venv/bin/python bench/alignment.py                  # every case, 7 rounds
    build/python-venv/bin/python bench/alignment.py --cases prefill-fp32 decode-bf16 --rounds 9

Each case runs one call on the same values held three ways: 64-byte aligned, 16 bytes past a
cache line (where glibc's malloc puts numpy's large arrays: a 16-byte header before an mmap'd,
page-aligned block) and 4 bytes past one (a float32 slice at an odd offset); the three are timed
in one interleaved run (the order rotated round by round) and each offset is reported as the
median of its per-round time ratios to the aligned call (> 1: slower). Every offset's output
must equal the aligned one's bit for bit: the placement may change the speed, never the result.

Cases (2 threads unless --threads; `numpy.ndarray.ctypes.data % 64` is printed per input):
  prefill-fp32, prefill-bf16: attention_cte, 8 heads, S = 4096, d = 128, non-causal, q, k
    (tp_k) and v each placed so (the issue's measurement);
  decode-bf16: flash_attn_with_kvcache, batch 1, 32/8 heads, d = 128, 32768 cached tokens, the
    dense cache (batch, seqlen, heads, d) placed so (q too);
  layer-fp32: AttentionLayer (hidden 4096, 32/8 heads, d = 128) on a 512-token prompt from an
    empty cache, the hidden states placed so (the weights and the cache are the layer's own).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

OFFSETS = (0, 16, 4)


def placed(a: np.ndarray, offset: int) -> np.ndarray:
    """A copy of a C-contiguous array whose data starts `offset` bytes past a 64-byte line."""
    raw = np.empty(a.nbytes + 128, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 64 == offset
    return out


def case_prefill(dtype: str, threads: int):
    import flashcte
    rng = np.random.default_rng(1)
    npdt = np.float32
    if dtype == "bfloat16":
        import ml_dtypes
        npdt = ml_dtypes.bfloat16
    shape = (8, 4096, 128)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32).astype(npdt) for _ in range(3))
    scale = 1.0 / np.sqrt(128)

    def make(offset):
        args = [placed(t, offset) for t in (q, k, v)]
        return lambda: flashcte.attention_cte(*args, scale=scale, causal_mask=False, tp_k=True,
                                              num_threads=threads)
    return make


def case_decode(threads: int):
    import flashcte
    import ml_dtypes
    rng = np.random.default_rng(2)
    bf16 = ml_dtypes.bfloat16
    q = rng.standard_normal((1, 1, 32, 128), dtype=np.float32).astype(bf16)
    k, v = (rng.standard_normal((1, 32769, 8, 128), dtype=np.float32).astype(bf16)
            for _ in range(2))

    def make(offset):
        qa, ka, va = (placed(t, offset) for t in (q, k, v))
        return lambda: flashcte.flash_attn_with_kvcache(qa, ka, va, num_threads=threads)
    return make


def case_layer(threads: int):
    import flashcte
    rng = np.random.default_rng(3)
    hidden, heads, kv_heads, d, tokens = 4096, 32, 8, 128, 512
    layer = flashcte.AttentionLayer(hidden, heads, kv_heads, d)
    w = lambda o, i: (rng.standard_normal((o, i), dtype=np.float32) / np.sqrt(i)).astype(np.float32)
    layer.set_weights(q_proj=w(heads * d, hidden), k_proj=w(kv_heads * d, hidden),
                       v_proj=w(kv_heads * d, hidden), o_proj=w(hidden, heads * d))
    x = rng.standard_normal((1, tokens, hidden), dtype=np.float32)
    positions = np.arange(tokens, dtype=np.int64)[None]

    def make(offset):
        xa = placed(x, offset)
        cache = layer.new_cache(1, tokens)

        def call():
            cache.reset()
            return layer(xa, positions, cache, num_threads=threads)
        return call
    return make


def cases(threads: int) -> dict:
    return {"prefill-fp32": lambda: case_prefill("float32", threads),
            "prefill-bf16": lambda: case_prefill("bfloat16", threads),
            "decode-bf16": lambda: case_decode(threads),
            "layer-fp32": lambda: case_layer(threads)}


def as_bytes(out) -> bytes:
    return np.ascontiguousarray(out).tobytes()


def run_case(name: str, make, rounds: int) -> dict:
    calls = {off: make(off) for off in OFFSETS}
    want = as_bytes(calls[0]())
    for off in OFFSETS[1:]:
        if as_bytes(calls[off]()) != want:
            sys.exit(f"{name}: the output at offset {off} differs from the aligned call's")
    times = {off: [] for off in OFFSETS}
    for r in range(rounds):
        order = OFFSETS[r % len(OFFSETS):] + OFFSETS[:r % len(OFFSETS)]
        for off in order:
            t0 = time.perf_counter()
            calls[off]()
            times[off].append(time.perf_counter() - t0)
    ratios = {off: statistics.median(t / a for t, a in zip(times[off], times[0]))
              for off in OFFSETS[1:]}
    return {"ms": {off: statistics.median(t) * 1e3 for off, t in times.items()}, "ratio": ratios}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    known = cases(0)
    ap.add_argument("--cases", nargs="+", choices=list(known), default=list(known))
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--threads", type=int, default=2, help="threads per call (default 2)")
    args = ap.parse_args(argv)
    import flashcte
    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                  if l.startswith("model name")), "?")
    print(f"# {model}; flashcte SIMD target {flashcte.simd_target()}; {args.threads} threads, "
          f"{args.rounds} interleaved rounds; load {os.getloadavg()[0]:.2f}")
    print("| case | aligned ms | +16 B ms | +4 B ms | +16 B / aligned | +4 B / aligned |")
    print("|---|---|---|---|---|---|")
    built = cases(args.threads)
    for name in args.cases:
        res = run_case(name, built[name](), args.rounds)
        ms, ratio = res["ms"], res["ratio"]
        print(f"| {name} | {ms[0]:.2f} | {ms[16]:.2f} | {ms[4]:.2f} | {ratio[16]:.3f} | "
              f"{ratio[4]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
