"""The parts of the Ray Serve deployment that need no running cluster: API-key affinity ranking,
the proxy middleware that ends a stream whose replica died, the proxy's key check and body limits
before it reads a body (the whole middleware stack as plain ASGI), Ray's own errors made OpenAI
JSON, the keys kept out of what Ray stores, the deployment's options from `specdec serve` flags,
and the flags' checks, the application's two deployments, and the merge of every replica's
metrics into one exposition."""
from __future__ import annotations

import asyncio
import json
import pickle
from types import SimpleNamespace

import pytest

from specdec.cli import main
from specdec.config_flags import config_from_args
from specdec.server.cli import parse_serve_flags

pytestmark = pytest.mark.timeout(60)


# -- flags ---------------------------------------------------------------------------------------
def test_ray_flags_without_ray_are_refused(capsys):
    assert main(["serve", "--replicas", "2", "--model", "x.gguf"]) == 2
    assert "--replicas is a Ray Serve setting: add --ray" in capsys.readouterr().err
    assert main(["serve", "--upscale-delay", "5", "--model", "x.gguf"]) == 2
    assert "--upscale-delay is a Ray Serve setting: add --ray" in capsys.readouterr().err


ray_serve = pytest.importorskip("ray.serve")


def serve_config(argv):
    """The configuration `specdec serve ARGV` (with --ray) deploys."""
    return config_from_args(parse_serve_flags(argv), keys=True, ray=True)


def test_deployment_options_from_serve_flags():
    from specdec.deploy.app import ROUTER, ScaleConfig, deployment_options
    from specdec.deploy.replica import replica_spec
    from specdec.types import SpecdecError

    config = serve_config(["--ray", "--model", "t.gguf", "--parallel", "3", "--max-queue", "20", "--drain-grace",
                              "10", "--threads-per-replica", "2", "--min-replicas", "1", "--max-replicas", "4"])
    spec, scale = replica_spec(config), config.scale
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
        replica_spec(serve_config(["--ray", "--model", "t.gguf", "--threads", "4"]))


def test_autoscaling_delays_from_serve_flags():
    from specdec.deploy.app import build_application, deployment_options
    from specdec.deploy.replica import replica_spec
    from specdec.types import SpecdecError

    def options(*flags):
        config = serve_config(["--ray", "--model", "t.gguf", "--parallel", "2", *flags])
        return deployment_options(replica_spec(config), config.scale)

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
    config = serve_config(["--ray", "--model", "t.gguf", "--replicas", "2"])
    with pytest.raises(SpecdecError, match="need --min-replicas"):
        build_application(replica_spec(config), config.scale, {"look_back_period_s": 2})


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


def test_prompt_text_reads_messages_and_responses_bodies_as_the_model_reads_them():
    from specdec.deploy.prefix import prompt_text

    messages = {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.a1b;\nBe brief."}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Sum this"}]},
                             {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]}]}
    assert prompt_text(messages) == "system\nBe brief.\nuser\nSum this\nassistant\n\n"
    turn_2 = dict(messages, system="x-anthropic-billing-header: cc_version=2.1.332.f9e;\nBe brief.")
    assert prompt_text(turn_2) == prompt_text(messages)  # the attribution line changes every turn
    responses = {"instructions": "Be brief.",
                 "input": [{"role": "developer", "content": [{"type": "input_text", "text": "Rules"}]},
                           {"type": "function_call", "name": "f", "arguments": "{\"a\": 1}"},
                           {"type": "function_call_output", "output": "42"}]}
    assert prompt_text(responses) == ("system\nBe brief.\ndeveloper\nRules\nfunction_call\n{\"a\": 1}\n"
                                      "function_call_output\n42\n")
    assert prompt_text({"input": "Hello"}) == "user\nHello\n"


def test_the_session_key_is_the_prompt_cache_key_or_the_messages_user_id():
    from specdec.deploy.prefix import session_digest

    codex = session_digest({"prompt_cache_key": "thread-1", "input": "hi"})
    assert codex == session_digest({"prompt_cache_key": "thread-1"}) != session_digest({"prompt_cache_key": "thread-2"})
    assert "thread-1" not in codex
    assert session_digest({"metadata": {"user_id": "user_x_session_1"}}) is not None
    assert session_digest({"metadata": {"user_id": 7}}) is None and session_digest({"prompt_cache_key": ""}) is None
    assert session_digest({"messages": []}) is None and session_digest([1]) is None


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


