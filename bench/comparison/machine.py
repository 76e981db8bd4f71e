"""The machine: the cores' arithmetic limits (`flashcte bench --impl peak`), its read bandwidth
(`--impl bandwidth`), what the CPU and the kernel are, and the versions of the peers in the
venv."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

from .common import BANDWIDTH_REPS, OPENBLAS_VARS, PEAK_REPS, run
from .peers.cli import fresh_process


def measure_peak(cli: str, threads: int, timeout: int) -> dict:
    """`flashcte bench --impl peak`: the cores' arithmetic limit on 1 thread and on `threads`."""
    return measure(cli, "peak", threads, PEAK_REPS, timeout)


def measure_bandwidth(cli: str, threads: int, timeout: int) -> dict:
    """`flashcte bench --impl bandwidth`: the streaming read bandwidth of memory on 1 thread and
    on `threads` (median and best of BANDWIDTH_REPS interleaved passes)."""
    return measure(cli, "bandwidth", threads, BANDWIDTH_REPS, timeout)


def measure(cli: str, impl: str, threads: int, reps: int, timeout: int) -> dict:
    """`flashcte bench --impl IMPL --json`: {"command", "lines": its JSON lines of that impl}, or
    {"command", "error"}."""
    cmd = [cli, "bench", "--impl", impl, "--json", "--threads", str(threads), "--reps", str(reps)]
    try:
        r = run(fresh_process(cmd), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(cmd), "error": f"timed out after {timeout} s"}
    if r.returncode != 0:
        return {"command": " ".join(cmd),
                "error": f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}"}
    lines = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    return {"command": " ".join(cmd), "lines": [l for l in lines if l.get("impl") == impl]}


def read_bandwidth(bw: dict | None, threads: int) -> tuple[float | None, str]:
    """The median read bandwidth measure_bandwidth found on `threads` threads: (GB/s, what it
    is) or (None, why not)."""
    if not bw or "lines" not in bw:
        return None, (bw or {}).get("error", "no bandwidth measured")
    line = next((l for l in bw["lines"] if l.get("threads") == threads), None)
    if line is None:
        return None, f"no bandwidth measurement on {threads} thread(s)"
    return line["gbps"], (f"median of {line['reps']} passes over {line['bytes'] / 2**20:.0f} MiB "
                          f"on {threads} thread(s), best {line['best_gbps']:.1f} GB/s")


def idle_fraction(window: float) -> float:
    """The fraction of all CPUs' time that was idle (idle + iowait) over `window` seconds."""
    def stat():
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    a = stat()
    time.sleep(window)
    d = [y - x for x, y in zip(a, stat())]
    return (d[3] + d[4]) / sum(d) if sum(d) > 0 else 1.0


def wait_idle(max_s: float, window: float = 5.0, idle: float = 0.9) -> dict:
    """Waits until the CPUs were at least `idle` idle over a window (others' work on a shared
    machine), at most max_s seconds. Returns the seconds waited and the last idle fraction."""
    t0 = time.time()
    frac = idle_fraction(window)
    while frac < idle and time.time() - t0 < max_s:
        frac = idle_fraction(window)
    return {"waited_s": round(time.time() - t0), "idle": round(frac, 3)}


def peak_limit(peak: dict | None, dtype: str, threads: int) -> tuple[float | None, str]:
    """The arithmetic limit a point of `dtype` on `threads` threads is held against: the best
    fp32 FMA target for fp32 and fp16 (flashcte computes fp16 in fp32), the larger of that and the
    native bf16 dot for bf16. Returns (GFLOP/s, what it is) or (None, why not)."""
    if not peak or "lines" not in peak:
        return None, (peak or {}).get("error", "no peak measured")
    lines = [l for l in peak["lines"] if l.get("available") and l.get("threads") == threads]
    kinds = ("fma_f32", "bf16_dot") if dtype == "bfloat16" else ("fma_f32",)
    cands = [l for l in lines if l["kind"] in kinds]
    if not cands:
        return None, f"no peak measurement on {threads} thread(s)"
    best = max(cands, key=lambda l: l["best_gflops"])
    return best["best_gflops"], f"{best['kind']} {best['target']}, {threads}T"


def machine_info(cli: str) -> dict:
    info = {"hostname_kind": platform.machine(), "kernel": platform.release(),
            "python": platform.python_version()}
    lscpu = run(["lscpu"]).stdout
    fields = {}
    for line in lscpu.splitlines():
        if ":" in line:
            key, val = line.split(":", 1)
            fields[key.strip()] = val.strip()
    info["cpu_model"] = fields.get("Model name", "?")
    info["cpus"] = fields.get("CPU(s)", "?")
    info["cores_per_socket"] = fields.get("Core(s) per socket", "?")
    info["threads_per_core"] = fields.get("Thread(s) per core", "?")
    info["caches"] = ", ".join(f"{k} {fields[k]}" for k in ("L1d cache", "L2 cache", "L3 cache")
                               if k in fields)
    info["hypervisor"] = fields.get("Hypervisor vendor", "none")
    flags = set(fields.get("Flags", "").split())
    wanted = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw",
              "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"]
    info["flags_summary"] = " ".join(f"{f}{'+' if f in flags else '-'}" for f in wanted)
    r = subprocess.run("grep -o 'avx512[a-z_0-9]*' /proc/cpuinfo | sort -u", shell=True, text=True,
                       capture_output=True)
    info["avx512_grep"] = " ".join(r.stdout.split()) or "(no output: no AVX-512 feature flags)"
    info["memory"] = next((l.split(None, 1)[1].strip() for l in
                           Path("/proc/meminfo").read_text().splitlines()
                           if l.startswith("MemTotal")), "?")
    info["openblas_env"] = {v: os.environ.get(v) for v in OPENBLAS_VARS}
    return info


def peer_versions(py: str) -> dict:
    code = ("import json,importlib\nout={}\n"
            "for m in ('numpy','flashcte','torch','onnx','onnxruntime','openvino','ggml',"
            "'matplotlib'):\n"
            "    try:\n        out[m]=importlib.import_module(m).__version__\n"
            "    except Exception as e:\n        out[m]=None\n"
            "try:\n    import flashcte; out['flashcte_simd']=flashcte.simd_target()\n"
            "except Exception: pass\nprint(json.dumps(out))")
    r = run([py, "-c", code])
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001
        return {}
