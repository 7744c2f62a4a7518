#!/bin/bash
# Old (7456314) and new (3e21426) trees alternating: 3 sessions on 1 slot, off and auto.
cd /work/main
for tree in old new new old; do
  src=/work/main/src; [ $tree = old ] && src=/work/old/src
  n=$(ls -d OUT/$tree-* 2>/dev/null | wc -l)
  PYTHONPATH=$src .venv/bin/python -m specdec.cli bench --sessions 3 --session-concurrency 1,3 --concurrency 1 \
    --methods off,auto --cache-ram 8192 --max-tokens 64 --repeats 1 --out OUT/$tree-$n > OUT/$tree-$n.log 2>&1
  echo "$tree-$n done $(date)"
done