def test_a_session_key_comes_before_the_prompt_prefix():
    """Agent sessions share one long system prompt: by prefix alone they would all go to one replica."""
    from specdec.deploy.prefix import PREFIX_HEADER, SESSION_HEADER, encode_header, prefix_digests
    from specdec.deploy.router import affinity_of

    shared_start = encode_header(prefix_digests("s" * 2000))
    first, second = ({PREFIX_HEADER: shared_start, SESSION_HEADER: session} for session in (b"aa11", b"bb22"))
    assert affinity_of(first, 1024) == "session:aa11" and affinity_of(second, 1024) == "session:bb22"
    assert affinity_of({PREFIX_HEADER: shared_start}, 1024).startswith("prefix:")


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


def test_the_proxy_passes_the_prompt_prefix_the_session_and_the_body_unchanged():
    from specdec.deploy.prefix import PREFIX_HEADER, SESSION_HEADER, prefix_digests, prompt_text, session_digest

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
    codex = json.dumps({"model": "m", "input": "short", "prompt_cache_key": "thread-9"}).encode()
    forged_session = (SESSION_HEADER, b"forged")
    responses = dict(scope, path="/v1/responses", headers=[forged_session])
    headers = dict(run_prefix_middleware(responses, [codex])[0]["headers"])
    assert headers == {SESSION_HEADER: session_digest(json.loads(codex)).encode()}
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


def test_the_serve_config_builder_takes_the_configuration(tmp_path, monkeypatch):
    from ray.serve import Application
    from ray.serve._private.build_app import build_app

    from specdec.deploy.app import DEPLOYMENT_NAME, build
    from specdec.types import SpecdecError

    app = build({"scale": {"replicas": 3, "threads_per_replica": 2}, "models": {"target": "t.gguf"}})
    assert isinstance(app, Application)
    with pytest.raises(SpecdecError, match="^--replicas and --threads-per-replica must be >= 1"):
        build({"scale": {"replicas": 0}, "models": {"target": "t.gguf"}})
    with pytest.raises(SpecdecError, match="not `flags`"):
        build({"flags": "--replicas 2 --model t.gguf"})
    # A TOML file named in the args, the args' own sections over it, the environment over both.
    (tmp_path / "specdec.toml").write_text('slots = 3\n[models]\ntarget = "t.gguf"\n[scale]\nreplicas = 4\n')
    monkeypatch.setenv("SPECDEC_SCALE_REPLICAS", "2")
    built = build_app(build({"config": str(tmp_path / "specdec.toml"), "slots": 5}), name="specdec")
    replicas = {d.name: d for d in built.deployments}[DEPLOYMENT_NAME]
    assert replicas.num_replicas == 2 and replicas.init_args[0].slots == 5


def test_the_replicas_are_the_ingress_and_the_metrics_hub_a_second_deployment():
    from ray.serve._private.build_app import build_app

    from specdec.deploy.app import DEPLOYMENT_NAME, METRICS_HUB_NAME, ROUTER, build

    built = build_app(build({"scale": {"replicas": 2}, "models": {"target": "t.gguf"}}), name="specdec")
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


# -- the proxy's key check and body limits (the whole middleware stack, as Ray builds it) ------------
ALICE_1, ALICE_2, BOB = "sk-alice-1", "sk-alice-2", "sk-bob"
PROXY_ENV = {"SPECDEC_API_KEYS": f"alice {ALICE_1}, alice {ALICE_2}, bob {BOB}",
             "SPECDEC_MAX_BODY_BYTES": "1000", "SPECDEC_BODY_TIMEOUT": "0.3"}


