"""A graphchunk worker that makes pool entries bad while it serves: the aborts soak's fill failures.

    PYTHONPATH=. GRAPHCHUNK_SOAK_FAIL_EVERY=50 \
        vllm serve MODEL --worker-cls perf.soak.fill_faults.FaultyRunner ...

``FaultyRunner`` is graphchunk's worker (``graphchunk.Runner``; graphchunk serves a subclass of it
as its own), except that on every ``$GRAPHCHUNK_SOAK_FAIL_EVERY``-th step that copies context
from the pool it first stamps the blocks of one entry that step copies ``POISONED`` in the
worker's epoch map (``ContextRunner.epochs``), as a lifetime bug would leave them (the entry is
drawn with ``$GRAPHCHUNK_SOAK_SEED``; only entries whose blocks hold their epoch, so that no job
stamps over the poison). What the product must then do (``cache/context_run.py``): the copy fails
its check, the request copying it goes back to vLLM's queue and is planned again
(``fills_retried``: ``engine/fill_retry.py``), the entry leaves the pool's index
(``entries_failed``) and that new plan computes it again; a job that reads it poisons its own
entry the same way. Injections stop once the file
``$GRAPHCHUNK_SOAK_FAULTS_OFF`` names exists. Each logs ``INJECTED`` with its epoch; the soak
(``pressure.py --fail-fill-every``) counts them in the server log.
"""
from __future__ import annotations

import functools
import os
import random

import graphchunk
from graphchunk.cache.context_run import POISONED
from graphchunk.engine.connector import work_of
from graphchunk.log import logger

EVERY_ENV = "GRAPHCHUNK_SOAK_FAIL_EVERY"
SEED_ENV = "GRAPHCHUNK_SOAK_SEED"
OFF_ENV = "GRAPHCHUNK_SOAK_FAULTS_OFF"
"""A file's path: once it exists, no more injections (the soak's checks after its traffic)."""
INJECTED = "soak: poisoned the pool entry of epoch"


def copied_units(scheduler_output, runner) -> list:
    """The step's units (``UnitCopy``) read from the pool whose blocks already hold their entry's
    epoch (``ContextRunner._holds``, the check a copy makes)."""
    work = work_of(scheduler_output.kv_connector_metadata)
    return [unit for load in (*work.fills, *work.loads) if load.refused is None for unit in load.units
            if runner._holds(unit.entry_blocks, unit.epoch)]


def poison(epochs: dict[int, int], unit) -> None:
    """Stamps the blocks of ``unit``'s entry ``POISONED``."""
    for block in unit.entry_blocks:
        epochs[block] = POISONED
    logger.warning("%s %d (blocks %s)", INJECTED, unit.epoch, list(unit.entry_blocks))


@functools.cache
def _faulty_runner() -> type:
    class FaultyRunner(graphchunk.Runner):
        """graphchunk's worker that poisons an entry on every ``$GRAPHCHUNK_SOAK_FAIL_EVERY``-th copying step."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.fault_every = int(os.environ.get(EVERY_ENV, "0"))
            self.fault_rng = random.Random(int(os.environ.get(SEED_ENV, "0")))
            self.faults_off = os.environ.get(OFF_ENV, "")
            self.copying_steps = 0

        def execute_model(self, scheduler_output, *args, **kwargs):
            engine = self.model_runner.chunk_engine
            if engine is not None and self.fault_every > 0 and scheduler_output is not None:
                units = copied_units(scheduler_output, engine.runner)
                self.copying_steps += bool(units)
                if units and self.copying_steps % self.fault_every == 0 and not (
                        self.faults_off and os.path.exists(self.faults_off)):
                    poison(engine.runner.epochs, self.fault_rng.choice(units))
            return super().execute_model(scheduler_output, *args, **kwargs)

    FaultyRunner.__module__ = __name__
    return FaultyRunner


def __getattr__(name: str):
    """``FaultyRunner`` is built on first use (as ``graphchunk.Runner`` is: the platform's worker),
    so that the soak's driver imports this module's names without vLLM's worker."""
    if name == "FaultyRunner":
        return _faulty_runner()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
