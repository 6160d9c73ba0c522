"""The device queue: what an accelerator run is for (issue 47), in one command of under 10 minutes.

This module is the command: its arguments (``parse_args``), the shapes of a run (``FULL`` on an
accelerator, ``DRY`` for a dry run) and ``main``, which runs the stages of ``STAGES`` in order
(``STAGE_FNS``), each until its deadline, and writes the results; the package's docstring
describes the stages.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time

from experiments.device.compile_stage import stage_compile
from experiments.device.environment import stage_environment
from experiments.device.largest_batch import stage_largest_batch
from experiments.device.packing import stage_packing
from experiments.device.profile import stage_profile
from experiments.device.queue import STAGES, Queue
from experiments.device.recipes import RECIPES, ROOT, recipes_from_configs
from experiments.device.results import Results
from experiments.device.rotations import stage_rotations
from experiments.device.steps import stage_steps
from experiments.device.tests_stage import stage_tests, stop_background, wait_for_encoder_tests

DEFAULT_OUT = os.path.join(ROOT, "experiments", "benchmarks", "device")

# The shapes of a run: the real ones on an accelerator, tiny ones for a dry run.
# largest_encoders: how many encoders (in ENCODERS order) stage 7 may search (None: until its
# deadline); rotation_shape: (B, N) of stage 5; packing_batch: images of stage 8's batches.
FULL = dict(
    batch=64,
    steps=10,
    warmup=2,
    max_batch=4096,
    largest_encoders=None,
    overrides={},
    rotation_shape=(64, 12),
    other_backend_encoders=4,
    packing_batch=64,
)
DRY = dict(
    batch=2,
    steps=1,
    warmup=1,
    max_batch=8,
    largest_encoders=2,
    # One layer: the dry run checks each stage's path, which a second layer only makes longer
    # to trace and compile.
    overrides=dict(variant="pico", dims=dict(depth=1), patch_size=16, image_shape=(32, 32)),
    rotation_shape=(2, 2),
    other_backend_encoders=2,
    packing_batch=8,
)


STAGE_FNS = {
    "environment": stage_environment,
    "tests": stage_tests,
    "compile": stage_compile,
    "steps": stage_steps,
    "rotations": stage_rotations,
    "profile": stage_profile,
    "largest_batch": stage_largest_batch,
    "packing": stage_packing,
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.device", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help="folder of the JSON and Markdown")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for every stage")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (automatic on CPU)")
    parser.add_argument("--encoders", default="", help="a subset of ENCODERS, comma-separated")
    parser.add_argument("--attention", default="", help="a subset of the backends")
    parser.add_argument("--skip", default="", help="stages not to run, comma-separated")
    parser.add_argument(
        "--every-variant",
        action="store_true",
        help="also the variants measured slower on this platform (variants.MEASURED_SLOWER)",
    )
    parser.add_argument("--compile-threads", type=int, default=0, help="0: 4, or 2 on CPU")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak")
    parser.add_argument("--recipes", default=RECIPES, help="the encoders' recipes (JSON)")
    parser.add_argument(
        "--write-recipes",
        action="store_true",
        help="write the recipes from configs/imagenet.py (needs ml_collections) and exit",
    )
    return parser.parse_args(argv)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.write_recipes:
        with open(args.recipes, "w") as f:
            json.dump(recipes_from_configs(), f, indent=1)
            f.write("\n")
        print(f"wrote {args.recipes}")
        return None
    # Before jax starts its backends: the device's memory grows as needed (the GPU tests run
    # beside this process), up to most of it (the largest batch).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    import jax

    platform = jax.default_backend()
    args.dry_run = args.dry_run or platform == "cpu"
    args.compile_threads = args.compile_threads or (2 if platform == "cpu" else 4)
    shapes = DRY if args.dry_run else FULL
    device = jax.devices()[0].device_kind
    data = {
        "schema": 1,
        "device": device,
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": ["python", "-m", "experiments.device", *(argv or sys.argv[1:])],
        "dry_run": args.dry_run,
        "budget_s": args.budget,
        "shapes": {k: v for k, v in shapes.items()},
        "compile_threads": args.compile_threads,
        "rows": [],
        "stages": {},
    }
    results = Results(args.out, device, data)
    print(f"writing {results.json_path}", flush=True)
    q = Queue(args, shapes, results)
    # A run that overstays its budget stops; what it measured is already on disk.
    watchdog = threading.Timer(args.budget + 20, lambda: (stop_background(q), os._exit(3)))
    watchdog.daemon = True
    watchdog.start()
    skip = set(filter(None, args.skip.split(",")))
    try:
        for name in STAGES:
            if name in skip:
                data["stages"][name] = {"status": "skipped", "note": "--skip"}
                continue
            q.run_stage(name, STAGE_FNS[name])
        wait_for_encoder_tests(q)
    finally:
        watchdog.cancel()
        stop_background(q)
        q.pool.shutdown(wait=True, cancel_futures=True)
        q.init_pool.shutdown(wait=True, cancel_futures=True)
        data["seconds"] = round(time.monotonic() - q.start, 1)
        results.save()
    print(f"wrote {results.json_path} and {results.md_path} in {data['seconds']} s", flush=True)
    return data