class FakeRayProxy:
    """Ray's proxy app behind the middlewares: reads the body the way a replica would, answers 200
    (or what `respond` sends), and records what it saw."""

    def __init__(self, respond=None):
        self.seen: list[tuple[dict, bytes]] = []
        self.respond = respond

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append((scope, body))
        if self.respond is not None:
            return await self.respond(send)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"x-specdec-replica", b"r1")]})
        await send({"type": "http.response.body", "body": b"{}"})


def proxy_stack(inner, environ):
    """The app as Ray's proxy wraps it (ray.serve._private.http_util._apply_middlewares)."""
    from specdec.deploy.proxy import middlewares

    app = inner
    for middleware in middlewares(environ):
        app = middleware.cls(app, *middleware.args, **middleware.kwargs)
    return app


def exchange(app, path="/v1/chat/completions", headers=(), chunks=(b"{}",), method="POST", stall=False):
    """(status, headers, body, receive calls) of one request; `stall`: the client sends nothing after
    its chunks."""
    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1 or stall}
                for i, c in enumerate(chunks)]
    sent, reads = [], [0]

    async def receive():
        reads[0] += 1
        if incoming:
            return incoming.pop(0)
        await asyncio.sleep(3600)  # a client that went quiet (or waits for its response)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path,
             "headers": [(name.encode(), value.encode()) for name, value in headers]}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], {bytes(n).lower(): bytes(v) for n, v in start["headers"]}, body, reads[0]


