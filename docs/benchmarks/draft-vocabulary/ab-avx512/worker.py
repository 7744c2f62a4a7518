import json, sys
from specdec.runtime import load_engine
from specdec.backends.registry import ModelConfig, BackendConfig
from specdec.types import GenerationRequest, SpecConfig
eng = load_engine(ModelConfig(backend=BackendConfig("ik_llama.cpp", repacked=True)))
eng.calibrate()
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    ids = tuple(eng.encode_prompt(cmd["prompt"], chat=True))
    eng.clear_cache()
    eng.reset_cross_request_state()
    r = eng.generate(GenerationRequest(ids, 128, spec=SpecConfig(cmd["method"], 3)))
    print(json.dumps({"tps": r.stats["tokens_per_second"], "tokens": r.token_ids, "choices": r.stats["choices"]}), flush=True)
