"""Old and new trees alternating: per run and level, auto/off aggregate (tokens over wave seconds)
and per wave (off's wave seconds over auto's, the same prompts), TTFT medians, texts."""
import glob, json, os, statistics, sys
from collections import defaultdict

root = sys.argv[1] if len(sys.argv) > 1 else "."
pooled = defaultdict(lambda: defaultdict(list))
for run in sorted(glob.glob(os.path.join(root, "*-[0-9]"))):
    path = os.path.join(run, "server-records.jsonl")
    if not os.path.exists(path):
        continue
    tree = os.path.basename(run).split("-")[0]
    records = [json.loads(line) for line in open(path)]
    by_level = defaultdict(list)
    for r in records:
        by_level[r["level"]].append(r)
    for level, rs in sorted(by_level.items()):
        waves = defaultdict(dict)
        tokens = defaultdict(int)
        ttft = defaultdict(list)
        for r in rs:
            method = r["config"].split(":")[1]
            waves[(r["repeat"], r["wave"])][method] = r["wave_seconds"]
            tokens[method] += r["tokens"] or 0
            ttft[method].append(r["ttft"])
        waves = {k: w for k, w in waves.items() if len(w) == 2}
        if not waves:
            continue
        seconds = {m: sum(w[m] for w in waves.values()) for m in ("off", "auto")}
        agg = {m: tokens[m] / seconds[m] for m in seconds}
        ratios = [round(w["off"] / w["auto"], 3) for _, w in sorted(waves.items())]
        p = pooled[level][tree]
        p.append({"agg": agg["auto"] / agg["off"], "waves": ratios, "off": agg["off"], "auto": agg["auto"],
                  "ttft_off": statistics.median(ttft["off"]), "ttft_auto": statistics.median(ttft["auto"]),
                  "ttft_mean_off": statistics.mean(ttft["off"]), "ttft_mean_auto": statistics.mean(ttft["auto"])})
        print(f"{os.path.basename(run):6} L{level}: auto/off {agg['auto'] / agg['off']:.3f} (off {agg['off']:.2f}, auto {agg['auto']:.2f} tok/s) "
              f"waves {ratios} TTFT median off {p[-1]['ttft_off']:.2f} auto {p[-1]['ttft_auto']:.2f} mean off {p[-1]['ttft_mean_off']:.2f} auto {p[-1]['ttft_mean_auto']:.2f}")
print()
for level in sorted(pooled):
    for tree, runs in sorted(pooled[level].items()):
        waves = [x for r in runs for x in r["waves"]]
        print(f"L{level} {tree}: auto/off aggregate {[round(r['agg'], 3) for r in runs]}; per wave median {statistics.median(waves):.3f} "
              f"lowest {min(waves):.3f} (n={len(waves)}); off tok/s {[round(r['off'], 2) for r in runs]}, auto {[round(r['auto'], 2) for r in runs]}; "
              f"TTFT mean off {[round(r['ttft_mean_off'], 2) for r in runs]} auto {[round(r['ttft_mean_auto'], 2) for r in runs]}")

print()
# Every request's TTFT pooled over both runs of a tree, and tokens over wave seconds.
ttft, totals = defaultdict(list), defaultdict(lambda: [0, 0.0])
for run in sorted(glob.glob(os.path.join(root, "*-[0-9]"))):
    tree, seen = os.path.basename(run).split("-")[0], {}
    for line in open(os.path.join(run, "server-records.jsonl")):
        r = json.loads(line)
        method = r["config"].split(":")[1]
        for key in ((r["level"], method, tree), (r["level"], "all", tree)):
            ttft[key].append(r["ttft"])
        totals[(r["level"], method, tree)][0] += r["tokens"] or 0
        seen[(r["level"], method, r["repeat"], r["wave"])] = r["wave_seconds"]
    for (level, method, _, _), seconds in seen.items():
        totals[(level, method, tree)][1] += seconds
for level in sorted({key[0] for key in ttft}):
    for method in ("off", "auto", "all"):
        old, new = ttft[(level, method, "old")], ttft[(level, method, "new")]
        line = (f"L{level} {method:4}: TTFT mean old {statistics.mean(old):.2f} new {statistics.mean(new):.2f} "
                f"({statistics.mean(new) / statistics.mean(old):.2f}x); median old {statistics.median(old):.2f} "
                f"new {statistics.median(new):.2f}")
        if method != "all":
            (to, so), (tn, sn) = totals[(level, method, "old")], totals[(level, method, "new")]
            line += f"; aggregate tok/s old {to / so:.2f} new {tn / sn:.2f}"
        print(line)
