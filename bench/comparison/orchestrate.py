"""The orchestrator (inside the venv): the peers available, the arithmetic limits, every point in
a fresh worker process, the memory probe, and the results rewritten after every point."""

from __future__ import annotations

import datetime as _dt
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from .common import (CLI_BUILD_DIR, DTYPES, OPENBLAS_FIELDS, PEER_MODULES, ROOT, SCRIPT,
                     best_peer, fmt, log, point_name)
from .machine import machine_info, measure_peak, peak_limit, peer_versions
from .memory import memory_probe
from .plots import make_plots
from .points import plan_points
from .report import target_table, write_outputs


def peer_availability(versions: dict, peer_install: dict) -> tuple[dict, dict]:
    """Which peers can run (their module imports in the venv), and why not."""
    peer_ok, peer_reason = {}, {}
    for impl, mod in PEER_MODULES.items():
        ok = versions.get(mod) is not None
        peer_ok[impl] = ok
        if not ok:
            peer_reason[impl] = peer_install.get(mod, f"{mod} not importable")
            log(f"!! peer {impl} skipped: {peer_reason[impl]}")
    return peer_ok, peer_reason


def make_meta(args, mode: str, cli: str, source: dict, peer_install: dict,
              versions: dict) -> dict:
    command = "bench/compare " + " ".join(shlex.quote(a) for a in sys.argv[1:]
                                          if a != "--in-venv")
    return {"mode": mode,
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command, "source": source, "machine": machine_info(cli),
            "versions": versions,
            "peer_install": {k: (v if versions.get(k) else f"NOT AVAILABLE ({v})")
                             for k, v in peer_install.items()} or {"(none)": "--no-install"},
            "reps": args.reps, "threads": args.threads, "load_start": fmt(os.getloadavg()[0], 2)}


def measure_peaks(points: list[dict], cli: str, timeout: int) -> dict:
    """The arithmetic limits, on every thread count the points use (each run also measures 1)."""
    peak = {"lines": [], "command": []}
    for thr in sorted({p["threads"] for p in points if p["threads"] > 1} or {1}):
        r = measure_peak(cli, thr, timeout)
        peak["command"].append(r["command"])
        if "error" in r:
            peak = {"command": r["command"], "error": r["error"]}
            log(f"!! {r['command']}: {r['error']}")
            break
        peak["lines"] += r["lines"]
    if "lines" in peak:
        peak["command"] = "; ".join(peak["command"])
        for dtype, thr in sorted({(p["dtype"], p["threads"]) for p in points}):
            pk, what = peak_limit(peak, dtype, thr)
            log(f"   arithmetic limit for {DTYPES[dtype]} on {thr} thread(s): "
                f"{fmt(pk)} GFLOP/s ({what})")
    return peak


def run_point(p: dict, args, cli: str, peer_ok: dict, peer_reason: dict, py: str) -> list[dict]:
    q = dict(p)
    q.update(cli=cli, reps=args.reps, impls=args.impls, timeout=args.timeout,
             materialized_max_s=args.materialized_max_s, mem_budget=args.mem_budget_gib * 2**30,
             peer_ok=peer_ok, peer_reason=peer_reason)
    q.pop("tags", None)
    return run_worker(py, "--worker", q, args.impls, args.timeout)


def run_worker(py: str, flag: str, q: dict, impls: list[str], timeout: int) -> list[dict]:
    """A fresh `bench/compare FLAG JSON` process: its JSON lines, one per implementation and a
    summary (kind "point"); rows saying why for what it did not report if it failed."""
    cmd = [py, str(SCRIPT), flag, json.dumps(q)]
    try:
        r = subprocess.run(cmd, text=True, capture_output=True, timeout=timeout)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = -1, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (
            e.stdout or ""), f"worker timed out after {timeout} s"
    rows = []
    for line in out.splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    if rc != 0 and not any(r.get("kind") == "point" for r in rows):
        reason = f"worker exit {rc}: {(err or '').strip()[-300:]}"
        if rc == -9 or rc == 137:
            reason = "worker killed (out of memory?)"
        done = {r["impl"] for r in rows if "impl" in r}
        rows += [{"impl": i, "status": "error", "reason": reason} for i in impls
                 if i not in done]
        rows.append({"kind": "point", "error": reason})
    return rows


