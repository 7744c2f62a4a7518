"""The parts of the Ray Serve deployment that need no running cluster: API-key affinity ranking,
the proxy middleware that ends a stream whose replica died, the deployment's options from
`specdec serve` flags, and the flags' checks, the application's two deployments, and the merge of
every replica's metrics into one exposition."""
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
    assert options["request_router_config"].request_router_kwargs == {"prefix_chars": 1024}
    fixed = deployment_options(spec, ScaleConfig(replicas=2))
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    for bad in (ScaleConfig(replicas=0), ScaleConfig(min_replicas=1), ScaleConfig(min_replicas=3, max_replicas=2),
                ScaleConfig(prefix_routing_chars=1000)):
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


def proxied(headers):
    from ray.serve._private.common import RequestMetadata, StreamingHTTPRequest
    from ray.serve.request_router import PendingRequest

    scope = {"type": "http", "path": "/v1/completions", "headers": headers}
    return PendingRequest(args=[pickle.dumps(StreamingHTTPRequest(scope, proxy_actor_name="proxy"))], kwargs={},
                          metadata=RequestMetadata(request_id="r", internal_request_id="i"))


def test_the_api_key_is_read_from_the_proxied_request():
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    from specdec.deploy.router import api_key_of, proxied_headers

    async def keys():  # a PendingRequest needs a running event loop
        not_proxied = PendingRequest(args=["not a proxied request"], kwargs={},
                                     metadata=RequestMetadata(request_id="r", internal_request_id="i"))
        return [api_key_of(proxied_headers(pending)) for pending in (
            proxied([(b"authorization", b"Bearer k-1")]), proxied([(b"Authorization", b"bearer  k-2 ")]),
            proxied([(b"authorization", b"Basic abc")]), proxied([]), not_proxied)]

    assert asyncio.run(keys()) == ["k-1", "k-2", None, None, None]


# -- prefix affinity -------------------------------------------------------------------------------
def test_prompt_text_reads_chat_messages_and_completion_prompts():
    from specdec.deploy.prefix import prompt_text

    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Sum "}, {"type": "image_url"},
                                                      {"type": "text", "text": "this"}]}]}
    assert prompt_text(chat) == "system\nBe brief.\nuser\nSum this\n"
    assert prompt_text({"prompt": "once upon"}) == "once upon"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [101, 7, 9]}) == "101 7 9"
    assert prompt_text({"prompt": None}) == prompt_text([1, 2]) == prompt_text({}) == ""


def test_prefix_digests_agree_exactly_as_far_as_the_texts_do():
    from specdec.deploy.prefix import BLOCK_CHARS, MAX_BLOCKS, prefix_digests, routing_digest, validate_prefix_chars

    shared = "x" * 600
    a, b = prefix_digests(shared + "a" * 300), prefix_digests(shared + "b" * 300)
    assert len(a) == len(b) == 3  # 900 characters: three whole blocks
    assert a[:2] == b[:2] and a[2] != b[2]  # they part in the third block
    assert prefix_digests("y" * (BLOCK_CHARS - 1)) == []
    assert len(prefix_digests("z" * BLOCK_CHARS * (MAX_BLOCKS + 5))) == MAX_BLOCKS
    header = ",".join(a).encode()
    assert routing_digest(header, 512) == a[1] and routing_digest(header, 1024) is None
    assert routing_digest(header, 0) is None and routing_digest(None, 512) is None
    assert validate_prefix_chars(0) is None and validate_prefix_chars(1024) is None
    assert all(validate_prefix_chars(bad) for bad in (-256, 1000, BLOCK_CHARS * (MAX_BLOCKS + 1)))


