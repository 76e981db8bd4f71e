"""What every part of bench/compare shares: paths, names of dtypes and implementations, small
helpers (logging, subprocesses, git, formatting) and the FLOP count of a point."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
# The entry point; workers and memory probes are fresh processes of it (--worker, --memprobe).
SCRIPT = ROOT / "bench" / "compare"
DEFAULT_VENV = ROOT / "build" / "bench-venv"
SNAPSHOT_DIR = ROOT / "build" / "bench-src"
CLI_BUILD_DIR = ROOT / "build-bench"
PY_BUILD_DIR = ROOT / "build" / "bench-python-build"
OPENBLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
OPENBLAS_FIELDS = ("openblas_core", "openblas_core_detected", "openblas_core_overridden",
                   "openblas_core_reason")
# Rounds of `flashcte bench --impl peak` (about 0.1 s per measurement and round, ~12
# measurements on an AVX-512 machine): enough for a best-of that a passing compile on a shared
# machine does not decide.
PEAK_REPS = 7
# Passes of `flashcte bench --impl bandwidth` (each thread count; 256 MiB, ~15 ms a pass).
BANDWIDTH_REPS = 15

DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
                 "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}

# The 8-bit cache formats of --decode's --kv-dtypes (flashcte's and torch's names), and each
# one's largest finite magnitude: a per-tensor scale maps the cache's absmax onto it.
KV8_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
KV8_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
# What --decode times: flashcte (its CLI), and the peers PyTorch SDPA and ggml's flash attention,
# each with the Python module it needs.
DECODE_PEER_MODULES = {"torch": "torch", "ggml": "ggml"}
DECODE_IMPLS = ("flashcte", *DECODE_PEER_MODULES)

# Display order; "sgemm" is the roofline. "flashcte-cli" is flashcte again, timed by its CLI in a
# fresh process (uniform [0, 1) inputs of the same shapes) between the worker's own calls: the
# worker's flashcte figure, which every ours/X ratio uses, checked against the CLI's in the same
# rounds (ours/flashcte-cli near 1).
# "flashcte-torch" is flashcte again on torch tensors of the same values (torch's allocator aligns
# them to 64 bytes, where numpy's large arrays start 16 bytes past a line): the two input kinds a
# user passes (issue 25), ours/flashcte-torch near 1 when the placement does not matter.
IMPLS = ["flashcte", "flashcte-cli", "flashcte-torch", "sgemm", "materialized", "torch",
         "ort-mha", "ort-gqa", "ort-attention", "openvino", "ggml-f16", "ggml-f32"]
PEERS = [i for i in IMPLS if i not in ("flashcte", "flashcte-cli", "flashcte-torch", "sgemm")]
# The implementations the flashcte CLI times (`flashcte bench --impl CLI_NAMES[name]`); the
# others run in the worker's Python process (peers/).
CLI_IMPLS = ("flashcte-cli", "sgemm", "materialized")
CLI_NAMES = {"flashcte-cli": "flashcte", "sgemm": "sgemm", "materialized": "materialized"}
IMPL_TITLES = {
    "flashcte": "flashcte",
    "flashcte-cli": "flashcte timed by its CLI (the same kernel, a fresh process)",
    "flashcte-torch": "flashcte on torch tensors (the same call; numpy arrays for `flashcte`)",
    "sgemm": "OpenBLAS SGEMM (roofline)",
    "materialized": "materialized (OpenBLAS sgemm, softmax, sgemm)",
    "torch": "PyTorch scaled_dot_product_attention",
    "ort-mha": "ONNX Runtime com.microsoft MultiHeadAttention",
    "ort-gqa": "ONNX Runtime com.microsoft GroupQueryAttention",
    "ort-attention": "ONNX Runtime ONNX Attention (opset 23)",
    "openvino": "OpenVINO ScaledDotProductAttention (opset13)",
    "ggml-f16": "ggml ggml_flash_attn_ext, q f32, k/v f16 (llama.cpp's default KV cache)",
    "ggml-f32": "ggml ggml_flash_attn_ext, q/k/v f32",
}
# The Python module each peer needs (what bootstrap installs and peer_versions() imports).
PEER_MODULES = {"flashcte-torch": "torch", "torch": "torch", "ort-mha": "onnxruntime", "ort-gqa": "onnxruntime",
                "ort-attention": "onnxruntime", "openvino": "openvino", "ggml-f16": "ggml",
                "ggml-f32": "ggml"}


def log(msg: str) -> None:
    print(msg, flush=True)


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, text=True, capture_output=True, **kw)


def git(*args) -> str:
    r = run(["git", "-C", str(ROOT), *args])
    return r.stdout.strip() if r.returncode == 0 else ""


def fmt(x, nd=1):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{nd}f}"


def median(values) -> float:
    t = sorted(values)
    n = len(t)
    return t[n // 2] if n % 2 else 0.5 * (t[n // 2 - 1] + t[n // 2])


def unmasked_pairs(sq: int, skv: int, causal: bool) -> int:
    if not causal:
        return sq * skv
    # top-left aligned (Sq == Skv here): query i sees keys 0..i.
    return sum(min(i + 1, skv) for i in range(sq)) if sq != skv else sq * (sq + 1) // 2


def attention_flops(p: dict) -> float:
    return 4.0 * p["d"] * p["heads"] * unmasked_pairs(p["s"], p["s"], p["causal"])


def point_key(p: dict) -> tuple:
    return (p["dtype"], p["causal"], p["s"], p["d"], p["heads"], p["kv_heads"], p["threads"])


def point_name(p: dict) -> str:
    return (f"{DTYPES[p['dtype']]} {'causal' if p['causal'] else 'non-causal'} S={p['s']} "
            f"d={p['d']} heads={p['heads']}:{p['kv_heads']} threads={p['threads']}")


def point_short(p: dict) -> str:
    """A point in a few characters, for the lists of points in results.md's notes."""
    return (f"{DTYPES[p['dtype']]}/{'c' if p['causal'] else 'nc'}/S{p['s']}/d{p['d']}/"
            f"{p['heads']}:{p['kv_heads']}/t{p['threads']}")


def best_peer(impls: dict) -> tuple[str | None, float | None]:
    """The fastest attention peer timed at a point (sgemm is a roofline, not a peer)."""
    timed = [(r["gflops"], name) for name, r in impls.items()
             if name in PEERS and r.get("gflops")]
    if not timed:
        return None, None
    g, name = max(timed)
    return name, g
