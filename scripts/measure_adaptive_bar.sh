#!/usr/bin/env bash
# Issue 6's bar for `auto`: Spec-Bench, 5 prompts per category x 6 categories, 128 tokens, greedy,
# 2 repeats, every configuration interleaved per prompt in one process; then off vs auto at
# temperature 0.7 on 2 prompts per category. About 2.5 hours on a 2-core CPU; not for CI.
# The three parts resume where a killed run stopped (--resume), in this order: off + auto on every
# prompt (the first condition of the bar, ~20 min), temperature 0.7 (~8 min), then the fixed
# configurations (off re-measured beside them, interleaved per prompt).
# Usage: bash scripts/measure_adaptive_bar.sh OUT_DIR
set -euo pipefail
out=${1:?output directory}
bench() { .venv/bin/specdec bench --per-category 5 --max-tokens 128 --repeats 2 --no-progress --resume "$@"; }
bench --methods off,auto --out "$out/auto"
bench --per-category 2 --methods off,auto --temperature 0.7 --seed 1 --out "$out/t0.7"
bench --methods off,ngram:k2,ngram:k4,ngram:k8,draft:k2,draft:k4 --out "$out/fixed"
