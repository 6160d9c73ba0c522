"""The stages in their order, their deadlines and one run's shared state.

``STAGES`` is the order the stages run in; ``DEADLINES`` is where each must end, as a share of
``--budget`` seconds from the start. ``Queue`` is what the stages share: the clock, the results,
the recipes, and what one stage leaves for the next (the compiled steps, the train states, the
background tests); ``Queue.run_stage`` runs one stage and records its status, time and error.
"""

from __future__ import annotations

import concurrent.futures
import time
import traceback
from typing import Any

from experiments.device.recipes import read_recipes
from experiments.device.results import Results

# Where each stage must end, as a share of the budget from the start (stage 2's encoder tests
# run in the background until their own deadline, before stage 4 times anything).
DEADLINES = {
    "environment": 0.03,
    "tests": 0.20,
    "encoder_tests": 0.45,
    "compile": 0.51,  # then up to compile_stage.DRAIN_SHARE for the compiles already running
    "steps": 0.68,
    "rotations": 0.76,  # LieRE's block products and exponentials alone, with each variant
    "profile": 0.84,  # LieRE 8x8, each variant, RoPE-Mixed
    "largest_batch": 0.95,  # before packing: issue 47's MFU goal is read at the largest batch
    "packing": 0.99,  # issue 45's (resolved; RoPE-Mixed measured at 0.76 of padded)
}
STAGES = (
    "environment",
    "tests",
    "compile",
    "steps",
    "rotations",
    "profile",
    "largest_batch",
    "packing",
)

# Threads building the encoders' initial states (``Queue.init_pool``), apart from the compiles.
# With one, and each initialisation compiled for the GPU, on an H200 every timed row after the
# first took 37 s (its step 22-67 ms), one after another from the compile stage's end, as if each
# waited for the next init in that one queue. The states are built by the host's CPU
# (``compile_stage.host_init``); two threads halve any backlog left, and more would take the CPU
# from the compile stage's lowering and compiles. Each row records its wait (``init_wait_s``).
INIT_THREADS = 2


class Queue:
    """Shared state of one run: the clock, the results and the compiled programs."""

    def __init__(self, args, shapes: dict, results: Results):
        self.args, self.shapes, self.results = args, shapes, results
        self.start = time.monotonic()
        self.recipes = read_recipes(args.recipes)
        self.compiled: dict[tuple, dict] = {}  # (encoder, attention, batch, variant) -> info
        self.cases: list[tuple] = []  # the keys of stage 3, in the order they are timed
        self.states: dict[str, Any] = {}  # encoder -> future of its initial (state, other)
        self.compiling: dict[Any, tuple] = {}  # future of a stage-3 compile -> its case's key
        self.background: dict[str, Any] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(args.compile_threads)
        # the encoders' initial states, in the order their steps are first lowered (and timed)
        self.init_pool = concurrent.futures.ThreadPoolExecutor(INIT_THREADS)

    @property
    def data(self) -> dict:
        return self.results.data

    def deadline(self, stage: str) -> float:
        return self.start + DEADLINES[stage] * self.args.budget

    def left(self, stage: str) -> float:
        return self.deadline(stage) - time.monotonic()

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.start

    def run_stage(self, name: str, fn) -> None:
        """Run one stage, recording its status, time and any error; never raise."""
        record = {"status": "running"}
        self.data["stages"][name] = record
        began = time.monotonic()
        if self.left(name) <= 0:
            record.update(status="skipped", note="no time left in the budget")
        else:
            try:
                note = fn(self)
                record.update(status="ok", note=note or "")
            except Exception:
                record.update(status="error", error=traceback.format_exc()[-4000:])
                print(f"[{name}] failed:\n{record['error']}", flush=True)
        record["seconds"] = round(time.monotonic() - began, 1)
        self.results.save()
        print(f"[{name}] {record['status']} in {record['seconds']} s", flush=True)