def test_affinity_is_the_prompt_prefix_then_the_api_key():
    from specdec.deploy.prefix import PREFIX_HEADER, encode_header, prefix_digests
    from specdec.deploy.router import affinity_of

    long_prompt = encode_header(prefix_digests("d" * 2000))
    short_prompt = encode_header(prefix_digests("d" * 700))
    key = (b"authorization", b"Bearer k-1")
    by_prefix = affinity_of({PREFIX_HEADER: long_prompt, key[0]: key[1]}, 1024)
    assert by_prefix.startswith("prefix:")
    assert by_prefix == affinity_of({PREFIX_HEADER: long_prompt, key[0]: b"Bearer other"}, 1024)  # any key
    by_key = affinity_of({PREFIX_HEADER: short_prompt, key[0]: key[1]}, 1024)
    assert by_key.startswith("key:") and "k-1" not in by_key
    assert affinity_of({PREFIX_HEADER: long_prompt, key[0]: key[1]}, 0) == by_key  # prefix routing off
    assert affinity_of({PREFIX_HEADER: short_prompt}, 1024) is None  # Ray's default then


def run_prefix_middleware(scope, chunks):
    """What the app behind PromptPrefixHeader receives: (its scope, the body it reads)."""
    from specdec.deploy.proxy import PromptPrefixHeader

    seen = {}
    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def app(inner_scope, receive, send):
        seen["scope"], body = inner_scope, b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen["body"] = body

    async def receive():
        return incoming.pop(0)

    async def send(message):
        pass

    asyncio.run(PromptPrefixHeader(app)(scope, receive, send))
    return seen["scope"], seen["body"]


def test_the_proxy_passes_the_prompt_prefix_and_the_body_unchanged():
    from specdec.deploy.prefix import PREFIX_HEADER, prefix_digests, prompt_text

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "long " * 300}]}).encode()
    forged = (PREFIX_HEADER, b"forged")
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [forged]}
    inner_scope, received = run_prefix_middleware(scope, [body[:100], body[100:]])
    assert received == body
    headers = dict(inner_scope["headers"])
    assert headers[PREFIX_HEADER].decode().split(",") == prefix_digests(prompt_text(json.loads(body)))
    assert (PREFIX_HEADER, b"forged") not in inner_scope["headers"]
    inner_scope, received = run_prefix_middleware(dict(scope, headers=[forged]), [b"{not json"])
    assert received == b"{not json" and inner_scope["headers"] == []  # the replica answers the 400
    too_deep = b"[" * 100_000 + b"]" * 100_000
    assert run_prefix_middleware(dict(scope, headers=[]), [too_deep])[1] == too_deep
    get = {"type": "http", "method": "GET", "path": "/v1/models", "headers": [forged]}
    assert run_prefix_middleware(get, [b""])[0] is get  # other routes: untouched


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

    app = build({"flags": "--replicas 3 --threads-per-replica 2 --model t.gguf"})
    assert isinstance(app, Application)
    assert isinstance(build({"flags": ["--replicas", "2", "--model", "t.gguf"]}), Application)
    with pytest.raises(SpecdecError):
        build({"flags": "--replicas 0 --model t.gguf"})


def test_the_replicas_are_the_ingress_and_the_metrics_hub_a_second_deployment():
    from ray.serve._private.build_app import build_app

    from specdec.deploy.app import DEPLOYMENT_NAME, METRICS_HUB_NAME, ROUTER, build

    built = build_app(build({"flags": "--replicas 2 --model t.gguf"}), name="specdec")
    assert built.ingress_deployment_name == DEPLOYMENT_NAME  # Ray's proxy sends HTTP to the replicas
    deployments = {d.name: d for d in built.deployments}
    assert set(deployments) == {DEPLOYMENT_NAME, METRICS_HUB_NAME}
    assert deployments[DEPLOYMENT_NAME].num_replicas == 2
    assert deployments[DEPLOYMENT_NAME]._deployment_config.request_router_config.request_router_class == ROUTER
    hub = deployments[METRICS_HUB_NAME]
    assert hub.num_replicas == 1 and hub.ray_actor_options["num_cpus"] == 0
    # the hub keeps Ray's default router: the API-key router is the replicas' alone
    assert hub._deployment_config.request_router_config.request_router_class != ROUTER
    handle = deployments[DEPLOYMENT_NAME].init_args[1]  # handed to each replica's constructor
    assert handle.deployment_name == METRICS_HUB_NAME


