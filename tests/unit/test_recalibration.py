"""Calibrations that check themselves (backends/cost_model.implausibility, server/recalibration.py):
a cost model measured on a busy machine is not adopted; the last good one serves meanwhile and
the costs are measured again at the worker's idle moments, which a request interrupts."""
import logging
import threading
import time

import httpx
import pytest

from fakes.threads import in_thread, wait_until

from specdec.backends.cost_model import CalibrationInterrupted, CostModel, implausibility
from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.recalibration import RETRY_SECONDS, CostKeeper
from specdec.server.testing import serve_in_thread
from specdec.types import SpecConfig

pytestmark = pytest.mark.timeout(60)


def model(t1, *v):
    return CostModel({1: t1, **{n: t1 * value for n, value in enumerate(v, start=2)}})


GOOD = model(0.080, 1.3, 1.6, 1.9, 2.2)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_plausible_model_passes_and_busy_machine_models_do_not():
    assert implausibility(GOOD) is None
    assert implausibility(model(0.085, 1.25, 1.62, 1.88, 2.3), GOOD) is None  # a VM's ordinary drift
    assert implausibility(model(0.080, 1.0, 0.98, 1.0, 1.01)) is None  # flat, as where verification is free
    # The model a Zen 3 measured with a compile beside it (issue 42): t(1) 252.7 ms, v(2) 0.89.
    zen3_busy = model(0.2527, 0.89, 0.99, 0.99, 1.00)
    assert "v(2) 0.89 is below 1" in implausibility(zen3_busy)
    assert "below v(3)" in implausibility(model(0.080, 1.3, 2.4, 1.5, 2.6))  # not monotone beyond noise
    assert implausibility(model(0.080, 1.3, 3.26, 2.50, 3.4)) is None  # a dip a quiet Zen 5 measured
    assert "t(1) 252.7 ms is 3.2x" in implausibility(model(0.2527, 1.3, 1.6, 1.9, 2.2), GOOD)
    assert implausibility(model(0.2527, 1.3, 1.6, 1.9, 2.2)) is None  # no last good model to compare with


def test_the_keeper_keeps_the_last_good_model_and_measures_again_later(caplog):
    engine, clock = Engine(FakeBackend(seed=7)), Clock()
    keeper = CostKeeper(clock, last_good=GOOD)
    with caplog.at_level(logging.INFO, logger="specdec.server"):
        assert not keeper.offer(engine, model(0.2527, 0.89, 0.99, 0.99, 1.00), "start-up")
    assert engine.cost_model.to_json() == GOOD.to_json() and engine.cost_model is not GOOD  # a copy: it updates online
    assert "looks wrong: v(2) 0.89 is below 1" in caplog.text and "keeping the last good model" in caplog.text
    assert not keeper.due()
    clock.now += RETRY_SECONDS[0]
    assert keeper.due()
    assert not keeper.offer(engine, model(0.080, 0.5), "measured again")
    assert keeper.due_at == clock.now + RETRY_SECONDS[1]  # backs off
    better = model(0.083, 1.3, 1.6, 1.9, 2.3)
    assert keeper.offer(engine, better, "measured again")
    assert engine.cost_model is better and keeper.last_good is better and not keeper.due() and keeper.rejected == 0


def test_with_no_good_model_yet_the_measurement_serves_meanwhile(caplog):
    engine, keeper = Engine(FakeBackend(seed=7)), CostKeeper(Clock())
    wrong = model(0.080, 0.9)
    with caplog.at_level(logging.INFO, logger="specdec.server"):
        assert not keeper.offer(engine, wrong, "start-up")
    assert engine.cost_model is wrong and keeper.due_at is not None and "no good model yet" in caplog.text


class SlowFake(FakeBackend):
    """Forwards that take time in proportion to their tokens, so a calibration is plausible and lasts."""

    def eval(self, seq_id, start, tokens, *, prefill=False):
        time.sleep(0.003 * (1 + 0.5 * len(tokens)))
        return super().eval(seq_id, start, tokens, prefill=prefill)


def test_a_new_build_is_priced_with_its_own_measurement_and_another_builds_t1_is_no_reference(caplog):
    old, new, clock = Engine(FakeBackend(seed=7)), Engine(FakeBackend(seed=7)), Clock()
    keeper = CostKeeper(clock)
    assert keeper.offer(old, GOOD, "start-up")
    faster = model(0.080 / 3, 1.3, 1.6, 1.9, 2.2)  # 3x faster than the old build: adopted all the same
    keeper.adopt_new_build(new, old, faster)
    assert new.cost_model is faster and keeper.last_good is faster and not keeper.due()
    with caplog.at_level(logging.INFO, logger="specdec.server"):
        assert not keeper.offer(new, GOOD, "measured again")  # and it is the reference from then on
    assert "is 3.0x the last good model's" in caplog.text and new.cost_model.to_json() == faster.to_json()


def test_a_new_build_whose_measurement_is_wrong_or_failed_prices_with_the_last_costs_until_measured_again():
    old, clock = Engine(FakeBackend(seed=7)), Clock()
    for measured in (model(0.2527, 0.89, 0.99, 0.99, 1.00), None):
        new, keeper = Engine(FakeBackend(seed=7)), CostKeeper(clock)
        assert keeper.offer(old, GOOD, "start-up")
        keeper.adopt_new_build(new, old, measured)
        assert new.cost_model.to_json() == GOOD.to_json() and new.cost_model is not GOOD  # a copy: it updates online
        clock.now += RETRY_SECONDS[0]
        assert keeper.due()  # at the worker's next idle moment
        faster = model(0.080 / 3, 1.3, 1.6, 1.9, 2.2)
        assert keeper.offer(new, faster, "measured again") and new.cost_model is faster  # no t(1) reference


def test_an_idle_server_measures_again_and_a_request_interrupts_it():
    engine = Engine(SlowFake(seed=7))
    app = create_app(engine, ServerConfig(served_model_name="fake", spec=SpecConfig("auto", 4)))
    scheduler = app.state.specdec.scheduler
    measuring, proceed = threading.Event(), threading.Event()
    outcomes = []
    measure = engine.measure_costs

    def watched_measure(slot=0, interrupted=None):
        if interrupted is None:  # start-up's, before serving
            return measure(slot)

        def held():  # the first measurement at an idle moment waits, mid-way, for the test's request
            measuring.set()
            if not proceed.is_set():
                proceed.wait(10)
            return interrupted()
        try:
            cost = measure(slot, interrupted=held)
        except CalibrationInterrupted:
            outcomes.append("interrupted")
            raise
        outcomes.append("measured")
        return cost

    engine.measure_costs = watched_measure  # type: ignore[method-assign]
    with serve_in_thread(app) as (url, _):
        start_up = scheduler.costs.last_good
        assert start_up is engine.cost_model  # start-up's measurement was adopted
        scheduler.costs.due_at = scheduler.clock()  # as if it had been rejected
        assert measuring.wait(10)
        request, result = in_thread(httpx.post, url + "/v1/completions", timeout=30, json={
            "model": "fake", "prompt": "the cat", "max_tokens": 8, "temperature": 0})
        wait_until(lambda: scheduler.num_waiting == 1)
        proceed.set()
        request.join(30)
        assert result["value"].status_code == 200 and outcomes[0] == "interrupted"
        wait_until(lambda: "measured" in outcomes)  # the next idle moment measures it through
        wait_until(lambda: scheduler.costs.due_at is None)
        assert scheduler.costs.last_good is not start_up and engine.cost_model is scheduler.costs.last_good
