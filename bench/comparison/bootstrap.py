"""Bootstrap: build the CLI and the Python package, make the venv, install peers, re-exec the
entry point inside the venv (--in-venv)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .common import CLI_BUILD_DIR, PY_BUILD_DIR, ROOT, SCRIPT, SNAPSHOT_DIR, git, log, run

BASE_REQUIREMENTS = ["numpy>=1.22", "matplotlib", "ml_dtypes>=0.2", "scikit-build-core>=0.10",
                     "nanobind>=2.4,<4"]
BASE_MODULES = ("numpy", "matplotlib", "ml_dtypes", "nanobind", "scikit_build_core")
# Peers: each optional; module (the key of peer-install.json) -> pip packages.
PEER_PACKAGES = {"torch": ["torch"], "onnxruntime": ["onnx", "onnxruntime"],
                 "openvino": ["openvino"], "ggml": ["ggml-python"]}


def pip(py: Path, *args, timeout=1800, env=None) -> subprocess.CompletedProcess:
    cmd = [str(py), "-m", "pip", "--disable-pip-version-check", "install", "--retries", "2",
           "--timeout", "30", *args]
    log("   $ " + " ".join(shlex.quote(c) for c in cmd))
    t0 = time.time()
    try:
        r = run(cmd, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        r = subprocess.CompletedProcess(cmd, 1, "", f"timed out after {timeout} s")
    log(f"   ({time.time() - t0:.0f} s, exit {r.returncode})")
    return r


def pip_ggml(py: Path) -> subprocess.CompletedProcess:
    """ggml-python, built from its sdist (PyPI has no wheel of it): CMake compiles the ggml it
    vendors into ggml/lib/ of the package. GGML_NATIVE (-march=native) is what a llama.cpp user
    gets from a source build, so it is asked for even where SOURCE_DATE_EPOCH would turn it off.
    --no-cache-dir: a wheel built for this CPU must not come back from pip's cache on another."""
    env = dict(os.environ)
    env["CMAKE_ARGS"] = (env.get("CMAKE_ARGS", "") + " -DGGML_NATIVE=ON").strip()
    return pip(py, "--no-cache-dir", "ggml-python", timeout=2400, env=env)


def pip_torch(py: Path) -> subprocess.CompletedProcess:
    """PyTorch from its CPU wheel index (no CUDA libraries), else PyPI's."""
    r = pip(py, "--index-url", "https://download.pytorch.org/whl/cpu", "torch", timeout=900)
    if r.returncode != 0:
        log(f"   the CPU wheel index failed ({last_error(r)}); trying PyPI's torch")
        r = pip(py, "torch")
    return r


def importable(py: Path, module: str) -> bool:
    return run([str(py), "-c", f"import {module}"]).returncode == 0


def last_error(r: subprocess.CompletedProcess) -> str:
    lines = [l for l in (r.stderr or r.stdout or "").splitlines() if l.strip()]
    errs = [l for l in lines if "ERROR" in l or "error" in l]
    return (errs or lines or ["unknown error"])[-1].strip()[:300]


def fail(what: str, r: subprocess.CompletedProcess) -> None:
    sys.exit(f"bench/compare: {what} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")


def prepare_source(args) -> tuple[Path, dict]:
    """The source tree to build: a snapshot of HEAD (default) or the work tree itself."""
    head = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--", "src", "include", "tools", "python",
                "CMakeLists.txt", "cmake", "pyproject.toml")
    info = {"commit": head, "commit_subject": git("log", "-1", "--format=%s"),
            "commit_date": git("log", "-1", "--format=%cI"), "source": args.source,
            "worktree_dirty": bool(dirty),
            "last_library_commit": git("log", "-1", "--format=%h %s", head, "--", "src",
                                       "include")}
    if args.source == "worktree":
        info["dirty_files"] = dirty.splitlines()
        return ROOT, info
    stamp = SNAPSHOT_DIR / ".flashcte-commit"
    if not (stamp.exists() and stamp.read_text().strip() == head):
        log(f"== snapshot of {head[:12]} into {SNAPSHOT_DIR} (git archive)")
        if SNAPSHOT_DIR.exists():
            shutil.rmtree(SNAPSHOT_DIR)
        SNAPSHOT_DIR.mkdir(parents=True)
        arch = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", head],
                              capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(SNAPSHOT_DIR)], input=arch.stdout, check=True)
        stamp.write_text(head + "\n")
    return SNAPSHOT_DIR, info


def build_cli(src: Path) -> Path:
    log(f"== building the flashcte CLI from {src} in {CLI_BUILD_DIR}")
    cfg = ["cmake", "-S", str(src), "-B", str(CLI_BUILD_DIR), "-G", "Ninja",
           "-DCMAKE_BUILD_TYPE=Release", "-DFLASHCTE_BUILD_TESTS=OFF"]
    cache = CLI_BUILD_DIR / "CMakeCache.txt"
    if cache.exists() and f"CMAKE_HOME_DIRECTORY:INTERNAL={src}" not in cache.read_text():
        shutil.rmtree(CLI_BUILD_DIR)  # configured from another source tree
    for cmd in (cfg, ["cmake", "--build", str(CLI_BUILD_DIR), "--target", "flashcte_cli"]):
        r = run(cmd)
        if r.returncode != 0:
            fail(" ".join(cmd), r)
    return CLI_BUILD_DIR / "tools" / "flashcte"


