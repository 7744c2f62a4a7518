"""The build switch on the real pair (server/upgrade.py, scheduler.py): a server serving on one
build of ik_llama.cpp (as stored, as PyPI's wheel runs it) switches to another (repacked, as
specdec's build runs it) while a stream runs: the new engine's costs are measured between the
stream's rounds, the stream goes on to the end on the old engine, a request after the switch is
answered by the new one, every greedy text exactly each engine's own, and the old engine closed."""
import threading

import pytest
from fakes.threads import wait_until
from openai import OpenAI

from specdec.backends.cost_model import CostModel
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import GenerationRequest, SpecConfig

pytestmark = pytest.mark.timeout(900, method="thread")
LONG = "Write a long, detailed tutorial on Python's asyncio, with many code examples."
SHORT = "What is the capital of Australia?"


def greedy(engine, prompt: str, max_tokens: int) -> str:
    ids = engine.encode_prompt([{"role": "user", "content": prompt}], chat=True)
    return engine.generate(GenerationRequest(tuple(ids), max_tokens, spec=SpecConfig("off", 0))).text


def test_a_busy_server_switches_builds_between_rounds_and_every_text_is_exact(real_engine, provisional_engine):
    old = provisional_engine
    old.use_cost_model(CostModel({1: 0.08, 2: 0.09, 3: 0.1, 4: 0.11}))  # not measured: start-up skips it
    long_start = greedy(old, LONG, 48)
    short_after = greedy(real_engine, SHORT, 24)  # auto's greedy text is off's
    kept_costs = real_engine.cost_model
    app = create_app(old, ServerConfig(served_model_name="qwen", spec=SpecConfig("auto", 3), stall_timeout=1800))
    scheduler = app.state.specdec.scheduler
    running_at_switch = []
    scheduler.engine_listeners.append(lambda engine: running_at_switch.append(scheduler.num_running))
    try:
        with serve_in_thread(app, timeout=300) as (url, _):
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
            streamed, stop = [], threading.Event()

            def stream_long():  # far longer than the switch takes; ended by the test once it is over
                stream = client.chat.completions.create(
                    model="qwen", messages=[{"role": "user", "content": LONG}], max_tokens=2000, temperature=0,
                    stream=True, extra_body={"speculative_decoding": {"method": "off"}})
                for chunk in stream:
                    streamed.extend(choice.delta.content or "" for choice in chunk.choices)
                    if stop.is_set():
                        stream.close()
                        return

            reader = threading.Thread(target=stream_long, daemon=True)
            reader.start()
            wait_until(lambda: len(streamed) > 4, timeout=120)
            scheduler.request_switch(real_engine)
            wait_until(lambda: scheduler.engine is real_engine, timeout=300)
            assert running_at_switch == [1] and reader.is_alive()  # the stream did not hold up the switch
            after = client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": SHORT}],
                                                   max_tokens=24, temperature=0)
            assert after.choices[0].message.content == short_after
            stop.set()
            reader.join(120)
            text = "".join(streamed)
            assert len(text) > len(long_start) and text.startswith(long_start)  # on the old engine, exactly
            wait_until(lambda: not scheduler._retired, timeout=30)  # the old engine closed
            # Measured between the stream's rounds on the worker: a plausible model, or one rejected.
            assert real_engine.cost_model is not None
            assert scheduler.costs.new_build is False or scheduler.costs.due_at is not None
    finally:
        if kept_costs is not None:
            real_engine.use_cost_model(kept_costs)  # the other tests' pricing, as before
