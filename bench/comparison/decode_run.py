"""`bench/compare --decode` (inside the venv): the machine's read bandwidth before every point
and after the last (`flashcte bench --impl bandwidth`), each decode point in a fresh worker
(decode.py), and the write-up: results.md (the table: times, torch/flashcte and ggml/flashcte,
K/V bytes, GB/s and the ratio to the bandwidth), results.csv, raw.jsonl and meta.json, rewritten
after every point."""

from __future__ import annotations

import csv
import json
import os
import sys
import time
from pathlib import Path

from .common import (BANDWIDTH_REPS, CLI_BUILD_DIR, DECODE_IMPLS, DECODE_PEER_MODULES, DTYPES,
                     ROOT, fmt, log, median)
from .decode import CALLS_PER_ROUND, decode_name
from .machine import measure_bandwidth, peer_versions, read_bandwidth, wait_idle
from .orchestrate import make_meta, run_worker
from .points import plan_decode_points
from .report import load_version_bullets, run_bullets

IMPLS = DECODE_IMPLS
PEERS = tuple(DECODE_PEER_MODULES)
CSV_COLUMNS = ["dtype", "kv_dtype", "batch", "cached", "block_size", "new", "heads", "kv_heads", "d",
               "threads", "impl",
               "status", "median_ms", "min_ms", "kv_bytes", "kv_gbps", "ratio_to_bandwidth",
               "peer_over_flashcte", "read_gbps_during", "bandwidth_before_point",
               "max_err_vs_float64", "tolerance",
               "rounds", "load_start", "reason", "notes"]
NOTE_KEYS = ("simd", "gqa", "sdpa_backend", "torch", "dequantize", "ggml", "ggml_kv_type", "notes")


def bandwidths(meta: dict, threads: int) -> list[float]:
    """The medians of every `flashcte bench --impl bandwidth` of the run on `threads` threads."""
    return [g for g in (read_bandwidth(bw, threads)[0] for bw in meta.get("bandwidth", []))
            if g is not None]


def machine_bandwidth(meta: dict) -> float | None:
    """The machine's read bandwidth on the points' threads: the median of the run's
    measurements (one before every point and one after the last: the shared machine's
    bandwidth drifts by a third within minutes)."""
    g = bandwidths(meta, meta["threads"])
    return median(g) if g else None


def ratios(rec: dict, bw: float | None) -> dict:
    """A point's derived figures: each peer's time over flashcte's (key "<peer>_over_flashcte"),
    each one's GB/s over the bandwidth."""
    fl = rec["impls"].get("flashcte", {})
    out = {}
    for i in PEERS:
        r = rec["impls"].get(i, {})
        out[f"{i}_over_flashcte"] = (r["median_ms"] / fl["median_ms"]
                                     if r.get("median_ms") and fl.get("median_ms") else None)
    for i in IMPLS:
        g = rec["impls"].get(i, {}).get("kv_gbps")
        out[i] = g / bw if g and bw else None
    return out


def cell(r: dict, key: str, nd: int) -> str:
    return fmt(r.get(key), nd) if r.get("median_ms") else r.get("status", "—")


def table(records: list[dict], bw: float | None) -> list[str]:
    """The decode table (results.md's, and what docs/benchmarks/README.md quotes)."""
    md = ["| dtype | cache | batch | N | layout | K/V MB | flashcte ms | torch ms | ggml ms | "
          "torch/flashcte | ggml/flashcte | flashcte GB/s | flashcte/bw | "
          "bw during point GB/s | load |",
          "|" + "---|" * 15]
    for rec in records:
        p, fl = rec["point"], rec["impls"].get("flashcte", {})
        tr, gg = rec["impls"].get("torch", {}), rec["impls"].get("ggml", {})
        x = ratios(rec, bw)
        during = fl.get("read_gbps_during") or []
        layout = f"pages of {p['block_size']}" if p.get("block_size") else "dense"
        cache = p.get("kv_dtype") or DTYPES[p["dtype"]]
        md.append(f"| {DTYPES[p['dtype']]} | {cache} | {p['batch']} | {p['cached']} | {layout} | "
                  f"{fmt(rec['summary'].get('kv_bytes', 0) / 1e6)} | "
                  f"{cell(fl, 'median_ms', 2)} | {cell(tr, 'median_ms', 2)} | "
                  f"{cell(gg, 'median_ms', 2)} | {fmt(x['torch_over_flashcte'], 2)} | "
                  f"{fmt(x['ggml_over_flashcte'], 2)} | {cell(fl, 'kv_gbps', 1)} | "
                  f"{fmt(x['flashcte'], 2)} | {fmt(median(during) if during else None)} | "
                  f"{fmt(rec['summary'].get('load_start'), 2)} |")
    return md


