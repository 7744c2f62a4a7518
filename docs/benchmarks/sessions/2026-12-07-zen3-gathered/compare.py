"""Old (7456314) against new (3e21426) trees, run as run.sh alternates them: per config and level, medians
of the runs; per later turn, old/new; and restored (three on one slot) over resident (one at a time).
Usage: python compare.py FOLDER"""
import json, glob, statistics as st, sys
from collections import defaultdict
runs = sorted(glob.glob(sys.argv[1] + "/*-[0-9]/session-records.jsonl"))
data = defaultdict(list)  # (tree, config, level) -> records
by_turn = defaultdict(dict)  # (config, level, session, turn) -> {run: seconds}
for path in runs:
    run = path.split("/")[-2]
    tree = run.split("-")[0]
    for line in open(path):
        r = json.loads(line)
        if r["error"]:
            print("error", run, r["config"], r["error"]); continue
        data[(tree, r["config"], r["level"])].append(r)
        by_turn[(r["config"], r["level"], r["session"], r["turn"])].setdefault(tree, []).append(r)
def q(xs):
    xs = sorted(xs); n = len(xs)
    return f"{st.median(xs):.3f} ({xs[n//4]:.3f}-{xs[(3*n)//4]:.3f})"
print("tree config level | n | turn s | TTFT later | decode tok/s later | total s")
for key in sorted(data):
    rs = data[key]; later = [r for r in rs if r["turn"] > 0]
    print(key, len(rs), q([r["seconds"] for r in rs]), q([r["ttft"] for r in later]),
          q([r["decode_tokens_per_second"] for r in later]), f"{sum(r['seconds'] for r in rs):.0f}")
print("per later turn, old/new medians of runs:")
for config in sorted({k[1] for k in data}):
    for level in sorted({k[2] for k in data}):
        for field in ("seconds", "ttft", "decode_tokens_per_second"):
            ratios = []
            for (c, l, s, t), trees in by_turn.items():
                if c == config and l == level and t > 0 and "old" in trees and "new" in trees:
                    o = st.median(r[field] for r in trees["old"]); n = st.median(r[field] for r in trees["new"])
                    ratios.append(o / n if field != "decode_tokens_per_second" else n / o)
            if ratios:
                print(config, level, field, "new better by", q(ratios), "n", len(ratios))
print("restored (level 3) over resident (level 1), per later turn, same tree:")
for tree in ("old", "new"):
    for config in sorted({k[1] for k in data}):
        for field in ("ttft", "seconds"):
            ratios = []
            for (c, l, s, t), trees in by_turn.items():
                if c == config and l == 3 and t > 0 and tree in trees:
                    one = by_turn.get((c, 1, s, t), {}).get(tree)
                    if one:
                        ratios.append(st.median(r[field] for r in trees[tree]) / st.median(r[field] for r in one))
            print(tree, config, field, q(ratios), "n", len(ratios))
