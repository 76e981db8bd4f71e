"""Checks an installed flashcte wheel as a user would meet it: scripts/test_wheel.sh runs this with
a fresh venv's Python, outside the source tree, in a mount namespace where the system's
libhwy.so.1, libgomp.so.1 and libopenblas.so.0 are /dev/null (--hidden), and once without.

What it asserts:
- the libraries are really unloadable when hidden (else the rest would pass vacuously), and the
  extension runs on the copies the wheel bundles (flashcte.libs/ in /proc/self/maps);
- one version: flashcte.__version__ (the C++ library's) is the wheel's metadata version and the
  one given (CMakeLists.txt's project(VERSION));
- the dispatch picks the best SIMD target of this CPU (AVX3 with AVX-512, AVX2 with AVX2), and
  with AVX512_BF16 the native bfloat16 kernels run from the wheel (FLASHCTE_BF16_DOT=native gives
  other bits than widen, both right) and the automatic choice is the CPU rule's (native on AMD);
- attention_cte, decode (flash_attn_with_kvcache) and the layer against float64 numpy;
- the layer's OpenBLAS (--blas): "system" libopenblas.so.0, pip's "scipy" scipy-openblas32, or
  "none", where the layer must refuse with a message naming what to install.

usage: python wheel_check.py --version 0.1.0 --blas {system,scipy,none} [--hidden]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

HIDDEN = ("libhwy.so.1", "libgomp.so.1", "libopenblas.so.0")


def loads(name: str) -> bool:
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def check_libraries(hidden: bool) -> None:
    if hidden:
        still = [name for name in HIDDEN if loads(name)]
        assert not still, f"{still} still load: the hiding failed, the check would be vacuous"
    maps = Path("/proc/self/maps").read_text()
    for stem in ("libhwy", "libgomp"):
        assert re.search(rf"/flashcte\.libs/{stem}-[0-9a-f]+\.so", maps), (
            f"{stem} is not the wheel's bundled copy (flashcte.libs/) in /proc/self/maps"
        )
    print(f"libraries: bundled libhwy and libgomp loaded; hidden {HIDDEN if hidden else 'none'}")


def check_version(flashcte, version: str) -> None:
    where = Path(flashcte.__file__).resolve()
    assert Path(sys.prefix).resolve() in where.parents, f"flashcte from {where}, not the venv"
    wheel = importlib.metadata.version("flashcte")
    assert flashcte.__version__ == wheel == version, (
        f"versions differ: __version__ {flashcte.__version__}, wheel {wheel}, CMake {version}"
    )
    print(f"version: {version} (library, __version__, wheel metadata, CMakeLists.txt)")


def cpu() -> tuple[set, str]:
    text = Path("/proc/cpuinfo").read_text()
    flags = re.search(r"^flags\s*:(.*)$", text, re.M)
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.M)
    return set(flags.group(1).split()) if flags else set(), vendor.group(1) if vendor else ""


def attention_ref(q, k, v, scale):
    """Causal attention_cte in float64: q (bs, S, d), k (bs, d, S), v (bs, S, d), GQA by bs."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    s = scale * q @ k
    s = np.where(np.tril(np.ones(s.shape[1:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def decode_ref(q, k_cache, v_cache, lengths):
    """One new token per sequence over its cached keys: q (B, 1, H, d), caches (B, S, Hkv, d)."""
    out = np.zeros(q.shape)
    group = q.shape[2] // k_cache.shape[2]
    for b, n in enumerate(lengths):
        for h in range(q.shape[2]):
            keys, values = k_cache[b, :n, h // group], v_cache[b, :n, h // group]
            s = (keys @ q[b, 0, h]) / np.sqrt(q.shape[3])
            p = np.exp(s - s.max())
            out[b, 0, h] = p @ values / p.sum()
    return out


def assert_close(got, ref, rtol, what) -> None:
    got = np.asarray(got, np.float64)
    err, top = float(np.abs(got - ref).max()), float(np.abs(ref).max())
    assert err <= rtol * top, f"{what}: max error {err:.3g} > {rtol} * {top:.3g}"


def check_attention_and_decode(flashcte, dtype=np.float32, rtol=2e-5) -> tuple:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((8, 300, 64), np.float32).astype(dtype)
    k = rng.standard_normal((2, 64, 300), np.float32).astype(dtype)
    v = rng.standard_normal((2, 300, 64), np.float32).astype(dtype)
    out = flashcte.attention_cte(q, k, v, scale=0.125)
    assert_close(out, attention_ref(q, k, v, 0.125), rtol, f"attention_cte {np.dtype(dtype)}")
    qd = rng.standard_normal((3, 1, 8, 64), np.float32).astype(dtype)
    k_cache = rng.standard_normal((3, 200, 2, 64), np.float32).astype(dtype)
    v_cache = rng.standard_normal((3, 200, 2, 64), np.float32).astype(dtype)
    lengths = np.array([200, 37, 1], np.int32)
    got = flashcte.flash_attn_with_kvcache(qd, k_cache, v_cache, cache_seqlens=lengths)
    ref = decode_ref(*(np.asarray(a, np.float64) for a in (qd, k_cache, v_cache)), lengths)
    assert_close(got, ref, rtol, f"decode {np.dtype(dtype)}")
    return out, got


def check_simd(flashcte, flags: set, vendor: str) -> None:
    target = flashcte.simd_target()
    if {"avx512f", "avx512vl", "avx512dq", "avx512bw"} <= flags:
        want = "AVX3"
    elif {"avx2", "fma", "f16c", "bmi2"} <= flags:
        want = "AVX2"
    else:
        want = ""
    assert target.startswith(want), f"dispatched to {target}, this CPU runs {want}"
    print(f"SIMD target: {target} (CPU: {want or 'neither AVX-512 nor AVX2'})")
    if want != "AVX3" or "avx512_bf16" not in flags:
        print("bfloat16: no AVX512_BF16 on this CPU, the native kernels are not expected to run")
        return
    runs = {policy: bf16_run(policy) for policy in ("native", "widen", "auto")}
    assert runs["native"] != runs["widen"], "FLASHCTE_BF16_DOT=native ran the widening kernels"
    auto = "native" if vendor == "AuthenticAMD" else "widen"  # src/simd/native_ops.cc native_pays
    assert runs["auto"] == runs[auto], f"the automatic bfloat16 path is not {auto} on {vendor}"
    print(f"bfloat16: native vdpbf16ps and widened kernels both run and agree with float64; "
          f"automatic choice {auto} ({vendor})")


def bf16_run(policy: str) -> bytes:
    """attention_cte and decode in bfloat16 in a process whose FLASHCTE_BF16_DOT is `policy`
    (read once per process); each checked against float64, returns their output bytes."""
    env = dict(os.environ, FLASHCTE_BF16_DOT=policy)
    if policy == "auto":
        env.pop("FLASHCTE_BF16_DOT")
    code = (
        "import sys, ml_dtypes, flashcte; sys.path.insert(0, sys.argv[1]); import wheel_check; "
        "out, dec = wheel_check.check_attention_and_decode(flashcte, ml_dtypes.bfloat16, 2e-2); "
        "sys.stdout.buffer.write(out.tobytes() + dec.tobytes())"
    )
    here = str(Path(__file__).resolve().parent)
    return subprocess.run(
        [sys.executable, "-c", code, here], env=env, check=True, capture_output=True
    ).stdout


def check_layer(flashcte, blas: str) -> None:
    """A GQA layer without RoPE (q/k/v projections, causal attention, o projection) against
    float64: a 20-token prefill (attention_cte, sgemm), then one decode step (decode, sgemv)."""
    hidden, heads, kv_heads, d = 64, 4, 2, 16
    rng = np.random.default_rng(1)
    w = {
        name: (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        for name, shape in (
            ("q_proj", (heads * d, hidden)),
            ("k_proj", (kv_heads * d, hidden)),
            ("v_proj", (kv_heads * d, hidden)),
            ("o_proj", (hidden, heads * d)),
        )
    }
    layer = flashcte.AttentionLayer(hidden, heads, kv_heads, d, rope=False)
    layer.set_weights(**w)
    cache = layer.new_cache(1, 32)
    x = rng.standard_normal((1, 21, hidden)).astype(np.float32)
    backend = flashcte.layer_gemm_backend()
    if blas == "none":
        try:
            layer(x[:, :20], np.arange(20)[None], cache)
        except ValueError as e:
            message = str(e)
        else:
            raise AssertionError("the layer ran without any OpenBLAS")
        for needed in ("libopenblas0", "pip install scipy-openblas32"):
            assert needed in message, f"the refusal does not name {needed!r}: {message}"
        print(f"layer without OpenBLAS refuses: {message}")
        return
    assert ("libscipy_openblas" in backend) == (blas == "scipy"), f"{blas}: backend {backend}"
    got = np.concatenate(
        [
            layer(x[:, :20], np.arange(20)[None], cache),
            layer(x[:, 20:], np.array([[20]]), cache),
        ],
        axis=1,
    )
    x64 = x[0].astype(np.float64)
    q = (x64 @ w["q_proj"].T).reshape(21, heads, d).transpose(1, 0, 2)
    k = (x64 @ w["k_proj"].T).reshape(21, kv_heads, d).transpose(1, 2, 0)
    v = (x64 @ w["v_proj"].T).reshape(21, kv_heads, d).transpose(1, 0, 2)
    attn = attention_ref(q, k, v, 1 / np.sqrt(d)).transpose(1, 0, 2).reshape(21, heads * d)
    assert_close(got[0], attn @ w["o_proj"].T, 1e-4, "layer prefill + decode")
    print(f"layer (prefill + decode): right, on {backend}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", required=True)
    parser.add_argument("--blas", choices=("system", "scipy", "none"), required=True)
    parser.add_argument("--hidden", action="store_true")
    args = parser.parse_args()
    import flashcte

    check_libraries(args.hidden)
    check_version(flashcte, args.version)
    flags, vendor = cpu()
    check_simd(flashcte, flags, vendor)
    check_attention_and_decode(flashcte)
    print("attention_cte and decode (float32): right")
    check_layer(flashcte, args.blas)


if __name__ == "__main__":
    main()