def openai_error(body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def bearer(key):
    return ("Authorization", f"Bearer {key}")


def test_the_proxy_checks_the_key_before_it_reads_a_byte_of_the_body():
    ray_proxy = FakeRayProxy()
    app = proxy_stack(ray_proxy, PROXY_ENV)
    for headers in ((), (bearer("sk-wrong"),), (("Authorization", f"Basic {ALICE_1}"),)):
        status, response_headers, body, reads = exchange(app, headers=headers, chunks=(b"x" * 5000,))
        assert (status, reads) == (401, 0)
        assert openai_error(body)["code"] == "invalid_api_key" and response_headers[b"www-authenticate"] == b"Bearer"
    # The key first, then the size: a body too large without a key is a 401, never read.
    status, _, _, reads = exchange(app, headers=(("Content-Length", "5000"),), chunks=(b"x" * 5000,))
    assert (status, reads) == (401, 0)
    status, _, body, reads = exchange(app, headers=(bearer(ALICE_1), bearer(BOB)))
    assert (status, reads, openai_error(body)["code"]) == (400, 0, "duplicate_header")
    assert ray_proxy.seen == []
    # Ray's health and routes, /health and /metrics (the replica knows if it is public) need none.
    for path in ("/-/healthz", "/-/routes", "/health", "/metrics"):
        assert exchange(app, path=path, method="GET", chunks=(b"",))[0] == 200
    assert exchange(app, headers=(bearer(ALICE_2),))[0] == 200


def test_a_body_over_the_limit_is_refused_from_its_length_or_as_its_bytes_pass_it():
    ray_proxy = FakeRayProxy()
    app = proxy_stack(ray_proxy, PROXY_ENV)
    status, headers, body, reads = exchange(app, headers=(bearer(ALICE_1), ("Content-Length", "1001")),
                                            chunks=(b"x" * 1001,))
    assert (status, reads) == (413, 0) and headers[b"connection"] == b"close"
    error = openai_error(body)
    assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
    assert "1000" in error["message"]
    # Chunked (no Content-Length): refused on the chunk that passes the limit, on any path.
    for path in ("/v1/chat/completions", "/v1/anything"):
        status, headers, body, reads = exchange(app, path=path, headers=(bearer(BOB),), chunks=(b"y" * 400,) * 10)
        assert (status, reads, openai_error(body)["code"]) == (413, 3, "request_too_large")
    assert ray_proxy.seen == []
    status, _, _, _ = exchange(app, headers=(bearer(BOB),), chunks=(b"z" * 500, b"z" * 500))  # exactly the limit
    assert status == 200 and ray_proxy.seen[0][1] == b"z" * 1000


def test_a_body_slower_than_the_timeout_is_a_408():
    app = proxy_stack(FakeRayProxy(), PROXY_ENV)
    status, headers, body, _ = exchange(app, headers=(bearer(ALICE_1),), chunks=(b"{",), stall=True)
    assert status == 408 and openai_error(body)["code"] == "request_timeout" and headers[b"connection"] == b"close"


def test_every_key_of_a_tenant_routes_as_that_tenant():
    from specdec.deploy.router import TENANT_HEADER, affinity_of

    ray_proxy = FakeRayProxy()
    app = proxy_stack(ray_proxy, PROXY_ENV)
    forged = ("X-Specdec-Tenant", "bob")
    for key in (ALICE_1, ALICE_2, BOB):
        assert exchange(app, headers=(bearer(key), forged))[0] == 200
    routed = [{name.lower(): value for name, value in scope["headers"]} for scope, _ in ray_proxy.seen]
    assert [headers[TENANT_HEADER] for headers in routed] == [b"alice", b"alice", b"bob"]
    assert all([name.lower() for name, _ in scope["headers"]].count(TENANT_HEADER) == 1 for scope, _ in ray_proxy.seen)
    alice_1, alice_2, bob = (affinity_of(headers, 1024) for headers in routed)
    assert alice_1 == alice_2 == "tenant:alice" and bob == "tenant:bob"
    # A proxy without keys: anonymous, the client's header dropped, routing on the key as before.
    open_proxy = FakeRayProxy()
    assert exchange(proxy_stack(open_proxy, {}), headers=(bearer("any"), forged))[0] == 200
    headers = {name.lower(): value for name, value in open_proxy.seen[0][0]["headers"]}
    assert TENANT_HEADER not in headers and affinity_of(headers, 1024).startswith("key:")


def test_a_large_body_is_decoded_off_the_event_loop(monkeypatch):
    import threading

    import specdec.deploy.proxy as proxy
    from specdec.deploy.prefix import PREFIX_HEADER
    from specdec.server.limits import OFF_LOOP_JSON_BYTES

    decoded_on = []

    def recording(body):
        decoded_on.append(threading.get_ident())
        return real(body)

    real = proxy.routing_headers
    monkeypatch.setattr(proxy, "routing_headers", recording)
    ray_proxy = FakeRayProxy()
    app = proxy_stack(ray_proxy, {})
    large = json.dumps({"model": "m", "messages": [{"role": "user", "content": "w" * (OFF_LOOP_JSON_BYTES + 1)}]})
    small = json.dumps({"model": "m", "messages": [{"role": "user", "content": "w" * 2000}]})
    for body in (large, small):
        assert exchange(app, chunks=(body.encode(),))[0] == 200
    assert decoded_on[0] != threading.get_ident() and decoded_on[1] == threading.get_ident()
    assert all(dict(scope["headers"])[PREFIX_HEADER] for scope, _ in ray_proxy.seen)
    assert [body for _, body in ray_proxy.seen] == [large.encode(), small.encode()]


def test_rays_own_plain_text_errors_become_openai_errors():
    from ray.serve._private.http_util import convert_object_to_asgi_messages

    def ray_answers(text, status, headers=None):
        async def respond(send):
            for message in convert_object_to_asgi_messages(text, status_code=status, extra_headers=headers):
                await send(message)
        return respond

    full = "Request dropped due to backpressure (num_queued_requests=4, max_queued_requests=4)."
    status, headers, body, _ = exchange(proxy_stack(FakeRayProxy(ray_answers(full, 429, [(b"retry-after", b"1")])), {}))
    error = openai_error(body)
    assert (status, error["type"], error["code"]) == (429, "rate_limit_error", "queue_full")
    assert full in error["message"] and headers[b"retry-after"] == b"1"
    assert headers[b"content-type"] == b"application/json" and int(headers[b"content-length"]) == len(body)
    status, _, body, _ = exchange(proxy_stack(FakeRayProxy(ray_answers("no replica", 503)), {}))
    assert (status, openai_error(body)["type"], openai_error(body)["code"]) == (503, "server_error", "unavailable")
    status, _, body, _ = exchange(proxy_stack(FakeRayProxy(ray_answers("Path '/v1/x' not found.", 404)), {}))
    assert (status, openai_error(body)["code"]) == (404, "not_found")
    # Ray's health answer stays what load balancers read; a replica's own answers pass unchanged.
    status, _, body, _ = exchange(proxy_stack(FakeRayProxy(ray_answers("draining", 503)), {}), path="/-/healthz",
                                  method="GET", chunks=(b"",))
    assert (status, body) == (503, b"draining")

    async def replica_error(send):
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"content-type", b"text/plain"), (b"x-specdec-replica", b"r1")]})
        await send({"type": "http.response.body", "body": b"the replica's own"})

    assert exchange(proxy_stack(FakeRayProxy(replica_error), {}))[2] == b"the replica's own"


