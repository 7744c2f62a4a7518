"""Big answers (n choices with top logprobs, echo): built and encoded off the event loop in short
pieces, bounded unless streamed (--max-unstreamed-logprobs), the echoed prompt scored once."""
import gc
import json
import random
import subprocess
import sys
import time

import httpx
import pytest

import specdec.engine.core as engine_core
import specdec.server.completions as completions
from specdec.backends.fake import FakeBackend
from specdec.cli import build_parser
from specdec.config_flags import config_from_args
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.choices import (
    DUMP_TOKENS, ChatLogprobBuilder, TextLogprobBuilder, logprob_columns, logprobs_json,
)
from specdec.server.errors import PIECE_VALUES, RawJSON, json_bytes, json_pieces, json_text
from specdec.server.protocol import TextLogprobs
from specdec.server.testing import serve_in_thread
from specdec.types import SpecConfig, SpecdecError, TokenLogprob

pytestmark = pytest.mark.timeout(120)

MODEL = "fake-target"


def dumps(value) -> str:
    """How answers were encoded before: one json.dumps call."""
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"))


def serve(**config):
    engine = Engine(FakeBackend(seed=7), n_slots=8)
    return serve_in_thread(create_app(engine, ServerConfig(served_model_name=MODEL, spec=SpecConfig("off", 4),
                                                           **config)))


def chat(client: httpx.Client, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "the cat"}], "temperature": 0, **fields}
    return client.post("/v1/chat/completions", json=body)


def complete(client: httpx.Client, **fields) -> httpx.Response:
    return client.post("/v1/completions", json={"model": MODEL, "prompt": "the cat sat", "temperature": 0, **fields})


# -- the encoding --------------------------------------------------------------------------------
def random_value(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if depth >= 4 or kind < 0.4:
        return rng.choice([None, True, False, rng.randint(-10**20, 10**20), rng.random(), -0.0, float("nan"),
                           float("-inf"), "é\u2028\"\\\ud800\x00", "x" * rng.randint(0, 300)])
    if kind < 0.7:
        return [random_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 5, 20] if depth else [0, 5, 600]))]
    if kind < 0.8:
        return tuple(random_value(rng, depth + 1) for _ in range(rng.choice([0, 2, 30])))
    names = ["a", 'b"', "é", ""]
    return {f"{rng.choice(names)}{i}": random_value(rng, depth + 1)
            for i in range(rng.choice([0, 3, 10] if depth else [0, 5, 300]))}


def logprob_entry(rng: random.Random) -> dict:
    return {"token": "tok", "logprob": -rng.random() * 10, "bytes": [116, 111, 107],
            "top_logprobs": [{"token": f"t{k}", "logprob": -rng.random() * 10, "bytes": [116, 49]} for k in range(20)]}


def test_the_pieces_are_json_dumps_byte_for_byte():
    rng = random.Random(3)
    for _ in range(100):
        value = random_value(rng)
        assert json_text(value) == dumps(value)
        assert json_bytes(value) == dumps(value).encode("ascii")
    odd_keys = {1: [1] * 5000, None: 2, 2.5: "x", False: [{"a": 1}] * 3000, "s": {7: [0.5] * 4000}}
    assert json_text(odd_keys) == dumps(odd_keys)
    answer = {"id": "x", "choices": [{"index": i, "message": {"content": "hé\ud800" * 3000},
                                      "logprobs": {"content": [logprob_entry(rng) for _ in range(300)]},
                                      "finish_reason": None} for i in range(4)]}
    pieces = list(json_pieces(answer))
    assert "".join(pieces) == dumps(answer) and json_bytes(answer) == dumps(answer).encode("ascii")
    # Many short pieces: none encodes much more than a batch of PIECE_VALUES values.
    assert len(pieces) > 50 and max(map(len, pieces)) < PIECE_VALUES * 40


def test_raw_json_goes_in_as_it_is_wherever_it_sits():
    raw = RawJSON('{"content":[1,2]}')
    assert json_text(raw) == raw.text and json_bytes([raw]) == b'[{"content":[1,2]}]'
    # In a small dict, and in a long list whose sampled items miss it: found all the same.
    assert json_text({"a": 1, "logprobs": raw}) == '{"a":1,"logprobs":{"content":[1,2]}}'
    items: list = [0] * 1000
    items[501] = {"x": [raw]}
    assert json_text(items) == dumps([0] * 501 + [{"x": [{"content": [1, 2]}]}] + [0] * 498)
    with pytest.raises(TypeError):
        json_text([object()])


def token_bytes(token: int) -> bytes:
    return bytes([97 + token % 26]) * (1 + token % 3) if token % 7 else "é".encode()[:1]  # a partial character too


def entries_for(rng: random.Random, count: int, top: int) -> list[TokenLogprob]:
    return [TokenLogprob(rng.randrange(100), -rng.random() * 9,
                         tuple((rng.randrange(100), -rng.random() * 9) for _ in range(top))) for _ in range(count)]


