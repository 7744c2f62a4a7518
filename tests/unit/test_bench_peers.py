"""Peers: rows say "not run" when no binary is given, never numbers; with a binary, llama-server is
started on loopback with the draft flags, asked over its OpenAI endpoint, and stopped. A small
stand-in script plays llama-server here, so the test needs no model and no network."""
import json
import stat
import sys
import textwrap
import urllib.request

import pytest

from specdec.bench.datasets import BenchPrompt
from specdec.bench import peers
from specdec.bench.peers import (HF_NOT_GIVEN, HF_NOT_INSTALLED, NOT_GIVEN, RUN, ServerOptions, parse_peers,
                                 peer_status, run_llama_server)
from specdec.bench.records import RecordFile
from specdec.bench.report import build_report
from specdec.bench.runner import BenchSettings
from specdec.types import SpecdecError

FAKE_SERVER = textwrap.dedent('''
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    argv = sys.argv[1:]
    opt = lambda name: argv[argv.index(name) + 1] if name in argv else None
    log = open(LOG, "a")
    log.write(json.dumps({"argv": argv}) + "\\n"); log.flush()
    state = {"health": 0}
    drafting = opt("--spec-type") is not None

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            state["health"] += 1
            if state["health"] < 3:
                self._send(503, {"error": {"message": "Loading model"}})
            else:
                self._send(200, {"status": "ok"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            log.write(json.dumps({"path": self.path, "body": body}) + "\\n"); log.flush()
            timings = {"prompt_n": 12, "prompt_ms": 30.0, "predicted_n": body["max_tokens"], "predicted_ms": 100.0,
                       "predicted_per_second": 40.0 if drafting else 20.0}
            if drafting:
                timings.update(draft_n=20, draft_n_accepted=15)
            self._send(200, {"choices": [{"message": {"role": "assistant", "content": "hi " + body["messages"][-1]["content"]},
                                          "finish_reason": "length"}], "timings": timings})

    HTTPServer(("127.0.0.1", int(opt("--port"))), Handler).serve_forever()
''')

PROMPTS = [BenchPrompt("1", "qa", ({"role": "user", "content": "why?"},)),
           BenchPrompt("2", "math", ({"role": "user", "content": "2+2?"},))]