def record_openblas(meta: dict, impls: dict) -> None:
    """The OpenBLAS cores the sgemm roofline and the materialized peer ran."""
    if impls.get("sgemm", {}).get("openblas_core"):
        if "openblas_sgemm" not in meta:
            log(f"   OpenBLAS core of the SGEMM roofline: {impls['sgemm']['openblas_core']} "
                f"({impls['sgemm'].get('openblas_core_reason', '')})")
        meta["openblas_sgemm"] = {k: impls["sgemm"][k] for k in OPENBLAS_FIELDS
                                  if k in impls["sgemm"]}
    if impls.get("materialized", {}).get("openblas_core"):
        meta["openblas_materialized_core"] = impls["materialized"]["openblas_core"]


def log_point(n: int, total: int, p: dict, seconds: float, impls: dict, summary: dict, args,
              peak: dict) -> None:
    """The console line of a point, and what went wrong at it."""
    fl = impls.get("flashcte", {}).get("gflops")
    parts = []
    for i in args.impls:
        r = impls.get(i)
        if r is None:
            continue
        parts.append(f"{i} {fmt(r['gflops'])}" if r.get("gflops") else f"{i} {r['status']}")
    bp, bg = best_peer(impls)
    if fl and bg:
        parts.append(f"ours/best peer {fl / bg:.2f} ({bp})")
    pk, _ = peak_limit(peak, p["dtype"], p["threads"])
    if fl and pk:
        parts.append(f"ours/peak {fl / pk:.2f}")
    log(f"[{n}/{total}] {point_name(p)} ({seconds:.0f} s, load "
        f"{fmt(summary.get('load_start'), 2)}): " + ", ".join(parts))
    if summary.get("ok") is False:
        log(f"   !! flashcte disagrees with the float64 reference: "
            f"{summary.get('flashcte_vs_float64')}")
    for i, r in impls.items():
        if r["status"] in ("wrong", "error"):
            log(f"   !! {i} {r['status']}: {r.get('reason')}")


def finish(out_dir: Path, meta: dict, records: list[dict], mem: dict, args,
           t_start: float) -> None:
    if not args.no_target:
        meta["target"] = target_table(records, mem, meta.get("peak"))
    meta["load_end"] = fmt(os.getloadavg()[0], 2)
    make_plots(out_dir, records)
    write_outputs(out_dir, meta, records, args)
    if meta.get("target"):
        log("\n== target table (2 threads, d=128, S=4096, 8 heads unless said)")
        for row in meta["target"]:
            log(f"   {row['name']:<66} {row['value']:>10}   ({row['from']})")
    log(f"\n== wrote {out_dir}/results.md, results.csv, raw.jsonl, plots/ "
        f"({time.time() - t_start:.0f} s)")


def orchestrate(args) -> None:
    cli = os.environ.get("FLASHCTE_BENCH_CLI") or args.cli or str(CLI_BUILD_DIR / "tools" /
                                                                   "flashcte")
    source = json.loads(os.environ.get("FLASHCTE_BENCH_SOURCE", "{}"))
    peer_install = json.loads(os.environ.get("FLASHCTE_BENCH_PEERS", "{}"))
    py = sys.executable
    versions = peer_versions(py)
    peer_ok, peer_reason = peer_availability(versions, peer_install)
    points = plan_points(args)
    mode = args.mode + ("-target" if args.target_only else "")
    out_dir = Path(args.out) if args.out else ROOT / "docs" / "benchmarks" / mode
    meta = make_meta(args, mode, cli, source, peer_install, versions)
    log(f"== {len(points)} points, {args.reps} rounds each; results to {out_dir}")
    log(f"   commit {source.get('commit', '?')[:12]} ({source.get('source', '?')}), CLI {cli}, "
        f"load {os.getloadavg()}")
    meta["peak"] = measure_peaks(points, cli, args.timeout)
    records = []
    mem = {}
    t_start = time.time()
    for n, p in enumerate(points, 1):
        t0 = time.time()
        rows = run_point(p, args, cli, peer_ok, peer_reason, py)
        impls = {r["impl"]: r for r in rows if "impl" in r}
        summary = next((r for r in rows if r.get("kind") == "point"), {})
        records.append({"point": p, "impls": impls, "summary": summary})
        record_openblas(meta, impls)
        log_point(n, len(points), p, time.time() - t0, impls, summary, args, meta["peak"])
        if "fp32-nc" in p["tags"] and not args.no_target:
            log("   memory probe (fresh process per implementation)")
            mem = memory_probe(records, cli, args, peer_ok, py)
        # Keep partial results: write after every point.
        if not args.no_target:
            meta["target"] = target_table(records, mem, meta.get("peak"))
        meta["load_end"] = fmt(os.getloadavg()[0], 2)
        meta["elapsed_s"] = round(time.time() - t_start)
        write_outputs(out_dir, meta, records, args)
    finish(out_dir, meta, records, mem, args, t_start)
