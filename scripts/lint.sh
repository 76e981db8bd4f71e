#!/usr/bin/env bash
# clang-tidy over the library, the reference and the CLI, using BUILD_DIR/compile_commands.json.
# The Highway per-target file is linted once (for the baseline target) like any other source.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${1:-$ROOT/build/ci}"
cd "$ROOT"
files=$(git ls-files 'src/*.cc' 'tools/*.cc' | grep -v '^tools/fuzz/')
# run-clang-tidy parallelizes; fall back to a loop when it is not installed.
if command -v run-clang-tidy-14 >/dev/null; then
  run-clang-tidy-14 -quiet -p "$BUILD_DIR" $files
else
  for f in $files; do clang-tidy -quiet -p "$BUILD_DIR" "$f"; done
fi
