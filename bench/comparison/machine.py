"""The machine: the cores' arithmetic limits (`flashcte bench --impl peak`), what the CPU and
the kernel are, and the versions of the peers in the venv."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

from .common import OPENBLAS_VARS, PEAK_REPS, run
from .peers.cli import fresh_process


def measure_peak(cli: str, threads: int, timeout: int) -> dict:
    """`flashcte bench --impl peak`: the cores' arithmetic limit on 1 thread and on `threads`."""
    cmd = [cli, "bench", "--impl", "peak", "--json", "--threads", str(threads), "--reps",
           str(PEAK_REPS)]
    try:
        r = run(fresh_process(cmd), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(cmd), "error": f"timed out after {timeout} s"}
    if r.returncode != 0:
        return {"command": " ".join(cmd),
                "error": f"exit {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}"}
    lines = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    return {"command": " ".join(cmd), "lines": [l for l in lines if l.get("impl") == "peak"]}


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
    r = subprocess.run("grep -o 'avx512[a-z_]*' /proc/cpuinfo | sort -u", shell=True, text=True,
                       capture_output=True)
    info["avx512_grep"] = r.stdout.strip() or "(no output: no AVX-512 feature flags)"
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
