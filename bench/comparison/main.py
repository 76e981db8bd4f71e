"""bench/compare's command line, and what runs where: the bootstrap (outside the venv), the
orchestrator (inside it, --in-venv; decode_run's for --decode), a worker (--worker, and
--decode-worker for a decode point) or a memory probe (--memprobe)."""

from __future__ import annotations

import argparse
import json

from .common import DECODE_IMPLS, DEFAULT_VENV, DTYPE_ALIASES, IMPLS, KV8_DTYPES
from .points import DECODE_PRESET, PRESETS


def build_parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bench/compare", description=doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="a handful of points, 3 rounds (default)")
    mode.add_argument("--standard", dest="mode", action="store_const", const="standard",
                      help="MHA d=128 S=512..8192 in every dtype and mask, GQA 32:8 and d=64 "
                           "at 2048, the full target table; 3 rounds (~45 min on 2 quiet cores)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="S=512..32768, fp32/bf16/fp16, causal and not, d=64/128, MHA 8:8 "
                           "and GQA 32:8, 5 rounds: many hours")
    mode.add_argument("--decode", dest="mode", action="store_const", const="decode",
                      help="decode points against PyTorch SDPA and ggml's flash attention: 1 new "
                           "token, heads 32:8, d=128, N=4096 and 32768 cached tokens, batch 1 and "
                           "8, bf16 and fp32 (--kv-dtypes: 8-bit caches); K/V GB/s and the ratio "
                           "to the measured read bandwidth; 5 rounds (minutes; --dtypes, --d, "
                           "--heads, --threads, --reps apply)")
    ap.add_argument("--batch", type=int, nargs="+", help="--decode: batch sizes (default 1 8)")
    ap.add_argument("--cached", type=int, nargs="+",
                    help="--decode: cached tokens N (default 4096 32768)")
    ap.add_argument("--block-size", type=int, nargs="+",
                    help="--decode: the cache dense (0, the default) or paged with pages of this "
                         "many slots (vLLM's layout, pages shuffled); torch then gathers the "
                         "pages before SDPA, as transformers' paged cache does on the CPU")
    ap.add_argument("--kv-dtypes", nargs="+", choices=["same", *KV8_DTYPES],
                    help="--decode: the cache in the point's dtype (same, the default) or 8-bit "
                         "with one scale per tensor (q and out in the point's dtype); torch then "
                         "dequantizes the cache in every call, ggml runs a q8_0 cache")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help="--decode: before each point wait (at most SECONDS) until the CPUs "
                         "were 90%% idle over 5 s, for a shared machine (default 0: no wait)")
    ap.add_argument("--target-only", action="store_true",
                    help="only the issue's target table points")
    ap.add_argument("--no-target", action="store_true", help="skip the target table points")
    ap.add_argument("--target-max-s", type=int, default=None,
                    help="include the 32768-token target point when >= 32768 (--full does)")
    ap.add_argument("--sizes", type=int, nargs="+", help="sequence lengths (Sq = Skv)")
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPE_ALIASES))
    ap.add_argument("--causal", nargs="+", choices=["true", "false"])
    ap.add_argument("--d", type=int, nargs="+", help="head dims")
    ap.add_argument("--heads", nargs="+", help="heads:kv_heads, e.g. 8:8 32:8")
    ap.add_argument("--threads", type=int, default=2, help="threads for every impl (default 2)")
    ap.add_argument("--reps", type=int, default=None, help="timed rounds per point")
    ap.add_argument("--impls", nargs="+", choices=sorted(set(IMPLS) | set(DECODE_IMPLS)),
                    default=None, help="subset of implementations (default all; --decode's: "
                                       f"{' '.join(DECODE_IMPLS)})")
    ap.add_argument("--materialized-max-s", type=int, default=None,
                    help="largest S for the materialized peer (its S^2 fp32 scores)")
    ap.add_argument("--mem-budget-gib", type=float, default=6.0,
                    help="skip a peer whose kernel would materialize more than this (default 6)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per point (default 3600)")
    ap.add_argument("--out", help="output dir (default docs/benchmarks/<mode>)")
    ap.add_argument("--venv", default=str(DEFAULT_VENV), help=f"(default {DEFAULT_VENV})")
    ap.add_argument("--source", choices=["head", "worktree"], default="head",
                    help="build a snapshot of HEAD (default) or the work tree as it is")
    ap.add_argument("--cli", help="use this flashcte CLI instead of building one")
    ap.add_argument("--no-build", action="store_true",
                    help="reuse build-bench/ and the installed package as they are")
    ap.add_argument("--no-install", action="store_true", help="do not pip install peers")
    ap.add_argument("--build-only", action="store_true",
                    help="build and install (CLI, venv, peers), then stop")
    ap.add_argument("--in-venv", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    return ap


def parse_args(argv, doc: str):
    ap = build_parser(doc)
    args = ap.parse_args(argv)
    args.mode = args.mode or "quick"
    if args.mode == "decode":
        not_decode = [f"--{k.replace('_', '-')}" for k in ("sizes", "causal", "target_only")
                      if getattr(args, k)]
        if not_decode:
            ap.error(f"{', '.join(not_decode)}: not used by --decode")
        preset = DECODE_PRESET
    elif args.batch or args.cached or args.wait_idle or args.block_size or args.kv_dtypes:
        ap.error("--batch, --cached, --wait-idle, --block-size, --kv-dtypes: only with --decode")
    else:
        preset = PRESETS[args.mode]
    args.reps = args.reps or preset["reps"]
    known = DECODE_IMPLS if args.mode == "decode" else IMPLS
    if args.impls and set(args.impls) - set(known):
        ap.error(f"--impls {' '.join(sorted(set(args.impls) - set(known)))}: not timed by "
                 f"--{args.mode} (it times {' '.join(known)})")
    args.impls = args.impls or list(known)
    if "flashcte" not in args.impls:
        args.impls = ["flashcte"] + args.impls  # the reference of every cross-check
    args.impls = [i for i in known if i in args.impls]
    if args.materialized_max_s is None:
        args.materialized_max_s = preset.get("materialized_max_s", 0)
    return args


def main(argv, doc: str) -> None:
    """doc: the entry point's docstring, whose first paragraph is --help's description."""
    if argv[:1] == ["--worker"]:
        from .worker import worker
        worker(json.loads(argv[1]))
        return
    if argv[:1] == ["--decode-worker"]:
        from .decode import decode_worker
        decode_worker(json.loads(argv[1]))
        return
    if argv[:1] == ["--memprobe"]:
        from .memory import memprobe
        memprobe(json.loads(argv[1]))
        return
    args = parse_args(argv, doc)
    if not args.in_venv:
        from .bootstrap import bootstrap
        bootstrap(args)  # re-executes the entry point inside the venv
        return
    if args.mode == "decode":
        from .decode_run import orchestrate_decode
        orchestrate_decode(args)
        return
    from .orchestrate import orchestrate
    orchestrate(args)
