"""specdec on a Ray cluster started separately, as the multi-node recipe of docs/scale-out.md has
it: `ray start --head` (one node of 2 CPUs, the dashboard on), started once for the module with
the proxy's middleware and the fake engine in its environment. `serve deploy` of a Serve config
file, then `serve shutdown`; `specdec serve --ray --address` serves, stops on SIGTERM with exit 0
and leaves the cluster running without its app; and a second one refuses a --port other than
that of the Serve already running there."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")
yaml = pytest.importorskip("yaml")

from test_ray_serve import FLAGS, MODEL, answer, free_ports, ray_env, served_by, wait_for_answer  # noqa: E402

# FLAGS as a Serve config's args: the configuration's sections.
SERVE_ARGS = {"slots": 4, "models": {"target": "fake.gguf"},
              "server": {"max_queue": 64, "served_model_name": MODEL, "drain_grace": 5, "spec": {"method": "ngram"}},
              "scale": {"replicas": 2, "threads_per_replica": 1, "engine_factory": "fakes.fake_serve:fake_engine"}}

pytestmark = pytest.mark.timeout(240)

BIN = Path(sys.executable).parent  # `ray` and `serve` of this environment


def cluster_env() -> dict:
    """The environment of the head and of every command that talks to it. Token authentication off:
    Ray 2.60 turns it on for a `ray start` when ~/.ray/auth_token exists, and its `serve` command
    then fails unless RAY_AUTH_MODE=token is set too; the cluster listens on loopback only."""
    return {**ray_env(), "RAY_AUTH_MODE": "disabled"}


@dataclass
class Head:
    gcs: str  # what `--address` takes: 127.0.0.1:PORT
    dashboard: str  # what `serve deploy --address` takes: http://127.0.0.1:PORT


def own_processes(marker: str) -> list[int]:
    """The processes whose command line names `marker` (this module's Ray temp dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


@pytest.fixture(scope="module")
def head():
    # Its own temp dir: `ray start` records its address there, not in /tmp/ray where any other
    # ray.init() on this machine would find and join it. Short: Ray's sockets live under it.
    temp_dir = tempfile.mkdtemp(prefix="rx", dir="/tmp")
    gcs, dashboard, node_manager, object_manager, client_server, metrics_export, agent_grpc, runtime_env_agent, \
        agent_listen = free_ports(9)
    command = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
               "--num-cpus", "2", "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
               "--dashboard-port", str(dashboard), "--node-manager-port", str(node_manager),
               "--object-manager-port", str(object_manager), "--ray-client-server-port", str(client_server),
               "--metrics-export-port", str(metrics_export), "--dashboard-agent-grpc-port", str(agent_grpc),
               "--runtime-env-agent-port", str(runtime_env_agent), "--dashboard-agent-listen-port",
               str(agent_listen), "--temp-dir", temp_dir, "--disable-usage-stats"]
    log = tempfile.TemporaryFile()
    # Its own session: the head and everything it starts end with the group, and nothing else.
    process = subprocess.Popen(command, env=cluster_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # The dashboard's Serve API answers once the head is up: what `serve deploy` talks to.
        wait_for_answer(lambda: httpx.get(f"http://127.0.0.1:{dashboard}/api/serve/applications/", timeout=5),
                        process, log, "ray start --head")
        yield Head(f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}")
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 5
            while own_processes(temp_dir) and time.monotonic() < deadline:
                time.sleep(0.5)
        for pid in own_processes(temp_dir):  # any that left the group
            os.kill(pid, signal.SIGKILL)
        process.wait(10)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def run(command: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=cluster_env(), capture_output=True, text=True, timeout=timeout)


def cluster_state(head: Head) -> tuple[int, list[str]]:
    """(alive nodes, Serve applications) of the cluster, asked from a process of its own."""
    code = ("import sys, ray; from ray import serve; ray.init(address=sys.argv[1], log_to_driver=False);"
            "print('nodes', sum(n['Alive'] for n in ray.nodes())); print('apps', *serve.status().applications)")
    result = run([sys.executable, "-c", code, head.gcs], timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    nodes, apps = (line.split()[1:] for line in result.stdout.splitlines() if line.startswith(("nodes ", "apps")))
    return int(nodes[0]), apps


def wait_for_replicas(url: str, n: int, timeout: float = 90.0) -> set[str]:
    """The replicas that answered, once `n` different ones have (requests under 16 keys at a time)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            seen = {served_by(url, f"key-{i}") for i in range(16)}
            if len(seen) == n:
                return seen
        except (httpx.TransportError, AssertionError):  # the proxy or the app still starting
            pass
        assert time.monotonic() < deadline, f"{n} replicas did not answer at {url}"
        time.sleep(0.5)


def test_serve_deploy_a_config_file_then_serve_shutdown(head, tmp_path):
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    # The shape docs/scale-out.md gives, on loopback and a free port.
    config = {"proxy_location": "EveryNode", "http_options": {"host": "127.0.0.1", "port": port},
              "applications": [{"name": "specdec", "route_prefix": "/", "import_path": "specdec.deploy.app:build",
                                "args": SERVE_ARGS}]}
    (tmp_path / "specdec-serve.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    deployed = run([str(BIN / "serve"), "deploy", str(tmp_path / "specdec-serve.yaml"), "--address", head.dashboard])
    assert deployed.returncode == 0, deployed.stderr[-2000:]
    assert len(wait_for_replicas(url, 2)) == 2
    assert answer(url, "key-0").json()["model"] == MODEL
    stopped = run([str(BIN / "serve"), "shutdown", "-y", "--address", head.dashboard])
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    deadline = time.monotonic() + 60
    while True:  # Serve's proxy goes with it
        try:
            httpx.get(url + "/health", timeout=5)
        except httpx.TransportError:
            break
        assert time.monotonic() < deadline, "the proxy still answers after `serve shutdown`"
        time.sleep(0.5)
    assert cluster_state(head) == (1, [])


def specdec_serve(head: Head, port: int, log) -> subprocess.Popen:
    command = [sys.executable, "-m", "specdec.cli", "serve", *FLAGS, "--address", head.gcs, "--port", str(port),
               "--log-level", "warning"]
    return subprocess.Popen(command, env=cluster_env(), stdout=subprocess.DEVNULL, stderr=log)


def test_specdec_serve_joins_the_cluster_and_leaves_it_running(head):
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        process = specdec_serve(head, port, log)
        try:
            assert len(wait_for_replicas(url, 2, timeout=120)) == 2, "no answer"
            # Serve's proxy already listens on `port`: another one asked for elsewhere is refused.
            with tempfile.TemporaryFile() as other_log:
                other = specdec_serve(head, free_ports(1)[0], other_log)
                assert other.wait(90) == 2
                other_log.seek(0)
                assert f"HTTP proxy on 127.0.0.1:{port}: pass --host 127.0.0.1 --port {port}" in \
                    other_log.read().decode()
            assert len(wait_for_replicas(url, 2)) == 2  # the first one's app untouched
            process.send_signal(signal.SIGTERM)
            assert process.wait(90) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.seek(0)
            print(log.read().decode(errors="replace")[-3000:])
    # The cluster is still up, without the app; Serve's proxy (which the command does not stop on a
    # cluster it joined) answers 404.
    assert cluster_state(head) == (1, [])
    assert httpx.get(url + "/v1/models", timeout=10).status_code == 404
