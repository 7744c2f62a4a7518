"""Draft K=1 (and off) with the full-vocabulary draft and the reduced one, one process, interleaved per prompt, order alternating."""
import json, sys
from specdec.runtime import load_engine
from specdec.backends.registry import ModelConfig, BackendConfig
from specdec.bench.datasets import load_prompts
from specdec.types import GenerationRequest, SpecConfig
backend = BackendConfig("ik_llama.cpp", repacked=True)
engines = {"full": load_engine(ModelConfig(backend=backend, draft_vocabulary=0)),
           "reduced": load_engine(ModelConfig(backend=backend, draft_vocabulary=32768))}
for e in engines.values():
    e.calibrate()
prompts = load_prompts("spec-bench", per_category=int(sys.argv[2]))
out = open(sys.argv[1], "w")
for rep in range(2):
    for i, p in enumerate(prompts):
        names = list(engines) if (i + rep) % 2 == 0 else list(engines)[::-1]
        for method in (("draft", "off") if rep % 2 else ("off", "draft")):
            for name in names:
                if method == "off" and name == "reduced":
                    continue  # plain decoding does not load the draft: one reference is enough
                e = engines[name]
                ids = tuple(e.encode_prompt(p.text, chat=True))
                e.clear_cache(); e.reset_cross_request_state()
                r = e.generate(GenerationRequest(ids, 128, spec=SpecConfig(method, 1)))
                s = r.stats
                out.write(json.dumps({"prompt": i, "category": p.category, "rep": rep, "vocab": name, "method": method,
                                      "tps": s["tokens_per_second"], "accepted": s["accepted_tokens"], "drafted": s["drafted_tokens"],
                                      "draft_seconds": s["draft_seconds"], "verify_seconds": s["verify_seconds"],
                                      "tokens": r.token_ids}) + "\n")
                out.flush()
