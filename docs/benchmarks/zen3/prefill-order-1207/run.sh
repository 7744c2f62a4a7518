#!/bin/bash
# Old (9411b4c) and new (prefill order) trees alternating: auto and off at 2, 4 and 8 streams through HTTP.
# Trees: git worktree add /tmp/wt-old 9411b4c; git worktree add /tmp/wt-new 874ec12.
cd /work/main
for tree in new old old new; do
  src=/tmp/wt-$tree/src
  n=$(ls -d OUT/$tree-[0-9] 2>/dev/null | wc -l)
  PYTHONPATH=$src .venv/bin/python -m specdec.cli bench --server --methods off,auto --concurrency 2,4,8 \
    --per-category 2 --max-tokens 128 --repeats 1 --no-progress --out OUT/$tree-$n > OUT/$tree-$n.log 2>&1
  echo "$tree-$n done $(date)"
done
