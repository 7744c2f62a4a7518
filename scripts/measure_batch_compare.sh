#!/usr/bin/env bash
# Issue 5's measurement: `specdec batch --compare` on 40 Spec-Bench prompts (8 per category of the
# five non-MT-Bench categories, 128 tokens) against specdec's own server, at concurrency 1 and 4.
# Usage: bash scripts/measure_batch_compare.sh OUT_DIR [SPECULATIVE_METHOD] [MACHINE_HOUR_PRICE]
set -euo pipefail
out=${1:?output directory}
method=${2:-ngram}
price=${3:-0.08}
port=8123
mkdir -p "$out"
py=.venv/bin/python
$py scripts/spec_bench_batch_input.py --per-category 8 --out "$out/input.jsonl" \
  --categories translation summarization qa math_reasoning rag
.venv/bin/specdec serve --port $port --log-level warning > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
for c in 1 4; do
  .venv/bin/specdec batch "$out/input.jsonl" --out "$out/results-c$c.jsonl" \
    --base-url http://127.0.0.1:$port/v1 --concurrency $c --max-tokens 128 --temperature 0 \
    --speculative "$method" --compare --machine-hour-price "$price" \
    --report "$out/report-c$c.md" --no-progress
done