def test_the_proxy_reads_its_settings_from_the_environment():
    from specdec.deploy.proxy import ProxySettings
    from specdec.server.config import ServerConfig
    from specdec.types import SpecdecError

    defaults = ProxySettings.from_environment({})
    assert not defaults.keys and (defaults.max_body_bytes, defaults.body_timeout) == (
        ServerConfig.max_body_bytes, ServerConfig.body_timeout)
    settings = ProxySettings.from_environment(PROXY_ENV)
    assert settings.keys.tenants == ["alice", "bob"] and settings.keys.tenant_of(ALICE_2) == "alice"
    assert (settings.max_body_bytes, settings.body_timeout) == (1000, 0.3)
    for bad in ({"SPECDEC_MAX_BODY_BYTES": "8M"}, {"SPECDEC_MAX_BODY_BYTES": "0"}, {"SPECDEC_BODY_TIMEOUT": "inf"}):
        with pytest.raises(SpecdecError, match=r"^\$SPECDEC_(MAX_BODY_BYTES|BODY_TIMEOUT) must be a positive"):
            ProxySettings.from_environment(bad)


# -- the keys never travel in what Ray stores ---------------------------------------------------------
@pytest.fixture
def no_keys_in_env(monkeypatch):
    for name in ("SPECDEC_API_KEY", "SPECDEC_API_KEYS", "SPECDEC_API_KEYS_FILE", "SPECDEC_METRICS_KEY"):
        monkeypatch.delenv(name, raising=False)


def test_the_replica_spec_carries_no_key_and_a_replica_finds_them_on_its_node(tmp_path, monkeypatch, no_keys_in_env):
    from specdec.deploy.cli import local_ray_environment
    from specdec.deploy.replica import replica_spec
    from specdec.deploy.replica import keys_on_this_node
    from specdec.types import SpecdecError

    keys_file = tmp_path / "keys"
    keys_file.write_text(f"alice {ALICE_1}\nalice {ALICE_2}\nbob {BOB}\n")
    keys_file.chmod(0o600)
    monkeypatch.chdir(tmp_path)
    config = serve_config(["--ray", "--model", "t.gguf", "--api-keys-file", "keys", "--max-body-bytes", "5000"])
    spec = replica_spec(config)
    stored = pickle.dumps(spec)
    assert not any(key.encode() in stored for key in (ALICE_1, ALICE_2, BOB))
    assert spec.server.api_key is None and spec.server.api_keys == ()
    assert spec.api_keys_file == str(keys_file) and spec.key_tenants == ("alice", "bob")
    server = keys_on_this_node(spec, {})  # the file, read on the replica's node
    assert dict(server.api_keys) == {ALICE_1: "alice", ALICE_2: "alice", BOB: "bob"}
    assert local_ray_environment(config, spec)["SPECDEC_API_KEYS_FILE"] == str(keys_file)
    assert local_ray_environment(config, spec)["SPECDEC_MAX_BODY_BYTES"] == "5000"
    # A rotation (another key of a tenant) is fine; a node with other tenants' keys, or none, refuses.
    keys_file.write_text(f"alice {ALICE_1}\nalice sk-alice-3\nbob {BOB}\n")
    assert len(keys_on_this_node(spec).api_keys) == 3
    keys_file.write_text(f"alice {ALICE_1}\n")
    with pytest.raises(SpecdecError, match=r"tenants \['alice'\], but the deployment was started with keys of "
                                           r"\['alice', 'bob'\]"):
        keys_on_this_node(spec)

    # One key from the environment: the same on the node (the CLI's local Ray inherits it).
    monkeypatch.setenv("SPECDEC_API_KEY", "sk-default")
    spec = replica_spec(serve_config(["--ray", "--model", "t.gguf"]))
    assert b"sk-default" not in pickle.dumps(spec) and spec.key_tenants == ("default",)
    assert keys_on_this_node(spec, {"SPECDEC_API_KEY": "sk-default"}).api_key == "sk-default"
    with pytest.raises(SpecdecError, match="give every node the same keys"):
        keys_on_this_node(spec, {})
    # A deployment started without keys serves under the keys its nodes have (never fewer checks).
    monkeypatch.delenv("SPECDEC_API_KEY")
    spec = replica_spec(serve_config(["--ray", "--model", "t.gguf"]))
    assert spec.key_tenants == () and keys_on_this_node(spec, {"SPECDEC_API_KEYS": "carol sk-c"}).api_keys == (
        ("sk-c", "carol"),)


