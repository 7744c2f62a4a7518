#!/usr/bin/env bash
# Issue 6's bar for `auto`: Spec-Bench, 5 prompts per category x 6 categories, 128 tokens, greedy,
# 2 repeats, every configuration interleaved per prompt in one process; then off vs auto at
# temperature 0.7 on 2 prompts per category. About 1.5-3 hours on a 2-core CPU; not for CI.
# Usage: bash scripts/measure_adaptive_bar.sh OUT_DIR
set -euo pipefail
out=${1:?output directory}
.venv/bin/specdec bench --per-category 5 --max-tokens 128 --repeats 2 --no-progress \
  --methods off,ngram:k2,ngram:k4,ngram:k8,draft:k2,draft:k4,auto --out "$out/greedy" --resume
.venv/bin/specdec bench --per-category 2 --max-tokens 128 --repeats 2 --no-progress \
  --methods off,auto --temperature 0.7 --seed 1 --out "$out/t0.7" --resume