def bandwidth_lines(meta: dict) -> list[str]:
    runs = meta.get("bandwidth", [])
    if not runs:
        return ["* Read bandwidth: not measured"]
    errors = [bw["error"] for bw in runs if "error" in bw]
    md = [f"* Read bandwidth: `{runs[0]['command']}` ({BANDWIDTH_REPS} interleaved passes per "
          f"thread count, median) before every point and after the last, {len(runs)} runs"
          + (f", {len(errors)} failed ({errors[0]})" if errors else "") + ":"]
    for thr in sorted({1, meta["threads"]}):
        g = bandwidths(meta, thr)
        if g:
            md.append(f"  {thr} thread(s) {fmt(min(g))} to {fmt(max(g))} GB/s, median "
                      f"**{fmt(median(g))}**;")
    return md


def notes(records: list[dict]) -> list[str]:
    """What the peers ran (torch's backend, GQA and dequantization, ggml's cache type), the
    cross-checks, and what was not timed."""
    md = []
    for rec in records:
        name = decode_name(rec["point"])
        for i in PEERS:
            r = rec["impls"].get(i, {})
            if "max_err_vs_float64" not in r:
                continue
            what = (f"{r.get('sdpa_backend', '?')}, GQA {r.get('gqa', '?')}"
                    + (f", {r['dequantize']}" if r.get("dequantize") else "") if i == "torch"
                    else f"{r.get('ggml_kv_type', '?')} cache")
            md.append(f"* {name}: {i} {what}; max |{i} − float64 on its cache| "
                      f"{r['max_err_vs_float64']:.2g}, tolerance {r['tolerance']:.2g}"
                      + (f" ({r['notes']})" if r.get("notes") else ""))
        for i in IMPLS:
            r = rec["impls"].get(i, {})
            if r.get("status") not in (None, "ok"):
                md.append(f"* {name}: {i} {r['status']}: {r.get('reason', '')}")
    return md


def write_md(path: Path, meta: dict, records: list[dict]) -> None:
    bw = machine_bandwidth(meta)
    md = ["# flashcte decode vs PyTorch SDPA and ggml\n"] + run_bullets(meta) + load_version_bullets(meta)
    md += bandwidth_lines(meta)
    waits = [rec["wait_idle"] for rec in records if rec.get("wait_idle")]
    if waits:
        seconds = ", ".join(str(w["waited_s"]) for w in waits)
        idle = ", ".join(fmt(w["idle"], 2) for w in waits)
        md.append(f"* --wait-idle: each point started once the CPUs had been >= 90% idle over "
                  f"5 s (others' work on the shared machine), or at the limit: waits {seconds} s; "
                  f"idle fractions then {idle}")
    md += [f"* Protocol: per point a fresh worker; {meta['reps']} rounds alternating flashcte "
           f"(`flashcte bench --decode --json --reps {CALLS_PER_ROUND}`, a fresh process) and "
           f"torch ({CALLS_PER_ROUND} calls of `F.scaled_dot_product_attention`, "
           f"`torch.set_num_threads({meta['threads']})`; an 8-bit cache dequantized to q's dtype "
           f"in each call) and ggml ({CALLS_PER_ROUND} calls of a `ggml_flash_attn_ext` graph on "
           f"{meta['threads']} threads, q f32, the cache f16 / f32 / q8_0 as llama.cpp's for the "
           f"point's dtype, dense), the order rotated each round; every "
           f"call after a streaming pass over 8x the L3 that evicts the caches (for flashcte the "
           f"CLI's --cold pass, timed: the 'bw during point' column); figures are medians of the "
           f"rounds' medians. torch's warm-up output is checked against a float64 decode of the "
           f"same inputs (tolerance.py's bound); the CLI does not write flashcte's output.",
           "", "K/V bytes: batch x kv_heads x (N + 1) x 2d x the cache's element size (N cached "
           "tokens and the new one's; 1 for an 8-bit cache); GB/s = those bytes / flashcte's "
           "median time; flashcte/bw = GB/s over the machine's read "
           f"bandwidth, the median above ({fmt(bw)} GB/s); torch/flashcte, ggml/flashcte = the "
           "peer's time over flashcte's (> 1: flashcte is faster).\n"]
    md += table(records, bw) + [""] + notes(records)
    path.write_text("\n".join(md) + "\n")


def write_csv(path: Path, meta: dict, records: list[dict]) -> None:
    bw = machine_bandwidth(meta)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for rec in records:
            p, x = rec["point"], ratios(rec, bw)
            for i in IMPLS:
                r = rec["impls"].get(i, {"status": "missing"})
                during = r.get("read_gbps_during") or []
                w.writerow([p["dtype"], p.get("kv_dtype") or p["dtype"], p["batch"], p["cached"], p.get("block_size", 0),
                            p["new"], p["heads"],
                            p["kv_heads"], p["d"], p["threads"], i, r["status"],
                            fmt(r.get("median_ms"), 4), fmt(r.get("min_ms"), 4),
                            rec["summary"].get("kv_bytes", ""), fmt(r.get("kv_gbps"), 3),
                            fmt(x[i], 4), fmt(x.get(f"{i}_over_flashcte"), 4),
                            " ".join(fmt(g, 2) for g in during),
                            fmt(rec.get("bandwidth_before_gbps"), 2),
                            f"{r['max_err_vs_float64']:.3g}" if "max_err_vs_float64" in r else "",
                            f"{r['tolerance']:.3g}" if "tolerance" in r else "",
                            len(r.get("rounds_ms", [])), fmt(rec["summary"].get("load_start"), 2),
                            r.get("reason", ""),
                            ";".join(f"{k}={r[k]}" for k in NOTE_KEYS if k in r)])