def fake_binary(tmp_path, body=FAKE_SERVER):
    path = tmp_path / "llama-server"
    log = tmp_path / "server-log.jsonl"
    path.write_text(f"#!{sys.executable}\nLOG = {str(log)!r}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path, log


def test_peers_not_given_are_not_run(monkeypatch):
    status = peer_status(parse_peers([]))
    assert status == {"llama-server": NOT_GIVEN, "hf-assisted": HF_NOT_GIVEN}
    monkeypatch.setattr(peers, "torch_installed", lambda: False)
    assert peer_status(parse_peers(["hf-assisted"]))["hf-assisted"] == HF_NOT_INSTALLED
    monkeypatch.setattr(peers, "torch_installed", lambda: True)
    assert peer_status(parse_peers(["hf-assisted"]))["hf-assisted"] == RUN


def test_peer_arguments_are_checked(tmp_path):
    with pytest.raises(SpecdecError, match="unknown peer"):
        parse_peers(["vllm"])
    with pytest.raises(SpecdecError, match="llama-server=PATH"):
        parse_peers(["llama-server"])
    with pytest.raises(SpecdecError, match="does not exist"):
        parse_peers([f"llama-server={tmp_path / 'nope'}"])


def test_server_command_has_the_speculative_flags():
    cmd = ServerOptions("bin", "t.gguf", "d.gguf", 4, 2048, 2, "draft-simple").command(8080)
    assert cmd[:3] == ["bin", "-m", "t.gguf"]
    assert " ".join(cmd).endswith("-md d.gguf --spec-type draft-simple --spec-draft-n-max 4")
    assert "--host" in cmd and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    lookup = ServerOptions("bin", "t.gguf", None, 3, spec_type="ngram-simple").command(8080)
    assert " ".join(lookup).endswith("--spec-type ngram-simple --spec-draft-n-max 3") and "-md" not in lookup
    assert "--spec-type" not in ServerOptions("bin", "t.gguf").command(8080)


def test_llama_server_is_run_on_the_same_prompts_and_reported(tmp_path):
    binary, log = fake_binary(tmp_path)
    settings = BenchSettings(max_tokens=16, temperature=0.0, repeats=1, warmup=1)
    with RecordFile(tmp_path / "records.jsonl") as records:
        counts = run_llama_server(str(binary), PROMPTS, [3], settings, records, "t.gguf", "d.gguf",
                                  tmp_path / "logs", progress=False, startup_timeout=30, ngram_ks=[2])
        assert counts == {"measured": 6, "failed": 0}
        peer_records = list(records.records)
    assert [(r["config"], r["prompt_id"]) for r in peer_records] == [
        ("llama-server:off", "1"), ("llama-server:off", "2"), ("llama-server:draft:k3", "1"), ("llama-server:draft:k3", "2"),
        ("llama-server:ngram:k2", "1"), ("llama-server:ngram:k2", "2")]
    drafted = peer_records[2]
    assert drafted["stats"]["tokens_per_second"] == 40.0
    assert drafted["stats"]["acceptance_rate"] == pytest.approx(0.75)
    assert drafted["text"] == "hi why?"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    starts = [line["argv"] for line in lines if "argv" in line]
    assert len(starts) == 3 and "--spec-type" not in starts[0]
    assert starts[1][starts[1].index("--spec-draft-n-max") + 1] == "3"
    assert starts[2][starts[2].index("--spec-type") + 1] == "ngram-simple" and "-md" not in starts[2]
    bodies = [line["body"] for line in lines if "body" in line]
    assert len(bodies) == 3 * (1 + 2)  # a warm-up and the two prompts per server
    assert all(b["temperature"] == 0.0 and b["cache_prompt"] is False for b in bodies)
    assert bodies[1]["max_tokens"] == 16 and bodies[1]["messages"] == [{"role": "user", "content": "why?"}]
    # both servers were stopped: nothing answers on their ports any more
    for argv in starts:
        port = argv[argv.index("--port") + 1]
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)

    own = [{"source": "specdec", "prompt_id": p.id, "category": p.category, "config": "off", "repeat": 0,
            "success": True, "wall_seconds": 1.0, "stats": {"tokens_per_second": 10.0, "generated_tokens": 16}}
           for p in PROMPTS]
    peer_records = peer_records[:4]  # the report's checks below: off and the draft model
    report = build_report(own + peer_records, {"temperature": 0.0},
                          {"llama-server": "run", "hf-assisted": HF_NOT_GIVEN}, tmp_path)
    row = report["peers"]["llama-server"]["configs"]["llama-server:draft:k3"]
    assert row["speedup_mean"] == pytest.approx(2.0)  # vs its own no-draft run
    assert row["speedup_vs_specdec_off"] == pytest.approx(4.0)
    markdown = (tmp_path / "report.md").read_text()
    assert "| llama-server | llama-server:draft:k3 | 2 | 40.00 |" in markdown
    assert "| hf-assisted | — | — | not run: not requested (--peer hf-assisted) |" in markdown
    assert (row["identical_text_to_own_off"], row["compared_with_own_off"]) == (2, 2)  # the stand-in echoes the prompt
    assert "| 2/2 |" in next(line for line in markdown.splitlines() if "| llama-server:draft:k3 |" in line)
    assert next(line for line in markdown.splitlines() if "| llama-server:off |" in line).endswith("| — |")


def test_a_server_that_does_not_start_gives_error_records(tmp_path):
    binary, _ = fake_binary(tmp_path, body="import sys\nsys.exit(3)\n")
    settings = BenchSettings(max_tokens=8, warmup=0)
    with RecordFile(tmp_path / "records.jsonl") as records:
        counts = run_llama_server(str(binary), PROMPTS, [], settings, records, "t.gguf", None,
                                  tmp_path / "logs", progress=False, startup_timeout=30)
        assert counts["failed"] == 2
        assert all(not r["success"] and "exited with code 3" in r["error"] for r in records.records)


def test_bench_command_runs_the_peer_after_its_own_configurations(tmp_path):
    import argparse

    from specdec.backends.fake import FakeBackend
    from specdec.bench.cli import add_arguments, run_bench
    from specdec.engine.engine import Engine

    binary, log = fake_binary(tmp_path)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"id": "a", "prompt": "the cat"}\n{"id": "b", "prompt": "sat on"}\n')
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--dataset", str(data), "--out", str(tmp_path / "out"), "--max-tokens", "8",
                              "--methods", "off,draft:k2", "--warmup", "0", "--no-progress",
                              "--model", "t.gguf", "--draft-model", "d.gguf", "--threads", "2",
                              "--peer", f"llama-server={binary}"])
    engine = Engine(FakeBackend(seed=7), FakeBackend(seed=7, noise=0.6))
    assert run_bench(args, engine_factory=lambda a: engine) == 0
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    assert [r["config"] for r in records] == ["off", "draft:k2"] * 2 + ["llama-server:off"] * 2 + ["llama-server:draft:k2"] * 2
    starts = [json.loads(line)["argv"] for line in log.read_text().splitlines() if "argv" in line]
    assert starts[1][starts[1].index("-md") + 1] == "d.gguf" and starts[1][starts[1].index("-t") + 1] == "2"
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["peers"]["llama-server"]["status"] == "run"
    assert set(report["peers"]["llama-server"]["configs"]) == {"llama-server:off", "llama-server:draft:k2"}
    assert report["configs"] == ["off", "draft:k2"]  # peers are not mixed into our own tables
