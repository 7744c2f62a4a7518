"""The parts of the Ray Serve deployment that need no running cluster: API-key affinity ranking,
the proxy middleware that ends a stream whose replica died, the deployment's options from
`specdec serve` flags, and the flags' checks."""
from __future__ import annotations

import asyncio
import json
import pickle
from types import SimpleNamespace

import pytest

from specdec.cli import main

pytestmark = pytest.mark.timeout(60)


# -- flags ---------------------------------------------------------------------------------------
def test_ray_flags_without_ray_are_refused(capsys):
    assert main(["serve", "--replicas", "2", "--model", "x.gguf"]) == 2
    assert "--replicas is a Ray Serve setting: add --ray" in capsys.readouterr().err
    assert main(["serve", "--upscale-delay", "5", "--model", "x.gguf"]) == 2
    assert "--upscale-delay is a Ray Serve setting: add --ray" in capsys.readouterr().err


ray_serve = pytest.importorskip("ray.serve")


def test_deployment_options_from_serve_flags():
    from specdec.deploy.app import ROUTER, ScaleConfig, deployment_options
    from specdec.deploy.cli import replica_spec, scale_config
    from specdec.server.cli import parse_serve_flags
    from specdec.types import SpecdecError

    args = parse_serve_flags(["--ray", "--model", "t.gguf", "--parallel", "3", "--max-queue", "20", "--drain-grace",
                              "10", "--threads-per-replica", "2", "--min-replicas", "1", "--max-replicas", "4"])
    spec, scale = replica_spec(args), scale_config(args)
    assert spec.slots == 3 and spec.models.threads == 2 and spec.server.drain_grace == 10
    options = deployment_options(spec, scale)
    assert options["ray_actor_options"] == {"num_cpus": 2}
    assert options["max_ongoing_requests"] == 3 and options["max_queued_requests"] == 20
    assert options["graceful_shutdown_timeout_s"] == 15
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1,
                                             "target_ongoing_requests": 3}
    assert options["request_router_config"].request_router_class == ROUTER
    fixed = deployment_options(spec, ScaleConfig(replicas=2))
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    for bad in (ScaleConfig(replicas=0), ScaleConfig(min_replicas=1), ScaleConfig(min_replicas=3, max_replicas=2)):
        with pytest.raises(SpecdecError):
            bad.validate()
    with pytest.raises(SpecdecError, match="--threads-per-replica"):
        replica_spec(parse_serve_flags(["--ray", "--model", "t.gguf", "--threads", "4"]))


def test_autoscaling_delays_from_serve_flags():
    from specdec.deploy.app import build_application, deployment_options
    from specdec.deploy.cli import replica_spec, scale_config
    from specdec.server.cli import parse_serve_flags
    from specdec.types import SpecdecError

    def options(*flags):
        args = parse_serve_flags(["--ray", "--model", "t.gguf", "--parallel", "2", *flags])
        return deployment_options(replica_spec(args), scale_config(args))

    autoscaling = ["--min-replicas", "1", "--max-replicas", "3"]
    delays = options(*autoscaling, "--upscale-delay", "2.5", "--downscale-delay", "0")["autoscaling_config"]
    assert delays["upscale_delay_s"] == 2.5 and delays["downscale_delay_s"] == 0
    only_up = options(*autoscaling, "--upscale-delay", "4")["autoscaling_config"]
    assert only_up["upscale_delay_s"] == 4 and "downscale_delay_s" not in only_up  # Ray's default stays
    assert not {"upscale_delay_s", "downscale_delay_s"} & set(options(*autoscaling)["autoscaling_config"])
    # Ray accepts the config the flags build.
    ray_serve.config.AutoscalingConfig(**delays)
    with pytest.raises(SpecdecError, match="^--downscale-delay is an autoscaling setting: add --min-replicas"):
        options("--replicas", "2", "--downscale-delay", "5")
    with pytest.raises(SpecdecError, match="^--upscale-delay must be >= 0.$"):
        options(*autoscaling, "--upscale-delay", "-1")
    # More of Ray's fields, as a Serve config's `deployments:` section sets them: autoscaling only.
    args = parse_serve_flags(["--ray", "--model", "t.gguf", "--replicas", "2"])
    with pytest.raises(SpecdecError, match="need --min-replicas"):
        build_application(replica_spec(args), scale_config(args), {"look_back_period_s": 2})


# -- API-key affinity ------------------------------------------------------------------------------
def replicas(*ids):
    return [SimpleNamespace(replica_id=SimpleNamespace(unique_id=i)) for i in ids]


