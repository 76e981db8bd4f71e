"""Memory probes: peak RSS of the worker's calls (vm_kib, reset_peak_rss), one implementation's
peak memory in a fresh process (memprobe, `bench/compare --memprobe`), and the target table's
memory rows (memory_probe)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

from .common import SCRIPT, run
from .peers import PY_IMPLS
from .peers.cli import bench_command, fresh_process, last_json
from .points import point_inputs


def vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def memprobe(p: dict) -> None:
    """One implementation's peak memory beyond its inputs and output, in a fresh process: peak
    RSS during its first call minus RSS just before it minus the output's bytes. Run with glibc
    returning freed memory at once (MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_), so that
    allocations are not served from pages an earlier free left resident."""
    import ctypes
    import gc
    p["scale"] = 1.0 / math.sqrt(p["d"])
    data = point_inputs(p)
    res = {"impl": p["impl"]}
    try:
        impl = PY_IMPLS[p["impl"]](p["impl"], p, data)
        impl.setup()
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        if not reset_peak_rss():
            raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs)")
        base = vm_kib("VmRSS")
        out = impl.run()
        hwm = vm_kib("VmHWM")
        res["rss_before_mib"] = base / 1024
        res["peak_mib"] = hwm / 1024
        res["out_mib"] = data[0].nbytes / 2**20
        res["extra_mib"] = (hwm - base) / 1024 - data[0].nbytes / 2**20
        del out
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    print(json.dumps(res), flush=True)


def io_mib(p: dict, s: int) -> float:
    """MiB of fp32 q, k, v and out at sequence length s."""
    return (2 * p["heads"] + 2 * p["kv_heads"]) * s * p["d"] * 4 / 2**20


def python_probes(rec: dict, args, peer_ok: dict, py: str) -> dict:
    """Each Python implementation timed at the point, in a fresh process (memprobe)."""
    out = {}
    p = rec["point"]
    io = io_mib(p, p["s"])
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    for impl in [i for i in args.impls if i in PY_IMPLS]:
        if impl != "flashcte" and not peer_ok.get(impl, True):
            continue
        if rec["impls"].get(impl, {}).get("status") != "ok":
            continue
        q = {k: p[k] for k in ("dtype", "causal", "s", "d", "heads", "kv_heads", "threads")}
        q.update(impl=impl, mem_budget=args.mem_budget_gib * 2**30)
        try:
            r = subprocess.run([py, str(SCRIPT), "--memprobe", json.dumps(q)],
                               text=True, capture_output=True, env=env, timeout=args.timeout)
            j = json.loads(r.stdout.strip().splitlines()[-1])
        except Exception as e:  # noqa: BLE001
            j = {"error": f"{type(e).__name__}: {e}"}
        name = f"peak memory beyond inputs and outputs: {impl}"
        if "error" in j:
            out[name] = {"value": "—", "from": f"failed: {j['error']}"}
        else:
            out[name] = {"value": f"{j['extra_mib']:.1f} MiB", "raw": j["extra_mib"],
                         "from": f"fresh process: peak RSS {j['peak_mib']:.1f} MiB during the "
                                 f"first call − {j['rss_before_mib']:.1f} MiB before it − "
                                 f"{j['out_mib']:.1f} MiB output (inputs {io - j['out_mib']:.1f} "
                                 f"MiB were resident before)"}
    return out


def cli_probe(p: dict, cli: str, timeout: int) -> dict:
    """The whole `flashcte bench` process's peak RSS at the point and at S=128, for scale."""
    def cli_rss(s):
        r = run(fresh_process(bench_command(cli, p, "flashcte", s)), timeout=timeout)
        return last_json(r.stdout)["peak_rss_mib"]

    name = "flashcte bench process: peak RSS"
    try:
        big, small = cli_rss(p["s"]), cli_rss(128)
    except Exception as e:  # noqa: BLE001
        return {name: {"value": "—", "from": f"failed: {e}"}}
    io, io_small = io_mib(p, p["s"]), io_mib(p, 128)
    return {name: {
        "value": f"{big:.1f} MiB", "raw": big,
        "from": f"whole process at S={p['s']}, of which q, k, v, out {io:.1f} MiB; "
                f"{small:.1f} MiB at S=128 (binary, libraries, thread pools, "
                f"{io_small:.1f} MiB of tensors): growth beyond the tensors "
                f"{big - small - (io - io_small):+.1f} MiB"}}


def memory_probe(records: list[dict], cli: str, args, peer_ok: dict, py: str) -> dict:
    """Peak memory beyond inputs and outputs at the main target point (fp32, non-causal,
    S=4096, d=128, 8 heads, 2 threads): each Python implementation in a fresh process
    (memprobe), and the whole `flashcte bench` process's peak RSS for scale."""
    rec = next((r for r in records if "fp32-nc" in r["point"]["tags"]), None)
    if rec is None:
        return {}
    p = rec["point"]
    out = python_probes(rec, args, peer_ok, py)
    out.update(cli_probe(p, cli, args.timeout))
    m = rec["impls"].get("materialized", {})
    if "peak_rss_mib" in m:
        out["materialized peer: peak RSS of its process"] = {
            "value": f"{m['peak_rss_mib']:.0f} MiB", "raw": m["peak_rss_mib"],
            "from": f"fp32 copies of the inputs, out, and one {4 * p['s'] ** 2 / 2**20:.0f} MiB "
                    f"S×S score matrix at a time"}
    return out