def write_outputs(out_dir: Path, meta: dict, records: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "raw.jsonl", "w") as f:
        f.writelines(json.dumps(rec) + "\n" for rec in records)
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    write_csv(out_dir / "results.csv", meta, records)
    write_md(out_dir / "results.md", meta, records)


def log_point(n: int, total: int, rec: dict, seconds: float, bw: float | None) -> None:
    x = ratios(rec, bw)
    parts = []
    for i in IMPLS:
        r = rec["impls"].get(i, {})
        parts.append(f"{i} {fmt(r['median_ms'], 2)} ms {fmt(r['kv_gbps'])} GB/s "
                     f"({fmt(x[i], 2)} of bw)" if r.get("median_ms")
                     else f"{i} {r.get('status')}: {r.get('reason', '')}")
    idle = rec.get("wait_idle")
    waited = f", waited {idle['waited_s']} s, then {idle['idle']:.0%} idle" if idle else ""
    log(f"[{n}/{total}] {decode_name(rec['point'])} ({seconds:.0f} s{waited}, load "
        f"{fmt(rec['summary'].get('load_start'), 2)}): " + ", ".join(parts)
        + "".join(f", {i}/flashcte {fmt(x[f'{i}_over_flashcte'], 2)}" for i in PEERS))


def bandwidth(meta: dict, cli: str, args) -> float | None:
    bw = measure_bandwidth(cli, args.threads, args.timeout)
    meta.setdefault("bandwidth", []).append(bw)
    g, what = read_bandwidth(bw, args.threads)
    log(f"   read bandwidth on {args.threads} thread(s): {fmt(g)} GB/s ({what})")
    return g


def orchestrate_decode(args) -> None:
    cli = os.environ.get("FLASHCTE_BENCH_CLI") or args.cli or str(CLI_BUILD_DIR / "tools" /
                                                                   "flashcte")
    source = json.loads(os.environ.get("FLASHCTE_BENCH_SOURCE", "{}"))
    peer_install = json.loads(os.environ.get("FLASHCTE_BENCH_PEERS", "{}"))
    versions = peer_versions(sys.executable)
    for unused in ("flashcte", "flashcte_simd"):  # the package; decode times the CLI
        versions.pop(unused, None)
    modules = DECODE_PEER_MODULES
    peer_ok = {i: versions.get(modules[i]) is not None for i in PEERS}
    peer_reason = {i: peer_install.get(modules[i], f"{modules[i]} not importable") for i in PEERS}
    points = plan_decode_points(args)
    out_dir = Path(args.out) if args.out else ROOT / "docs" / "benchmarks" / "decode"
    meta = make_meta(args, "decode", cli, source, peer_install, versions)
    log(f"== {len(points)} decode points, {args.reps} rounds each; results to {out_dir}")
    log(f"   commit {source.get('commit', '?')[:12]}, CLI {cli}, load {os.getloadavg()}")
    records, t_start = [], time.time()
    for n, p in enumerate(points, 1):
        t0 = time.time()
        idle = wait_idle(args.wait_idle) if args.wait_idle else None
        bw_before = bandwidth(meta, cli, args)
        q = dict(p, cli=cli, reps=args.reps, calls=CALLS_PER_ROUND, timeout=args.timeout,
                 impls=args.impls, peer_ok=peer_ok, peer_reason=peer_reason)
        rows = run_worker(sys.executable, "--decode-worker", q, list(IMPLS), args.timeout)
        records.append({"point": p, "impls": {r["impl"]: r for r in rows if "impl" in r},
                        "summary": next((r for r in rows if r.get("kind") == "point"), {}),
                        "bandwidth_before_gbps": bw_before, "wait_idle": idle})
        log_point(n, len(points), records[-1], time.time() - t0, machine_bandwidth(meta))
        meta["load_end"] = fmt(os.getloadavg()[0], 2)
        meta["elapsed_s"] = round(time.time() - t_start)
        write_outputs(out_dir, meta, records)
    bandwidth(meta, cli, args)
    meta["load_end"] = fmt(os.getloadavg()[0], 2)
    write_outputs(out_dir, meta, records)
    log("\n" + "\n".join(table(records, machine_bandwidth(meta))))
    log(f"\n== wrote {out_dir}/results.md, results.csv, raw.jsonl ({time.time() - t_start:.0f} s)")
