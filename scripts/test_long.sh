#!/usr/bin/env bash
# The tests labelled `long`: the Neuron suite's shapes at full size (flashcte_long_tests, 92
# entries) and the 10,000-configuration random oracle (flashcte_reliability_long_tests). They skip
# themselves unless FLASHCTE_LONG_TESTS=1, which this script sets.
#
#   scripts/test_long.sh --all [BUILD]   every long test: all 92 shapes and all 10,000
#                                        configurations (see "Cost" below)
#   scripts/test_long.sh [BUILD]         CI's sample (scripts/test.sh): FLASHCTE_LONG_SHAPES shapes
#                                        (default 30, a third) and FLASHCTE_LONG_CONFIGS
#                                        consecutive random configurations (default 2500, a quarter)
#
# BUILD is a configured and built tree (default build/ci). The sample is drawn from
# FLASHCTE_LONG_SAMPLE, by default the first 8 hex digits of the commit, so that successive
# commits cover different shapes and configurations while a run stays reproducible: the script
# prints the number, and FLASHCTE_LONG_SAMPLE=<it> scripts/test_long.sh runs the same sample.
#
# Cost (Release, the shared 2-core AMD EPYC Zen 4, with two other builds running, so upper
# bounds): the 90 shapes 119 s of CPU, 60 s wall at -j 2 (0.4 to 7 s each); the random oracle
# 2000 configurations in 42 s on one thread (~21 ms each, so the 10,000 of --all ~3.5 min).
# The default sample is ~40 s of shapes beside ~55 s of configurations: about a minute of wall.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ALL=0
if [[ "${1:-}" == "--all" ]]; then
  ALL=1
  shift
fi
BUILD="${1:-build/ci}"
JOBS="${JOBS:-$(nproc)}"
export FLASHCTE_LONG_TESTS=1

if [[ $ALL -eq 1 ]]; then
  echo "== every long test (FLASHCTE_LONG_TESTS=1 ctest -L long)"
  exec ctest --test-dir "$BUILD" -L long --no-tests=error --output-on-failure -j "$JOBS"
fi

sample="${FLASHCTE_LONG_SAMPLE:-$((16#$(git rev-parse --short=8 HEAD 2>/dev/null || echo 0)))}"
shapes_wanted="${FLASHCTE_LONG_SHAPES:-30}"
configs="${FLASHCTE_LONG_CONFIGS:-2500}"
total_configs=10000

mapfile -t shapes < <(ctest --test-dir "$BUILD" -N -L long -R '^long\.Neuron/' |
  sed -n 's/^ *Test *#[0-9]*: //p')
if [[ ${#shapes[@]} -eq 0 ]]; then
  echo "error: no long Neuron shapes in $BUILD (is it built?)" >&2
  exit 1
fi
n=${#shapes[@]}
# Distinct shapes, a reproducible draw: shuf's random bytes are the sample number repeated.
mapfile -t picked < <(printf '%s\n' "${shapes[@]}" |
  shuf -n "$shapes_wanted" --random-source=<(yes "$sample"))
regex=""
for name in "${picked[@]}"; do regex+="${regex:+|}^$name\$"; done
first=$((sample % (total_configs - configs + 1)))
echo "== long tests, sample $sample (FLASHCTE_LONG_SAMPLE=$sample reproduces it;" \
  "scripts/test_long.sh --all runs them all)"
echo "   ${#picked[@]} of $n shapes:" "${picked[@]#long.Neuron/NeuronShapeTest.MatchesReference/}"
echo "   random configurations $first to $((first + configs - 1)) of $total_configs"
FLASHCTE_RANDOM_FIRST="$first" FLASHCTE_RANDOM_CONFIGS="$configs" \
  ctest --test-dir "$BUILD" -L long -R "$regex|^long\.RandomOracle\." --no-tests=error \
  --output-on-failure -j "$JOBS"
