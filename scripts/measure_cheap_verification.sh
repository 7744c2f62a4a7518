#!/usr/bin/env bash
# Issue 7's measurements on the default pair, one after another on a quiet CPU (about 80 minutes on
# a 2-core CPU; not for CI):
# 1. per backend configuration: target step time t(1), v(n) = t(n)/t(1) for n = 1..16, draft cost
#    ratio, expected speculative tokens/s (`specdec calibrate`);
# 2. whether the torch backend's batched logits equal its one-row logits on the real target;
# 3. end to end on llama.cpp (exact): off, ngram, draft, auto on 2 prompts per category, 64 tokens;
# 4. end to end on torch (batched verification, the only torch mode where verifying costs less
#    than k steps): off, ngram, draft, auto and transformers' assisted generation (draft model and
#    prompt lookup) on the same prompts, in the same run.
# Usage: bash scripts/measure_cheap_verification.sh OUT_DIR [TORCH_DTYPE]
set -euo pipefail
out=${1:?output directory}
dtype=${2:-bfloat16}
mkdir -p "$out"
specdec=.venv/bin/specdec
target=$($specdec models list | awk '/1.5b/ {print $NF; exit}')
[ -s "$out/calibrate.txt" ] || $specdec calibrate \
  --configs llama.cpp,llama.cpp:inexact,torch:bfloat16,torch:bfloat16:inexact,torch:float32:inexact \
  > "$out/calibrate.partial" && mv "$out/calibrate.partial" "$out/calibrate.txt"
[ -s "$out/torch_exactness.jsonl" ] || .venv/bin/python scripts/check_torch_exactness.py "$target" "$dtype" \
  > "$out/torch_exactness.jsonl"
bench() { $specdec bench --repeats 1 --no-progress --resume --methods off,ngram,draft,auto "$@"; }
bench --backend llama.cpp --per-category 2 --max-tokens 64 --out "$out/llama.cpp"
bench --backend torch --dtype "$dtype" --inexact --per-category 2 --max-tokens 64 --peer hf-assisted \
  --out "$out/torch-$dtype-inexact-2x64"
