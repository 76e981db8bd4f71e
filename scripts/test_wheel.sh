#!/usr/bin/env bash
# The wheel as a new user meets it (issue 28): scripts/wheel.sh builds the sdist and, from it, the
# manylinux wheel; this installs that wheel into a fresh venv and runs it where the system's
# libhwy.so.1, libgomp.so.1 and libopenblas.so.0 are unavailable, as on a machine without
# Debian's libhwy1, libgomp1 and libopenblas0. They are hidden in a private mount namespace
# (unshare -m, as root) by bind-mounting /dev/null over every file the loader's cache resolves
# them to; dlopen of them then fails ("file too short"), which scripts/wheel_check.py asserts
# first, so that the checks cannot pass vacuously.
#
#   1. auditwheel show calls the wheel manylinux (the extension needs nothing outside the
#      manylinux allow-list) and the extension's libhwy and libgomp are the bundled copies;
#   2. hidden, without scipy-openblas32: attention and decode run on the best SIMD target
#      (native bfloat16 too), and the layer refuses with an error naming what to install;
#   3. hidden, with flashcte[blas] (pip's scipy-openblas32): the layer runs on it; then the
#      pytest files of attention_cte, decode / KV caches and the layer, against their float64
#      models, on the installed wheel;
#   4. not hidden: the layer prefers the system's OpenBLAS over the pip one.
#
#   scripts/test_wheel.sh                            # builds the wheel, then tests it
#   FLASHCTE_WHEEL=dist/flashcte-...whl scripts/test_wheel.sh   # tests a wheel built before
#
# Needs: root (unshare -m, mount), util-linux, what scripts/wheel.sh needs, PyPI (numpy,
# ml_dtypes, pytest, scipy-openblas32 for the venv).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
VENV="$ROOT/build/wheel-test-venv"
export PIP_DISABLE_PIP_VERSION_CHECK=1
cd "$ROOT"

if [[ -z "${FLASHCTE_WHEEL:-}" ]]; then
  scripts/wheel.sh
  wheels=(dist/flashcte-*.whl)
  FLASHCTE_WHEEL="${wheels[0]}"
fi
WHEEL="$(realpath "$FLASHCTE_WHEEL")"
VERSION="$(sed -n 's/^project(flashcte VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)"
CHECK="$ROOT/scripts/wheel_check.py"

echo "== auditwheel show $(basename "$WHEEL")"
tools=(build/wheel-tools-venv-*/bin/auditwheel)  # scripts/wheel.sh's venv
if [[ ! -x "${tools[0]}" ]]; then
  echo "test_wheel: no auditwheel in build/wheel-tools-venv-*: run scripts/wheel.sh once" >&2
  exit 1
fi
show="$("${tools[0]}" show "$WHEEL")"
echo "$show"
# auditwheel wraps its lines; the tag is manylinux only when every library the extension needs
# is on that policy's allow-list or bundled (an unbundled libhwy.so.1 gives linux_x86_64).
tag="$(tr '\n' ' ' <<<"$show" | grep -o 'platform tag: *"[^"]*"' | head -1 | cut -d'"' -f2)"
[[ "$tag" == manylinux_* ]] || { echo "test_wheel: tagged '$tag', not manylinux" >&2; exit 1; }
[[ "$(basename "$WHEEL")" == *"$tag"* ]] || { echo "test_wheel: file name lacks $tag" >&2; exit 1; }
# The extension's own needs: libhwy and libgomp by their bundled (hashed) names only.
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m zipfile -e "$WHEEL" "$tmp/wheel"
needed="$(readelf -d "$tmp"/wheel/flashcte/_flashcte*.so | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')"
echo "extension needs: $(tr '\n' ' ' <<<"$needed")"
for stem in libhwy libgomp; do
  bundled="$(grep "^$stem-" <<<"$needed" || true)"
  if [[ -z "$bundled" ]] || [[ ! -f "$tmp/wheel/flashcte.libs/$bundled" ]]; then
    echo "test_wheel: the extension does not load $stem from flashcte.libs/" >&2
    exit 1
  fi
done

# Every file the loader's cache maps the three sonames to, symlinks resolved (one real file can
# have several names).
HIDE=""
for soname in libhwy.so.1 libgomp.so.1 libopenblas.so.0; do
  files="$(ldconfig -p | awk -v s="$soname" '$1 == s {print $NF}')"
  [[ -n "$files" ]] || { echo "test_wheel: $soname is not installed here" >&2; exit 1; }
  for f in $files; do HIDE+="$(readlink -f "$f")"$'\n'; done
done
HIDE="$(sort -u <<<"$HIDE" | sed '/^$/d')"
echo "hidden: $(tr '\n' ' ' <<<"$HIDE")"
# "$@" in a private mount namespace where each file of $HIDE reads as /dev/null.
hidden() {
  # shellcheck disable=SC2016  # expanded by the inner shell
  HIDE="$HIDE" unshare --mount --propagation private -- bash -c '
    set -euo pipefail
    while IFS= read -r f; do mount --bind /dev/null "$f"; done <<<"$HIDE"
    exec "$@"' hidden "$@"
}

echo "== a fresh venv with the wheel ($PYTHON)"
t0=$SECONDS
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet "${WHEEL}[bf16]" "pytest>=7"
echo "installed in $((SECONDS - t0)) s"

# Outside the source tree, so that nothing there can stand in for the installed package.
cd "$tmp"
echo "== 2. hidden libraries, no OpenBLAS at all"
hidden "$PY" "$CHECK" --version "$VERSION" --blas none --hidden

echo "== 3. hidden libraries, the layer on pip's scipy-openblas32 (flashcte[blas])"
"$PY" -m pip install --quiet "${WHEEL}[blas]"
hidden "$PY" "$CHECK" --version "$VERSION" --blas scipy --hidden
# The suite's float64 models; run from the root for python/tests' paths. The root holds no
# flashcte package (the source's is python/flashcte), so the tests import the installed wheel.
cd "$ROOT"
hidden "$PY" -m pytest -q -p no:cacheprovider python/tests/test_attention_cte.py \
  python/tests/test_kvcache.py python/tests/test_layer.py
cd "$tmp"

echo "== 4. the system's OpenBLAS present: the layer prefers it"
"$PY" "$CHECK" --version "$VERSION" --blas system
echo "== wheel test passed: $(basename "$WHEEL")"
