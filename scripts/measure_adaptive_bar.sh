#!/usr/bin/env bash
# Issue 6's bar for `auto`: Spec-Bench, 5 prompts per category x 6 categories, 128 tokens, greedy,
# every configuration interleaved per prompt in one process (order alternating per repeat); then
# off vs auto at temperature 0.7 on 2 prompts per category. About 2.5 hours on a 2-core CPU; not
# for CI. The three parts resume where a killed run stopped (--resume), in this order: off + auto
# on every prompt, 4 repeats (the first condition of the bar, ~50 min: the difference to find is
# small next to this machine's noise), temperature 0.7 (~8 min), then the fixed configurations,
# 2 repeats (off re-measured beside them).
# Usage: bash scripts/measure_adaptive_bar.sh OUT_DIR
set -euo pipefail
out=${1:?output directory}
bench() { .venv/bin/specdec bench --per-category 5 --max-tokens 128 --no-progress --resume "$@"; }
bench --repeats 4 --methods off,auto --out "$out/auto"
bench --repeats 2 --per-category 2 --methods off,auto --temperature 0.7 --seed 1 --out "$out/t0.7"
bench --repeats 2 --methods off,ngram:k2,ngram:k4,ngram:k8,draft:k2,draft:k4 --out "$out/fixed"