def make_venv(venv: Path, py: Path) -> None:
    """The venv (created once, reused) with the base requirements."""
    if not py.exists():
        log(f"== creating {venv}")
        r = run([sys.executable, "-m", "venv", str(venv)])
        if r.returncode != 0:
            sys.exit(f"bench/compare: python -m venv failed: {last_error(r)}")
        pip(py, "--upgrade", "pip")
    if not all(importable(py, m) for m in BASE_MODULES):
        log("== installing the base requirements")
        r = pip(py, *BASE_REQUIREMENTS)
        if r.returncode != 0:
            sys.exit(f"bench/compare: cannot install {BASE_REQUIREMENTS}: {last_error(r)}")


def install_peers(py: Path, status: dict) -> None:
    """Each peer's packages, attempted only when its module is missing; `status` records
    "installed" or why the install failed."""
    for module, pkgs in PEER_PACKAGES.items():
        mods = ["onnx", "onnxruntime"] if module == "onnxruntime" else [module]
        if all(importable(py, m) for m in mods):
            status[module] = "installed"
            continue
        log(f"== installing {' '.join(pkgs)}")
        if module == "torch":
            r = pip_torch(py)
        elif module == "ggml":
            r = pip_ggml(py)
        else:
            r = pip(py, *pkgs)
        ok = r.returncode == 0 and all(importable(py, m) for m in mods)
        status[module] = "installed" if ok else f"install failed: {last_error(r)}"
        if not ok:
            log(f"   SKIPPING {module}: {status[module]}")


def install_flashcte(py: Path, src: Path, source_info: dict, built_py: Path) -> None:
    log(f"== building and installing the flashcte Python package from {src}")
    stamp = PY_BUILD_DIR / ".flashcte-source"
    if stamp.exists() and stamp.read_text() != str(src):
        shutil.rmtree(PY_BUILD_DIR)
    PY_BUILD_DIR.mkdir(parents=True, exist_ok=True)
    stamp.write_text(str(src))
    r = pip(py, "--no-deps", "--no-build-isolation", "--force-reinstall",
            "-C", f"build-dir={PY_BUILD_DIR}", str(src))
    if r.returncode != 0:
        fail("installing flashcte", r)
    built_py.write_text(json.dumps(source_info))


def reused_source_info(args, built_cli: Path, built_py: Path) -> dict:
    """--no-build: what the existing builds were made from, not HEAD."""
    def built(path):
        return json.loads(path.read_text()) if path.exists() else {"commit": "unknown"}
    cli_info, py_info = built(built_cli), built(built_py)
    if args.cli:
        cli_info = {"commit": f"unknown (--cli {args.cli})"}
    if args.mode == "decode":  # decode points time the CLI alone
        return dict(cli_info, no_build=True, cli_commit=cli_info.get("commit"))
    if cli_info.get("commit") != py_info.get("commit"):
        log(f"!! --no-build: the CLI was built from {cli_info.get('commit')}, the Python "
            f"package from {py_info.get('commit')}")
    return dict(py_info, no_build=True, cli_commit=cli_info.get("commit"))


def bootstrap(args) -> None:
    venv = Path(args.venv)
    py = venv / "bin" / "python"
    src, source_info = (ROOT, {}) if args.no_build else prepare_source(args)
    cli = Path(args.cli) if args.cli else (CLI_BUILD_DIR / "tools" / "flashcte")
    built_cli = CLI_BUILD_DIR / ".flashcte-bench-built"
    built_py = PY_BUILD_DIR / ".flashcte-bench-built"
    if not args.cli and not args.no_build:
        cli = build_cli(src)
        built_cli.write_text(json.dumps(source_info))
    if not cli.exists():
        sys.exit(f"bench/compare: no CLI at {cli} (drop --no-build or pass --cli)")
    make_venv(venv, py)
    status_file = venv / "peer-install.json"
    status = json.loads(status_file.read_text()) if status_file.exists() else {}
    if not args.no_install:
        install_peers(py, status)
    status_file.write_text(json.dumps(status, indent=1))
    # Decode points time the CLI and torch only: the Python package is neither built nor needed.
    needs_package = args.mode != "decode"
    if args.no_build:
        source_info = reused_source_info(args, built_cli, built_py)
    elif needs_package:
        install_flashcte(py, src, source_info, built_py)
    if needs_package and not importable(py, "flashcte"):
        sys.exit("bench/compare: the flashcte package is not importable in the venv")
    if args.build_only:
        log(f"== built {source_info.get('commit', '?')}: CLI {cli}, venv {venv}")
        return
    env = dict(os.environ)
    env["FLASHCTE_BENCH_SOURCE"] = json.dumps(source_info)
    env["FLASHCTE_BENCH_CLI"] = str(cli.resolve())
    env["FLASHCTE_BENCH_PEERS"] = json.dumps(status)
    os.execve(str(py), [str(py), str(SCRIPT), *sys.argv[1:], "--in-venv"], env)
