"""The points a run measures (dtype, causal, S, d, heads:kv_heads, threads): the presets, the
issue's target table and the sweep; and the inputs every implementation gets at a point. And
the decode points of --decode (dtype, batch, cached tokens N, d, heads:kv_heads, threads)."""

from __future__ import annotations

import itertools

from .common import DTYPE_ALIASES, point_key

PRESETS = {
    "quick": dict(sizes=[512, 2048], dtypes=["float32", "bfloat16"], causal=["true", "false"],
                  d=[128], heads=["8:8"], extra=[("float32", True, 2048, 128, 32, 8)],
                  reps=3, materialized_max_s=4096, target_max_s=4096),
    # What docs/benchmarks/standard/ was measured with: MHA d=128 over S=512..8192 in every
    # dtype and mask, GQA 32:8 and d=64 at S=2048, and the whole target table (~45 minutes).
    "standard": dict(sizes=[512, 1024, 2048, 4096, 8192],
                     dtypes=["float32", "bfloat16", "float16"], causal=["true", "false"],
                     d=[128], heads=["8:8"],
                     extra=[(dt, c, 2048, d, h, kvh) for dt in ("float32", "bfloat16")
                            for c in (True, False) for (d, h, kvh) in ((128, 32, 8), (64, 8, 8))],
                     reps=3, materialized_max_s=8192, target_max_s=32768),
    "full": dict(sizes=[512, 1024, 2048, 4096, 8192, 16384, 32768],
                 dtypes=["float32", "bfloat16", "float16"], causal=["true", "false"],
                 d=[64, 128], heads=["8:8", "32:8"], extra=[], reps=5,
                 materialized_max_s=16384, target_max_s=32768),
}

# --decode (issue 13's decode targets): one new token per sequence against N cached ones.
# kv_dtypes: "same" (the cache in the point's dtype) or an 8-bit format (issue 24: q and out in the
# point's dtype, the cache int8 / fp8 with one scale per tensor).
DECODE_PRESET = dict(dtypes=["bfloat16", "float32"], cached=[4096, 32768], batch=[1, 8], d=[128],
                     heads=["32:8"], block_size=[0], kv_dtypes=["same"], reps=5)

# The target points of each dtype and mask, in the order the table lists them.
TARGET_DTYPE_TAGS = (("fp32-nc", "fp32 non-causal"), ("fp32-c", "fp32 causal"),
                     ("bf16-nc", "bf16 non-causal"), ("bf16-c", "bf16 causal"),
                     ("fp16-nc", "fp16 non-causal"), ("fp16-c", "fp16 causal"))


def target_points(args) -> dict:
    """The issue's target table: 2 threads, d=128, Sq=Skv=4096, 8 heads unless said."""
    max_s = args.target_max_s or PRESETS[args.mode]["target_max_s"]
    t = {
        "fp32-nc": ("float32", False, 4096, 128, 2),
        "fp32-c": ("float32", True, 4096, 128, 2),
        "bf16-nc": ("bfloat16", False, 4096, 128, 2),
        "bf16-c": ("bfloat16", True, 4096, 128, 2),
        "fp16-nc": ("float16", False, 4096, 128, 2),
        "fp16-c": ("float16", True, 4096, 128, 2),
        "fp32-nc-d64": ("float32", False, 4096, 64, 2),
        "fp32-nc-1t": ("float32", False, 4096, 128, 1),
    }
    if max_s >= 32768:
        t["fp32-c-32k"] = ("float32", True, 32768, 128, 2)
    return t


def plan_points(args) -> list[dict]:
    preset = PRESETS[args.mode]
    sizes = args.sizes or preset["sizes"]
    dtypes = [DTYPE_ALIASES[d] for d in (args.dtypes or preset["dtypes"])]
    causals = [c == "true" for c in (args.causal or preset["causal"])]
    ds = args.d or preset["d"]
    heads = args.heads or preset["heads"]
    threads = args.threads
    points, seen = [], {}

    def add(dtype, causal, s, d, h, kvh, thr, tag=None):
        p = dict(dtype=dtype, causal=causal, s=s, d=d, heads=h, kv_heads=kvh, threads=thr,
                 tags=[])
        key = point_key(p)
        if key not in seen:
            seen[key] = p
            points.append(p)
        seen[key]["tags"].append(tag or "sweep")

    # The target table first: an interrupted run still has it.
    if not args.no_target:
        for tag, (dtype, causal, s, d, thr) in target_points(args).items():
            add(dtype, causal, s, d, 8, 8, thr, tag=tag)
    if not args.target_only:
        for dtype in dtypes:
            for causal in causals:
                for d in ds:
                    for hc in heads:
                        h, kvh = (int(x) for x in hc.split(":"))
                        for s in sizes:
                            add(dtype, causal, s, d, h, kvh, threads)
        if not (args.sizes or args.dtypes or args.causal or args.d or args.heads):
            for (dtype, causal, s, d, h, kvh) in preset["extra"]:
                add(dtype, causal, s, d, h, kvh, threads)
    return points


def point_inputs(p: dict) -> tuple:
    """q (heads, S, d), k and v (kv_heads, S, d): standard normal, rounded to the dtype; the same
    for every implementation (and every process) at a point."""
    import numpy as np
    from .peers import np_dtype
    H, Hkv, S, d = p["heads"], p["kv_heads"], p["s"], p["d"]
    rng = np.random.default_rng(1234)
    dt = np_dtype(p["dtype"])
    return tuple(rng.standard_normal(shape, dtype=np.float32).astype(dt)
                 for shape in ((H, S, d), (Hkv, S, d), (Hkv, S, d)))


def plan_decode_points(args) -> list[dict]:
    """--decode's points: every dtype, cache format, d, heads:kv_heads, N and batch asked for
    (the preset's where not), one new token each, on --threads threads."""
    pr = DECODE_PRESET
    points = []
    for dtype, kv, d, hc, n, b, block in itertools.product(
            [DTYPE_ALIASES[x] for x in (args.dtypes or pr["dtypes"])],
            args.kv_dtypes or pr["kv_dtypes"], args.d or pr["d"], args.heads or pr["heads"],
            args.cached or pr["cached"], args.batch or pr["batch"],
            args.block_size or pr["block_size"]):
        h, kvh = (int(x) for x in hc.split(":"))
        points.append(dict(dtype=dtype, kv_dtype=None if kv == "same" else kv, batch=b,
                           cached=n, new=1, d=d, heads=h, kv_heads=kvh, threads=args.threads,
                           causal=False, block_size=block))
    return points