def test_an_api_key_flag_is_refused_where_it_would_travel_in_rays_state(capsys, no_keys_in_env):
    from specdec.deploy.app import build
    from specdec.deploy.cli import local_ray_environment
    from specdec.deploy.replica import replica_spec
    from specdec.types import SpecdecError

    with pytest.raises(SpecdecError, match="^--api-key in a Serve config would put the key in the config"):
        build({"server": {"api_key": "sk-secret"}, "models": {"target": "t.gguf"}})
    assert main(["serve", "--ray", "--address", "127.0.0.1:1", "--api-key", "sk-secret", "--model", "t.gguf"]) == 2
    err = capsys.readouterr().err
    assert "--api-key with --address would put the key in the deployment's arguments" in err and "sk-secret" not in err
    # The local Ray this command starts gets it through its environment instead.
    config = serve_config(["--ray", "--api-key", "sk-secret", "--model", "t.gguf"])
    spec = replica_spec(config)
    assert b"sk-secret" not in pickle.dumps(spec)
    environment = local_ray_environment(config, spec)
    assert environment["SPECDEC_API_KEY"] == "sk-secret"
    assert environment["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "specdec.deploy.proxy:middlewares"


def test_the_metrics_key_travels_as_the_api_keys_do(capsys, no_keys_in_env):
    from specdec.deploy.app import build
    from specdec.deploy.cli import local_ray_environment
    from specdec.deploy.replica import keys_on_this_node, replica_spec
    from specdec.types import SpecdecError

    with pytest.raises(SpecdecError, match="^--metrics-key in a Serve config would put the key in the config"):
        build({"server": {"metrics_key": "m-secret"}, "models": {"target": "t.gguf"}})
    assert main(["serve", "--ray", "--address", "127.0.0.1:1", "--metrics-key", "m-secret", "--model", "t.gguf"]) == 2
    err = capsys.readouterr().err
    assert "--metrics-key with --address would put the key" in err and "m-secret" not in err
    config = serve_config(["--ray", "--api-key", "sk-secret", "--metrics-key", "m-secret", "--model", "t.gguf"])
    spec = replica_spec(config)
    assert b"m-secret" not in pickle.dumps(spec) and spec.metrics_key
    assert local_ray_environment(config, spec)["SPECDEC_METRICS_KEY"] == "m-secret"
    node = {"SPECDEC_API_KEY": "sk-secret", "SPECDEC_METRICS_KEY": "m-secret"}
    assert keys_on_this_node(spec, node).metrics_key == "m-secret"
    with pytest.raises(SpecdecError, match="SPECDEC_METRICS_KEY"):  # a node without it: no replica there
        keys_on_this_node(spec, {"SPECDEC_API_KEY": "sk-secret"})


def test_a_full_queue_is_a_429_with_retry_after_as_under_specdec_serve():
    from specdec.deploy.app import deployment_options
    from specdec.deploy.replica import replica_spec

    config = serve_config(["--ray", "--model", "t.gguf", "--max-queue", "3"])
    options = deployment_options(replica_spec(config), config.scale)
    assert options["max_queued_requests"] == 3
    assert (options["backpressure_config"].status_code, options["backpressure_config"].retry_after_s) == (429, 1)
