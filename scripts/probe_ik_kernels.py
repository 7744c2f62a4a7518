"""Probe ik_llama.cpp's kernels for the exactness rules in bindings/ik_llama.py (docs/exactness.md).

On the target, through specdec's ctypes binding, no engine in between:
1. rows: after caches of 300, 3000 and 4000 tokens, with flash attention off and on, which batch
   sizes n (2..40, 48, 63, 64) give logits different from n one-token steps;
2. prompt splits: the same 700-token prompt processed in differently split chunks;
3. shared cache: a sequence's logits when other sequences hold cells of the same context;
4. flash attention with two sequences in one context (in a child process: ik aborts);
5. cost per round for 4 streams: a context per stream vs one shared context (one llama_decode);
6. prompt processing speed in 64-row chunks (exact mode's) vs 512-row chunks;
7. run-time repacking (the draft model's layout, and the target's under --repacked): step time and
   batch exactness against 1-row and padded 2-row steps, both models.
Prints one JSON line per finding. Not run in CI (about 15 minutes on 2 cores).

    .venv/bin/python scripts/probe_ik_kernels.py [--only rows,splits,shared,fa,streams,prefill,repack] [--out FILE]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time

import numpy as np

from specdec.backends.base import aligned_chunks
from specdec.backends.bindings.base import ContextOptions
from specdec.backends.bindings.ik_llama import binding
from specdec.bench.datasets import spec_bench_path
from specdec.models.registry import TARGET, default_path


class Probe:
    def __init__(self, threads: int):
        self.lib = binding()
        self.model = self.lib.load_model(default_path(TARGET))
        self.vocab = self.lib.vocab(self.model)
        self.n_vocab = self.lib.n_vocab(self.vocab)
        self.threads = threads
        self.batch = self.lib.batch_init(512, 4)
        text = spec_bench_path().read_text(encoding="utf-8")
        data = text.encode()
        buffer = (ctypes.c_int32 * len(data))()
        self.tokens = list(buffer[:self.lib.tokenize(self.vocab, data, buffer, len(data), False)])

    def context(self, n_ctx: int, n_seq: int, flash_attn: bool):
        return self.lib.new_context(self.model, ContextOptions(n_ctx * n_seq, 512, n_seq, self.threads, flash_attn))

    def decode(self, ctx, rows, logits=True):
        """rows: (seq_id, position, token); returns [len(rows), vocab] when logits."""
        for i, (seq, position, token) in enumerate(rows):
            self.batch.token[i], self.batch.pos[i], self.batch.n_seq_id[i] = token, position, 1
            self.batch.seq_id[i][0], self.batch.logits[i] = seq, logits
        self.batch.n_tokens = len(rows)
        assert self.lib.decode(ctx, self.batch, None) == 0
        if logits:
            return np.stack([np.ctypeslib.as_array(self.lib.logits_ith(ctx, i), shape=(self.n_vocab,)).copy()
                             for i in range(len(rows))])

    def prefill(self, ctx, seq, chunks, offset=0):
        for start, end in chunks:
            self.decode(ctx, [(seq, p, self.tokens[offset + p]) for p in range(start, end)], logits=False)


def aligned(start, end, size=64):
    """(start, end) of the chunks that process positions start..end-1 ending at multiples of size."""
    return [(start + offset, start + offset + n) for offset, n in aligned_chunks(start, end - start, size)]


def rows_vs_steps(probe: Probe, flash_attn: bool):
    ctx = probe.context(4200, 1, flash_attn)
    for cache in (300, 3000, 4000):
        probe.lib.seq_rm(ctx, -1, 0)
        probe.prefill(ctx, 0, aligned(0, cache))
        steps = np.stack([probe.decode(ctx, [(0, cache + i, probe.tokens[cache + i])])[0] for i in range(64)])
        differing = {}
        for n in [*range(2, 41), 48, 63, 64]:
            probe.lib.seq_rm(ctx, 0, cache)
            batched = probe.decode(ctx, [(0, cache + i, probe.tokens[cache + i]) for i in range(n)])
            difference = float(np.abs(batched - steps[:n]).max())
            if difference:
                differing[n] = round(difference, 3)
        yield {"probe": "rows_vs_steps", "flash_attn": flash_attn, "cache": cache,
               "exact_up_to": min(differing, default=65) - 1, "differing_rows": differing}
    probe.lib.free_context(ctx)


def prompt_splits(probe: Probe):
    ctx = probe.context(1024, 1, False)
    length = 700

    def next_logits(chunks):
        probe.lib.seq_rm(ctx, -1, 0)
        probe.prefill(ctx, 0, chunks)
        return probe.decode(ctx, [(0, length, probe.tokens[length])])[0]

    reference = next_logits(aligned(0, length))
    splits = {"first 128 rows in one call, then 64-aligned": [(0, 128), *aligned(128, length)],
              "first 512 rows in one call, then the rest": [(0, 512), (512, length)],
              "last 60 rows as 50 + 10": [*aligned(0, 640), (640, 690), (690, length)],
              "32-row chunks (last one 28 rows)": aligned(0, length, 32),
              "8-row chunks": aligned(0, length, 8)}
    for name, chunks in splits.items():
        yield {"probe": "prompt_splits", "vs": "64-row chunks", "split": name,
               "max_logit_difference": float(np.abs(next_logits(chunks) - reference).max())}
    probe.lib.free_context(ctx)


def shared_cache(probe: Probe):
    ctx = probe.context(2048, 4, False)
    length = 700
    probe.prefill(ctx, 0, aligned(0, length))
    alone = probe.decode(ctx, [(0, length, probe.tokens[length])])[0]
    probe.lib.seq_rm(ctx, -1, 0)
    probe.prefill(ctx, 1, aligned(0, 900), offset=5000)
    probe.prefill(ctx, 2, aligned(0, 300), offset=9000)
    probe.prefill(ctx, 0, aligned(0, length))
    after_others = probe.decode(ctx, [(0, length, probe.tokens[length])])[0]
    yield {"probe": "shared_cache", "case": "prompt processed after two other sequences' prompts",
           "max_logit_difference": float(np.abs(after_others - alone).max())}
    probe.lib.seq_rm(ctx, -1, 0)
    probe.prefill(ctx, 0, aligned(0, length))
    steps_alone = [probe.decode(ctx, [(0, length + i, probe.tokens[length + i])])[0] for i in range(40)]
    probe.lib.seq_rm(ctx, -1, 0)
    probe.prefill(ctx, 0, aligned(0, length))
    probe.prefill(ctx, 1, aligned(0, 300), offset=5000)
    together = [probe.decode(ctx, [(0, length + i, probe.tokens[length + i]),
                                   (1, 300 + i, probe.tokens[5300 + i])])[0] for i in range(40)]
    yield {"probe": "shared_cache", "case": "40 one-token steps batched with another sequence's",
           "max_logit_difference": float(np.abs(np.stack(together) - np.stack(steps_alone)).max())}
    probe.lib.free_context(ctx)


def flash_attention_with_two_sequences(threads: int):
    code = ("import runpy, sys; sys.argv = ['probe', '--child-fa-two-sequences', '--threads', '%d']; "
            "runpy.run_path(%r, run_name='__main__')" % (threads, __file__))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    tail = [line for line in child.stderr.splitlines() if "GGML_ASSERT" in line][-1:]
    yield {"probe": "flash_attention_two_sequences", "exit_code": child.returncode, "stderr": tail}


def child_fa_two_sequences(probe: Probe) -> None:
    ctx = probe.context(1024, 2, True)
    probe.prefill(ctx, 0, aligned(0, 300))
    probe.prefill(ctx, 1, aligned(0, 200), offset=5000)
    for i in range(8):
        probe.decode(ctx, [(0, 300 + i, probe.tokens[300 + i]), (1, 200 + i, probe.tokens[5200 + i])])
    print("no abort")


def streams_cost(probe: Probe, repeats: int = 7):
    streams, length = 4, 300
    setups = {"a context per stream": [probe.context(1024, 1, False) for _ in range(streams)],
              "one shared context, one call": [probe.context(1024, streams, False)]}
    for contexts in setups.values():
        for s in range(streams):
            ctx, seq = (contexts[s], 0) if len(contexts) > 1 else (contexts[0], s)
            probe.prefill(ctx, seq, aligned(0, length), offset=1000 * s)
    times = {}
    for _ in range(repeats):
        for name, contexts in setups.items():
            for rows in (1, 4):
                t0 = time.perf_counter()
                if len(contexts) > 1:
                    for s in range(streams):
                        probe.decode(contexts[s], [(0, length + i, probe.tokens[1000 * s + length + i]) for i in range(rows)])
                else:
                    probe.decode(contexts[0], [(s, length + i, probe.tokens[1000 * s + length + i])
                                               for s in range(streams) for i in range(rows)])
                times.setdefault((name, rows), []).append(time.perf_counter() - t0)
                for s in range(streams):
                    ctx, seq = (contexts[s], 0) if len(contexts) > 1 else (contexts[0], s)
                    probe.lib.seq_rm(ctx, seq, length)
    for (name, rows), seconds in times.items():
        yield {"probe": "streams_cost", "streams": streams, "rows_per_stream": rows, "setup": name,
               "median_ms": round(statistics.median(seconds) * 1e3, 1),
               "min_ms": round(min(seconds) * 1e3, 1), "max_ms": round(max(seconds) * 1e3, 1)}


def prefill_speed(probe: Probe, repeats: int = 3):
    ctx = probe.context(2048, 1, False)
    length = 1500
    times = {}
    for _ in range(repeats):
        for size in (64, 512):
            probe.lib.seq_rm(ctx, -1, 0)
            t0 = time.perf_counter()
            probe.prefill(ctx, 0, aligned(0, length, size))
            times.setdefault(size, []).append(time.perf_counter() - t0)
    for size, seconds in times.items():
        yield {"probe": "prefill_speed", "prompt_tokens": length, "chunk_rows": size,
               "median_tokens_per_second": round(length / statistics.median(seconds), 1),
               "min_seconds": round(min(seconds), 2), "max_seconds": round(max(seconds), 2)}
    probe.lib.free_context(ctx)


def repacking(probe: Probe, repeats: int = 15):
    """Both models as stored and repacked: a step's time, and whether 8 batched rows give the
    logits of one-token steps (1-row calls) and of padded steps (each position in a 2-row call
    whose second row is dropped: what REPACKED_EXACT_RULES' min_rows makes of a step). For the
    repacked target also calls of 2..64 rows against padded and one-row steps, after 300 and 3000
    tokens (with scripts/patch_ik_llama_cpp.sh's build, both hold)."""
    from specdec.models.registry import DRAFT

    lib = probe.lib
    tokens = probe.tokens
    for role, spec in (("draft", DRAFT), ("target", TARGET)):
        for repack in (False, True):
            model = lib.load_model(default_path(spec), repack=repack)
            ctx = lib.new_context(model, ContextOptions(4200, 512, 1, probe.threads, False))
            n_vocab = lib.n_vocab(lib.vocab(model))
            saved, probe.model, probe.n_vocab = (probe.model, probe.n_vocab), model, n_vocab

            def steps(cache, n, rows_per_call):
                out = []
                for i in range(n):
                    probe.lib.seq_rm(ctx, 0, cache + i)
                    call = [(0, cache + i + j, tokens[cache + i + j]) for j in range(rows_per_call)]
                    out.append(probe.decode(ctx, call)[0])
                return np.stack(out)

            def batched(cache, n):
                probe.lib.seq_rm(ctx, 0, cache)
                return probe.decode(ctx, [(0, cache + i, tokens[cache + i]) for i in range(n)])

            probe.prefill(ctx, 0, aligned(0, 300))
            one_row, padded, eight = steps(300, 8, 1), steps(300, 8, 2), batched(300, 8)
            seconds = []
            for _ in range(repeats):
                probe.lib.seq_rm(ctx, 0, 300)
                t0 = time.perf_counter()
                probe.decode(ctx, [(0, 300, tokens[300])])
                seconds.append(time.perf_counter() - t0)
            finding = {"probe": "repacking", "model": role, "repack": repack,
                       "step_ms_median": round(statistics.median(seconds) * 1e3, 1),
                       "max_logit_difference_8_rows_vs_one_row_steps": float(np.abs(eight - one_row).max()),
                       "max_logit_difference_8_rows_vs_padded_steps": float(np.abs(eight - padded).max())}
            if role == "target" and repack:
                for cache in (300, 3000):
                    probe.lib.seq_rm(ctx, -1, 0)
                    probe.prefill(ctx, 0, aligned(0, cache))
                    for name, rows_per_step in (("padded", 2), ("one_row", 1)):
                        reference = steps(cache, 64, rows_per_step)
                        differences = {n: float(np.abs(batched(cache, n) - reference[:n]).max())
                                       for n in [*range(2, 34), 48, 63, 64]}
                        finding[f"rows_differing_from_{name}_steps_after_{cache}"] = {
                            n: round(difference, 3) for n, difference in differences.items() if difference}
            yield finding
            probe.model, probe.n_vocab = saved
            lib.free_context(ctx)
            lib.free_model(model)


PROBES = {"rows": lambda probe, args: (*rows_vs_steps(probe, False), *rows_vs_steps(probe, True)),
          "splits": lambda probe, args: prompt_splits(probe),
          "shared": lambda probe, args: shared_cache(probe),
          "fa": lambda probe, args: flash_attention_with_two_sequences(args.threads),
          "streams": lambda probe, args: streams_cost(probe),
          "prefill": lambda probe, args: prefill_speed(probe),
          "repack": lambda probe, args: repacking(probe)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default=",".join(PROBES), help="comma-separated probes to run")
    parser.add_argument("--out")
    parser.add_argument("--child-fa-two-sequences", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    probe = Probe(args.threads)
    if args.child_fa_two_sequences:
        child_fa_two_sequences(probe)
        return 0
    out = open(args.out, "a") if args.out else None
    for finding in (finding for name in args.only.split(",") for finding in PROBES[name](probe, args)):
        line = json.dumps(finding)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