# -- metrics of every replica ------------------------------------------------------------------------
def replica_metrics(requests: int, generated: int):
    from specdec.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    for _ in range(requests):
        metrics.observe_finished({"generated_tokens": generated, "method": "ngram", "draft_rounds": 1,
                                  "accepted_per_position": [1]}, "length", 0.3)
    metrics.observe_http("/v1/completions", 200, 0.3)
    return metrics


def test_merged_metrics_are_each_family_once_with_every_replicas_samples_labelled():
    from fakes.scrape import by_replica, families_of

    from specdec.deploy.metrics import REPLICA_LABEL, merge_replicas, snapshot

    a, b = replica_metrics(2, 5), replica_metrics(3, 7)
    merged = families_of(merge_replicas({"a": snapshot(a), "b": snapshot(b)}).decode())
    alone = {"a": families_of(a.render().decode()), "b": families_of(b.render().decode())}
    assert set(merged) == set(alone["a"])
    for name, family in merged.items():
        assert family.type == alone["a"][name].type and family.documentation == alone["a"][name].documentation
        # every sample of each replica, and nothing else, under that replica's label
        for replica, own in alone.items():
            mine = [(s.name, {k: v for k, v in s.labels.items() if k != REPLICA_LABEL}, s.value)
                    for s in family.samples if s.labels[REPLICA_LABEL] == replica]
            assert mine == [(s.name, s.labels, s.value) for s in own[name].samples]
        assert {s.labels[REPLICA_LABEL] for s in family.samples} <= {"a", "b"}

    assert by_replica(merged, "specdec:request_success", "specdec:request_success_total",
                      finished_reason="length") == {"a": 2, "b": 3}
    assert by_replica(merged, "specdec:generation_tokens", "specdec:generation_tokens_total") == {"a": 10, "b": 21}
    assert by_replica(merged, "specdec:e2e_request_latency_seconds", "specdec:e2e_request_latency_seconds_bucket",
                      le="0.5") == {"a": 2, "b": 3}
    assert merge_replicas({}) == b""  # no replica heard from yet: an empty, valid exposition


def test_the_hub_forgets_a_replica_that_stopped_or_went_silent():
    from fakes.scrape import families_of, replicas_of

    from specdec.deploy.metrics import MetricsHub, snapshot

    clock = [100.0]
    hub = MetricsHub(push_interval=2.0, clock=lambda: clock[0])

    def replicas_in(text: bytes) -> set:
        return replicas_of(families_of(text.decode()))

    async def scenario():
        await hub.push("a", snapshot(replica_metrics(1, 1)))
        await hub.push("b", snapshot(replica_metrics(1, 1)))
        await hub.push("c", snapshot(replica_metrics(1, 1)))
        seen = [replicas_in(await hub.exposition("a", snapshot(replica_metrics(1, 1))))]
        await hub.forget("c")  # stopped: gone at once
        clock[0] += 5.9  # b silent for just under 3 push intervals: still there
        seen.append(replicas_in(await hub.exposition("a", snapshot(replica_metrics(1, 1)))))
        clock[0] += 0.2  # now past them: taken for dead
        seen.append(replicas_in(await hub.exposition("a", snapshot(replica_metrics(1, 1)))))
        return seen

    assert asyncio.run(scenario()) == [{"a", "b", "c"}, {"a", "b"}, {"a"}]


def test_a_scrape_without_the_hub_shows_the_replica_alone_and_in_time():
    from types import SimpleNamespace

    from fakes.scrape import families_of, replicas_of

    from specdec.deploy.metrics import HubLink

    async def hangs(*args):
        await asyncio.sleep(3600)

    async def fails(*args):
        raise ConnectionError("hub restarting")

    async def scrape(call):
        link = HubLink(SimpleNamespace(exposition=SimpleNamespace(remote=call)), "me", scrape_timeout=0.2)
        return replicas_of(families_of((await link.exposition(replica_metrics(1, 1))).decode()))

    assert asyncio.run(scrape(hangs)) == asyncio.run(scrape(fails)) == {"me"}
