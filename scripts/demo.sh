#!/usr/bin/env bash
# The main job: builds flashcte (Release) and runs `flashcte demo`, a Llama-3-8B-shaped bf16
# causal prefill checked against the float64 reference. Extra arguments go to `flashcte demo`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/install_deps.sh"
cmake -S "$ROOT" -B "$ROOT/build/release" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DFLASHCTE_BUILD_TESTS=OFF >/dev/null
cmake --build "$ROOT/build/release" --target flashcte_cli
"$ROOT/build/release/tools/flashcte" demo "$@"