@pytest.mark.parametrize("count", [0, 1, DUMP_TOKENS, DUMP_TOKENS * 3 + 7])
def test_logprobs_encoded_in_slices_are_the_whole_models_json(count):
    rng = random.Random(count)
    entries = entries_for(rng, count, 3)
    ids = [entry.token_id for entry in entries]
    whole = ChatLogprobBuilder(token_bytes).build(entries, ids)
    assert logprobs_json(logprob_columns(ChatLogprobBuilder(token_bytes), entries, ids)).text == \
        dumps(whole.model_dump(mode="json"))

    # An echoed prompt's (first entry None), then the completion's, its offsets running on.
    prompt = [None, *entries_for(rng, count + 2, 2)]
    prompt_ids = [rng.randrange(100) for _ in prompt]
    builder = TextLogprobBuilder(token_bytes)
    before, after = builder.build(prompt, prompt_ids), builder.build(entries, ids)
    expected = {name: getattr(before, name) + getattr(after, name) for name in TextLogprobs.model_fields}
    sliced = TextLogprobBuilder(token_bytes)
    encoded = logprobs_json(logprob_columns(sliced, prompt, prompt_ids), logprob_columns(sliced, entries, ids))
    assert encoded.text == dumps(TextLogprobs(**expected).model_dump(mode="json"))


# -- the bound -----------------------------------------------------------------------------------
def test_the_flag_sets_the_bound():
    def server_config(*argv):
        return config_from_args(build_parser().parse_args(["serve", "--served-model-name", "x", *argv]),
                                keys=True).server

    assert server_config().max_unstreamed_logprobs == ServerConfig().max_unstreamed_logprobs == 1_000_000
    assert server_config("--max-unstreamed-logprobs", "5000").max_unstreamed_logprobs == 5000
    with pytest.raises(SpecdecError, match="--max-unstreamed-logprobs"):
        server_config("--max-unstreamed-logprobs", "0")


def test_an_unstreamed_answer_past_the_bound_is_a_400_asking_to_stream():
    # chat: n x max_tokens x (top_logprobs + 1); completions: the echoed prompt's tokens count too
    with serve(max_unstreamed_logprobs=1000) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        under = chat(client, n=2, max_tokens=100, logprobs=True, top_logprobs=4)  # 2 x 100 x 5 = 1000
        assert under.status_code == 200, under.text
        assert len(under.json()["choices"]) == 2
        over = chat(client, n=2, max_tokens=101, logprobs=True, top_logprobs=4)  # 1010
        assert over.status_code == 400
        error = over.json()["error"]
        assert error["code"] == "response_too_large" and error["param"] == "stream"
        assert error["type"] == "invalid_request_error"
        assert "1010" in error["message"] and "1000" in error["message"] and "stream: true" in error["message"]
        assert "top_logprobs" in error["message"]

        # Without max_tokens, the server's cap counts (1024): 1 x 1024 x 1 entries.
        assert chat(client, logprobs=True).status_code == 400
        # Streamed, or without logprobs, there is no bound.
        streamed = chat(client, n=2, max_tokens=101, logprobs=True, top_logprobs=4, stream=True)
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        assert chat(client, n=2, max_tokens=600).status_code == 200

        prompt_tokens = len(Engine(FakeBackend(seed=7), n_slots=1).encode_prompt("the cat sat", chat=False))
        at = 1000 // 3 // 2 - prompt_tokens  # n=2, logprobs=2: 2 x (prompt + max_tokens) x 3 <= 1000
        under = complete(client, n=2, max_tokens=at, logprobs=2, echo=True)
        assert under.status_code == 200, under.text
        over = complete(client, n=2, max_tokens=at + 1, logprobs=2, echo=True)
        assert over.status_code == 400 and over.json()["error"]["code"] == "response_too_large"
        assert "logprobs" in over.json()["error"]["message"]
        assert complete(client, n=2, max_tokens=at + 1, logprobs=2).status_code == 200  # no echo: fewer
        # A list of prompts: each prompt's n choices count.
        assert complete(client, prompt=["a b", "c d"], n=2, max_tokens=40, logprobs=2).status_code == 200
        listed = complete(client, prompt=["a b", "c d", "e f"], n=2, max_tokens=60, logprobs=2)
        assert listed.status_code == 400 and "1080" in listed.json()["error"]["message"]


# -- echo: the prompt scored once -------------------------------------------------------------------
@pytest.fixture
def scored_tokens(monkeypatch):
    """How many prompt tokens the engine scored (echo with logprobs)."""
    count = [0]
    score = engine_core.token_logprobs

    def counting(rows, tokens, top):
        count[0] += len(tokens)
        return score(rows, tokens, top)

    monkeypatch.setattr(engine_core, "token_logprobs", counting)
    return count


def stream_choices(response: httpx.Response) -> dict[int, dict]:
    """Per choice index: its text and echoed-prompt logprobs from a completions stream."""
    choices: dict[int, dict] = {}
    for line in response.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:])["choices"]:
            seen = choices.setdefault(choice["index"], {"text": "", "logprobs": []})
            seen["text"] += choice["text"]
            if choice["logprobs"] is not None:
                seen["logprobs"].append(choice["logprobs"])
    return choices


