import json, subprocess, os, statistics, collections
from specdec.bench.datasets import load_prompts
prompts = load_prompts("spec-bench", per_category=2)
libs = {"avx2": None, "avx512": "/tmp/ik/x512/ik_llama_cpp/lib/libllama.so"}
procs = {}
for name, lib in libs.items():
    env = dict(os.environ)
    if lib: env["IK_LLAMA_CPP_LIB_PATH"] = lib
    else: env.pop("IK_LLAMA_CPP_LIB_PATH", None)
    procs[name] = subprocess.Popen([".venv/bin/python", "/tmp/s10/ab/worker.py"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    json.loads(procs[name].stdout.readline())
res = collections.defaultdict(list)
out = open("/tmp/s10/ab/results2.jsonl", "w")
for rep in range(2):
    for i, p in enumerate(prompts):
        order = list(libs) if (i + rep) % 2 == 0 else list(libs)[::-1]
        for method in (("off", "auto") if rep % 2 == 0 else ("auto", "off")):
            for name in order:
                procs[name].stdin.write(json.dumps({"prompt": p.text, "method": method}) + "\n"); procs[name].stdin.flush()
                r = json.loads(procs[name].stdout.readline())
                r.update(lib=name, method=method, prompt=i, category=p.category, rep=rep)
                out.write(json.dumps(r) + "\n"); out.flush()
