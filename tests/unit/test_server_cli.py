"""`specdec serve`: flags, and a real SIGTERM to a real server process draining a stream."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from specdec.cli import build_parser, main
from specdec.config_flags import config_from_args
from specdec.server.testing import free_port
from specdec.types import DEFAULT_METHOD, SpecdecError

pytestmark = pytest.mark.timeout(60)
SRC = str(Path(__file__).resolve().parents[2] / "src")


def parse(*argv):
    return build_parser().parse_args(["serve", *argv])


def server_config(*argv):
    """The server section `specdec serve ARGV` runs with (its name "x" unless ARGV names one)."""
    return config_from_args(parse("--served-model-name", "x", *argv), keys=True).server


def test_flags_and_defaults(monkeypatch):
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    args = parse()
    assert (args.host, args.port, args.parallel, args.max_tokens, args.method) == ("127.0.0.1", 8000, 4, 1024, DEFAULT_METHOD)
    config = config_from_args(parse("--model", "/m/My-Model.Q4.gguf", "--method", "draft", "--num-draft-tokens", "5",
                                    "--max-queue", "3"), keys=True).server
    assert config.served_model_name == "My-Model.Q4" and config.api_key is None
    assert (config.spec.method, config.spec.num_draft_tokens, config.max_queue) == ("draft", 5, 3)
    monkeypatch.setenv("SPECDEC_API_KEY", "from-env")
    assert server_config().api_key == "from-env"
    assert server_config("--api-key", "flag").api_key == "flag"
    assert server_config("--served-model-name", "coder").served_model_name == "coder"


@pytest.mark.parametrize("argv", [["--parallel", "0"], ["--max-tokens", "0"], ["--max-queue", "-1"],
                                  ["--request-timeout", "0"], ["--method", "draft", "--no-draft"],
                                  ["--num-draft-tokens", "99"]])
def test_bad_flags_are_one_line_errors(argv):
    with pytest.raises(SpecdecError):
        server_config(*argv)


def test_cli_reports_bad_flags_without_traceback(capsys):
    assert main(["serve", "--parallel", "0"]) == 2
    assert "specdec: error: --parallel must be >= 1." in capsys.readouterr().err


RUNNER = """
import sys
import specdec.runtime
from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine

class Slow(FakeBackend):
    def eval(self, *args, **kwargs):
        import time
        time.sleep(0.005)
        return super().eval(*args, **kwargs)

specdec.runtime.load_engine = lambda models, n_slots=1, engine=None: Engine(
    Slow(seed=7), FakeBackend(seed=7, noise=0.6), n_slots=n_slots)
from specdec.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_drains_a_real_server_process():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC}
    process = subprocess.Popen([sys.executable, "-c", RUNNER, "serve", "--port", str(port), "--model", "fake.gguf",
                                "--parallel", "2", "--drain-grace", "20", "--log-level", "warning"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and process.poll() is None, process.stderr.read().decode()
            time.sleep(0.05)
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "fake"
        request = {"model": "fake", "prompt": "the cat", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                   "stream": True}
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json=request, timeout=30) as response:
            for line in response.iter_lines():
                if len(lines) == 3:
                    process.send_signal(signal.SIGTERM)
                lines.append(line)
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert lines[-1] in ("data: [DONE]", "") and "data: [DONE]" in lines
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"][0]["text"]) > 50
        process.wait(20)
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