def test_echo_scores_the_prompt_once_for_all_n_choices(scored_tokens):
    prompt = "the cat sat on the mat and"
    prompt_tokens = len(Engine(FakeBackend(seed=7), n_slots=1).encode_prompt(prompt, chat=False))
    with serve() as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        single = complete(client, prompt=prompt, max_tokens=10, logprobs=2, echo=True).json()["choices"][0]
        assert scored_tokens[0] == prompt_tokens - 1
        expected = {key: values[:prompt_tokens] for key, values in single["logprobs"].items()}

        scored_tokens[0] = 0
        whole = complete(client, prompt=prompt, n=4, max_tokens=10, logprobs=2, echo=True, temperature=1, seed=3)
        assert whole.status_code == 200, whole.text
        assert scored_tokens[0] == prompt_tokens - 1  # once, not once per choice
        choices = whole.json()["choices"]
        assert [choice["index"] for choice in choices] == [0, 1, 2, 3]
        for choice in choices:
            logprobs = choice["logprobs"]
            assert {key: values[:prompt_tokens] for key, values in logprobs.items()} == expected
            assert choice["text"].startswith(prompt) and logprobs["text_offset"][prompt_tokens] == len(prompt)
            assert "".join(logprobs["tokens"]) == choice["text"]

        scored_tokens[0] = 0
        streamed = complete(client, prompt=prompt, n=4, max_tokens=10, logprobs=2, echo=True, temperature=1,
                            seed=3, stream=True)
        assert scored_tokens[0] == prompt_tokens - 1
        seen = stream_choices(streamed)
        assert sorted(seen) == [0, 1, 2, 3]
        for index, choice in seen.items():
            first = choice["logprobs"][0]  # the echoed prompt's chunk comes first, with its logprobs
            assert first == expected
            assert choice["text"] == choices[index]["text"]  # the same seeds: the same answers

        # Two prompts: each scored once.
        scored_tokens[0] = 0
        two = complete(client, prompt=[prompt, "on the"], n=3, max_tokens=5, logprobs=1, echo=True)
        other = len(Engine(FakeBackend(seed=7), n_slots=1).encode_prompt("on the", chat=False))
        assert two.status_code == 200 and scored_tokens[0] == prompt_tokens - 1 + other - 1
        texts = [choice["text"] for choice in two.json()["choices"]]
        assert all(text.startswith(prompt) for text in texts[:3]) and all(t.startswith("on the") for t in texts[3:])


# -- the event loop stays free -----------------------------------------------------------------------
# Asks /health again and again, each (asked, answered) a line of the file argv[2]: in a process
# of its own, so that nothing of the server's (its GIL) holds up the asking.
POLLER = """
import sys, time, httpx
with httpx.Client(base_url=sys.argv[1], timeout=60) as client, open(sys.argv[2], "a") as out:
    while True:
        asked = time.monotonic()
        assert client.get("/health").status_code == 200
        print(asked, time.monotonic(), file=out, flush=True)
        time.sleep(0.005)
"""


def test_health_answers_promptly_while_a_big_answer_is_built_and_encoded(monkeypatch, tmp_path, request):
    """The answer (several MB of logprobs JSON) is built and encoded while /health is asked
    again and again: no /health waits for more than a fraction of that work (on the event loop,
    each /health asked meanwhile would wait for all of it)."""
    window: dict[str, float] = {}
    build = completions._response

    def timed(*args, **kwargs):
        window["start"] = time.monotonic()
        return build(*args, **kwargs)

    monkeypatch.setattr(completions, "_response", timed)
    log = tmp_path / "polls"
    log.touch()
    # The objects earlier tests left in this process out of the collector's full passes: walking
    # them held the GIL for 0.45 s once in the whole suite, a pause of the test's, not the server's.
    gc.collect()
    gc.freeze()
    request.addfinalizer(gc.unfreeze)
    with serve() as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        poller = subprocess.Popen([sys.executable, "-c", POLLER, url, str(log)])
        try:
            deadline = time.monotonic() + 30
            while not log.read_text() and poller.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)  # the poller is started and asking
            big = chat(client, n=8, max_tokens=400, logprobs=True, top_logprobs=20, ignore_eos=True,
                       temperature=1)
            received = time.monotonic()
            time.sleep(0.1)  # the polls in flight come back
        finally:
            poller.kill()
            poller.wait(30)
    polls = [tuple(map(float, line.split())) for line in log.read_text().splitlines() if len(line.split()) == 2]
    assert big.status_code == 200 and len(big.content) > 3_000_000
    assert all(len(choice["logprobs"]["content"]) == 400 for choice in big.json()["choices"])
    start = window["start"]
    work = received - start  # building, encoding and sending the answer
    during = [answered - asked for asked, answered in polls if answered > start and asked < received]
    assert during, (work, polls[-5:])
    # Generous: scheduling on a loaded machine may delay a /health by tens of milliseconds; on the
    # loop, a /health asked as the work began would wait for all of it.
    assert max(during) < max(0.15, work / 2), (max(during), work, len(during))
