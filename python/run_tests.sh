#!/usr/bin/env bash
# Builds and tests the Python package: a venv under build/python-venv (reused), the package
# installed from the repository root with pip (scikit-build-core + nanobind through the root
# CMake project), then pytest on python/tests. Extra arguments go to pytest.
#
#   python/run_tests.sh                 # incremental: build deps in the venv, persistent build dir
#   FLASHCTE_PIP_ISOLATED=1 python/run_tests.sh   # exactly `pip install .` (isolated, clean build)
#   PYTHON=python3.12 python/run_tests.sh         # another interpreter for the venv
#
# Needs: python3 with venv and pip, PyPI, a C++17 compiler with OpenMP, CMake >= 3.22 (or PyPI's),
# libhwy-dev.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FLASHCTE_VENV:-$ROOT/build/python-venv}"
BUILD_DIR="$ROOT/build/python-build"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# The packages the suite and the incremental build need; the stamp makes re-runs skip pip's
# resolver when nothing changed.
REQUIREMENTS=(
  "scikit-build-core>=0.10"
  "nanobind>=2.4,<4"
  "numpy>=1.22"
  "ml_dtypes>=0.2"
  "pytest>=7"
)
STAMP="$VENV/.flashcte-requirements"

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "== creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
if [[ ! -f "$STAMP" ]] || [[ "$(cat "$STAMP")" != "${REQUIREMENTS[*]}" ]]; then
  echo "== installing ${REQUIREMENTS[*]}"
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet "${REQUIREMENTS[@]}"
  printf '%s' "${REQUIREMENTS[*]}" > "$STAMP"
fi

echo "== building and installing flashcte from $ROOT"
cd "$ROOT"
if [[ "${FLASHCTE_PIP_ISOLATED:-0}" == "1" ]]; then
  "$PY" -m pip install --quiet --force-reinstall --no-deps .
else
  # No build isolation, so the persistent build dir sees the same nanobind every time and
  # rebuilds only what changed.
  "$PY" -m pip install --quiet --no-deps --no-build-isolation -C "build-dir=$BUILD_DIR" .
fi
"$PY" -c 'import flashcte; print("flashcte", flashcte.__version__, "SIMD target:", flashcte.simd_target())'

echo "== pytest"
# Run from the repository root: the source tree's python/flashcte is not on sys.path, so the
# tests import the installed package.
exec "$PY" -m pytest python/tests -q -rs "$@"