def test_rendezvous_ranking_is_stable_and_spreads_keys():
    from specdec.deploy.router import rank_for

    four = replicas("a", "b", "c", "d")
    firsts = {}
    for n in range(200):
        key = f"key-{n}"
        ranked = rank_for(key, four)
        assert sorted(r.replica_id.unique_id for r in ranked) == ["a", "b", "c", "d"]
        assert rank_for(key, list(reversed(four)))[0] is ranked[0]  # the order of candidates does not matter
        firsts[key] = ranked[0].replica_id.unique_id
        # A replica leaving moves only the keys whose first choice it was.
        without_c = [r for r in four if r.replica_id.unique_id != "c"]
        if firsts[key] != "c":
            assert rank_for(key, without_c)[0].replica_id.unique_id == firsts[key]
    share = {i: list(firsts.values()).count(i) for i in "abcd"}
    assert all(30 <= n <= 70 for n in share.values()), share  # 50 expected each


def test_the_api_key_is_read_from_the_proxied_request():
    from ray.serve._private.common import RequestMetadata, StreamingHTTPRequest
    from ray.serve.request_router import PendingRequest

    from specdec.deploy.router import api_key_of

    def pending(headers):
        scope = {"type": "http", "path": "/v1/completions", "headers": headers}
        return PendingRequest(args=[pickle.dumps(StreamingHTTPRequest(scope, proxy_actor_name="proxy"))], kwargs={},
                              metadata=RequestMetadata(request_id="r", internal_request_id="i"))

    async def keys():
        return [api_key_of(pending([(b"authorization", b"Bearer k-1")])),
                api_key_of(pending([(b"Authorization", b"bearer  k-2 ")])),
                api_key_of(pending([(b"authorization", b"Basic abc")])),
                api_key_of(pending([])),
                api_key_of(PendingRequest(args=["not a proxied request"], kwargs={},
                                          metadata=RequestMetadata(request_id="r", internal_request_id="i")))]

    assert asyncio.run(keys()) == ["k-1", "k-2", None, None, None]


# -- the proxy's middleware ------------------------------------------------------------------------
def guarded(inner):
    from specdec.deploy.proxy import ReplicaFailureGuard

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    asyncio.run(ReplicaFailureGuard(inner)({"type": "http", "path": "/v1/chat/completions"}, receive, send))
    return sent


def test_a_stream_cut_short_ends_with_one_error_event_then_done():
    async def dies_mid_stream(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "body": b'data: {"id": "x"}\n\n', "more_body": True})
        # the replica died: Ray's proxy sends nothing more and returns

    sent = guarded(dies_mid_stream)
    assert len(sent) == 3
    tail = sent[-1]["body"].decode()
    assert not sent[-1].get("more_body")
    error_line, done_line = [line for line in tail.split("\n\n") if line]
    assert json.loads(error_line[6:])["error"]["code"] == "replica_failed" and done_line == "data: [DONE]"


def test_no_response_at_all_becomes_a_502_error_body():
    async def nothing(scope, receive, send):
        return

    start, body = guarded(nothing)
    assert start["status"] == 502
    assert json.loads(body["body"])["error"] == {"message": json.loads(body["body"])["error"]["message"],
                                                 "type": "server_error", "param": None, "code": "replica_failed"}


def test_a_finished_response_is_left_alone():
    async def fine(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    assert [m.get("body") for m in guarded(fine)] == [None, b"data: [DONE]\n\n"]


# -- models on each node -----------------------------------------------------------------------------
def test_a_replica_pulls_only_the_default_models_its_node_lacks(tmp_path, monkeypatch):
    import specdec.models.pull as pull_module
    from specdec.backends.registry import BackendConfig, ModelConfig
    from specdec.deploy.replica import pull_default_models
    from specdec.models.registry import DRAFT, TARGET
    from specdec.types import SpecdecError

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    pulled, checked = [], []

    def verify_cached(path, spec):
        checked.append(spec.name)
        if spec is DRAFT:
            raise SpecdecError("missing")  # this node has the target only

    monkeypatch.setattr(pull_module, "verify_cached", verify_cached)
    monkeypatch.setattr(pull_module, "pull", lambda spec: pulled.append(spec.name))
    backend = BackendConfig("llama.cpp", None, True)
    pull_default_models(ModelConfig(backend, target="mine.gguf", draft="mine-draft.gguf"))
    assert checked == pulled == []  # the user's own files: nothing to fetch
    pull_default_models(ModelConfig(backend))
    assert checked == [TARGET.name, DRAFT.name] and pulled == [DRAFT.name]
    pulled.clear()
    pull_default_models(ModelConfig(backend, load_draft=False))
    assert pulled == []


def test_the_serve_config_builder_takes_the_commands_flags():
    from ray.serve import Application

    from specdec.deploy.app import build
    from specdec.types import SpecdecError

    assert isinstance(build({"flags": "--replicas 3 --threads-per-replica 2 --model t.gguf"}), Application)
    assert isinstance(build({"flags": ["--replicas", "2", "--model", "t.gguf"]}), Application)
    with pytest.raises(SpecdecError):
        build({"flags": "--replicas 0 --model t.gguf"})
