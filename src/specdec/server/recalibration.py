"""`auto`'s cost model kept trustworthy: calibrations that check themselves.

A calibration measured while something else loads the machine (a compile beside the server, the
old engine serving while a new build is measured) can be nonsense, e.g. t(1) 252.7 ms and v(2)
0.89 on a Zen 3 whose quiet t(1) is about 80 ms. `auto` priced with it speculates where it
should not. So a measurement that fails the plausibility check (cost_model.implausibility) is
not adopted: the last good model is kept (with none yet, the measurement serves meanwhile), and
the costs are measured again later, at the worker's idle moments, in steps that a waiting request
interrupts (scheduler.py); the log says which model serves and why.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

from specdec.backends.cost_model import CalibrationInterrupted, CostModel, implausibility
from specdec.engine.engine import Engine

logger = logging.getLogger("specdec.server")

RETRY_SECONDS = (30.0, 120.0, 600.0)  # after the 1st, 2nd, 3rd and later rejected measurements


class CostKeeper:
    """The server's last good cost model, and when to measure again."""

    def __init__(self, clock: Callable[[], float], last_good: Optional[CostModel] = None):
        self.clock = clock
        self.last_good = last_good  # a saved model of this setup, or the last one adopted
        self.due_at: Optional[float] = None  # when to measure again; None: nothing to do
        self.rejected = 0  # measurements rejected in a row
        self.new_build = False  # the last good model is another build's: no reference for t(1)

    def offer(self, engine: Engine, measured: CostModel, occasion: str) -> bool:
        """Give `engine` the measured model if it is plausible (True), else the last good one, and
        schedule another measurement."""
        reason = implausibility(measured, None if self.new_build else self.last_good)
        if reason is None:
            self.last_good, self.due_at, self.rejected, self.new_build = measured, None, 0, False
            engine.use_cost_model(measured)
            logger.info("calibrated for auto (%s): %s", occasion, measured.summary())
            return True
        delay = RETRY_SECONDS[min(self.rejected, len(RETRY_SECONDS) - 1)]
        self.rejected += 1
        self.due_at = self.clock() + delay
        if self.last_good is not None:
            engine.use_cost_model(CostModel.from_json(self.last_good.to_json()))  # a copy: it updates online
            kept = f"keeping the last good model ({self.last_good.summary()})"
        else:
            engine.use_cost_model(measured)
            kept = "no good model yet, so auto prices with this one meanwhile"
        logger.warning("calibration for auto (%s) looks wrong: %s (%s); %s; measuring again in %.0f s at an "
                       "idle moment", occasion, reason, measured.summary(), kept, delay)
        return False

    def adopt_new_build(self, engine: Engine, serving: Engine, measured: Optional[CostModel]) -> None:
        """`engine` serves from now on, priced with `measured` (its costs, measured by the worker
        between the serving engine's rounds; None if that failed) where plausible: another
        build's t(1) is no reference. Else with the costs `serving` priced with (a copy) until
        measured again at an idle moment."""
        self.last_good = self.last_good or serving.cost_model
        self.new_build, self.rejected = True, 0
        if measured is not None:
            self.offer(engine, measured, "the new build, measured between rounds")
            return
        if self.last_good is not None:
            engine.use_cost_model(CostModel.from_json(self.last_good.to_json()))
        self.due_at = self.clock()
        logger.info("the new build prices with the last build's costs until its own are measured at an idle moment")

    def due(self) -> bool:
        return self.due_at is not None and self.clock() >= self.due_at

    def measure_again(self, engine: Engine, slot: int, interrupted: Callable[[], bool]) -> None:
        """Measure on `slot`'s caches (a free slot's: they are left empty); a request that arrives
        meanwhile interrupts it, and the next idle moment begins it again."""
        try:
            measured = engine.measure_costs(slot, interrupted=interrupted)
        except CalibrationInterrupted:
            logger.debug("the cost model's measurement gave way to a request; again at the next idle moment")
            return
        self.offer(engine, measured, "measured again")
