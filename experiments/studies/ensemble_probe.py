r"""Train S seeds of one config in one program: the real train step, vmapped over a seed axis.

    python -m experiments.studies.ensemble_probe \
        --config 'configs/fashion_mnist.py:pe=liere,block=8,input=memory,resolution_evals=false' \
        --seeds 0,1,2,3,4 --steps 300

A tiny ViT on an accelerator is bound by per-step overhead (kernel launches, Python), so one
process per seed leaves it idle. Here the seeds of one arm share each kernel launch: the
ensemble state is a run's train state with a leading seed axis S on every leaf,
``jax.vmap(train.make_train_step(setup))`` steps all of them at once on stacked (S, B, ...)
batches and per-seed dropout keys. Seed k's trajectory is the single run's of seed k
(tests/test_ensemble_probe.py): the same initial state and dropout key (``run_keys``, as
``rope_lie.train._train`` derives them) and the same batches (``rope_lie/in_memory.py``'s
stream of ``data_seed``, else ``seed``).

Printed (and written as JSON with ``--out``), after compiling and ``--warmup`` steps: seed-steps
per second of the S seeds' single-run steps one after another (the baseline, the plain jitted
step) and of the ensemble step, both on a small pool of real batches prepared before timing
and with the loop's host sync (step t-1's metrics read after step t is dispatched,
``rope_lie/loop.py``); and how many S-seed batches per second the input makes alone: the
single runs' input (``in_memory.data_train_batches``, one dispatch per member and step,
stacked) and the same batches made for all members in one dispatch (``device_batches``).
``--stream`` also times the steps with batches read from each input as they are needed;
``--steps-per-call K`` also the ensemble stepped K steps a call under ``lax.scan``
(``make_scanned_step``: one dispatch and one host sync per K steps, what a training loop of
K-step chunks would save where a step is bound by launches; batches made ahead).

Progress: each phase (loading the data, building the seeds' states, compiling the single and
the ensemble step and the device input, each timed row's warm-up and timing) is announced on
stderr with its elapsed seconds as it starts and ends, flushed, with a line every
``PROGRESS_SECONDS`` during a timed loop; the table comes on stdout at the end.
With ``--out`` the JSON is rewritten after every phase (``"complete": false`` until the end),
so a killed run keeps what it measured. ``--budget SECONDS`` (counted from the start of
``main``) stops timing when it is spent: each row may use its share of what is left (the
remainder over the rows still to time), a row stopped early keeps the rate of the steps it
timed (``steps_timed``), rows not reached are listed under ``skipped``, and the JSON and the
table are written as usual. A compile is not interrupted: leave ``timeout`` a margin over the
budget for the imports, the backend's start and a compile in flight.

Needs no TensorFlow: jax, flax, optax, orbax, chex, numpy, ml_collections, and tqdm (imported
by ``rope_lie/loop.py``, which ``rope_lie.train`` imports); the config's ``input`` must be
``memory``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections as mc

from rope_lie import in_memory, loop, sharding, train

# the ensemble's pieces, in the library since the trainer (rope_lie/ensemble.py) uses them
from rope_lie.ensemble import (
    device_batches,
    make_device_input,
    make_ensemble_step,
    run_keys,
    stack,
    stacked_sharding,
)
from rope_lie.ensemble import member_config as seed_config

POOL = 4  # distinct batches per seed cycled through by the timed steps


def scanned_row(steps_per_call: int) -> str:
    """The row of the ensemble stepped ``steps_per_call`` steps a call."""
    return f"ensemble, {steps_per_call} steps a call (lax.scan)"


PROGRESS_SECONDS = 5.0  # seconds between progress lines in a timed loop
clock = time.monotonic  # the budget's clock (the rates are timed with time.perf_counter)


def load_config(spec: str) -> mc.ConfigDict:
    """A recipe's config from ``path/to/recipe.py[:argument]``, as ``rope_lie.main`` reads it."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("recipe", path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"--config={spec!r}: no recipe file {path!r}")
    recipe = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(recipe)
    return recipe.get_config(arg or None)


def init_members(init: Callable, seeds: Sequence[int]) -> list[tuple[Any, Any, jax.Array]]:
    """Per seed, (state, other, dropout_key) at step 0, from ``create_setup_and_state``'s
    `init` and the seed's run keys."""
    members = []
    for seed in seeds:
        init_key, dropout_key = run_keys(seed)
        state, other = init(init_key)
        members.append((state, other, dropout_key))
    return members


def train_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """The keys of an input batch that the train step reads (``loop.TRAIN_KEYS``)."""
    return {k: batch[k] for k in loop.TRAIN_KEYS if k in batch}


def member_batches(config: mc.ConfigDict, mesh, start: int = 0) -> Iterator[dict[str, Any]]:
    """The train batches of one run (its config's data seed) from step `start` on, placed on
    the mesh as the loop places them (``sharding.shard_batch``)."""
    for batch in in_memory.data_train_batches(config, None, start):
        yield sharding.shard_batch(train_batch(batch), mesh)


def ensemble_batches(configs: Sequence[mc.ConfigDict], mesh, start: int = 0) -> Iterator[dict]:
    """Stacked (S, B, ...) batches: member k's batch t is run k's batch t."""
    streams = [in_memory.data_train_batches(c, None, start) for c in configs]
    while True:
        batch = stack([train_batch(next(s)) for s in streams])
        yield jax.device_put(batch, stacked_sharding(mesh))


def build(
    config: mc.ConfigDict, seeds: Sequence[int], mesh, progress: Progress | None = None
) -> dict:
    """The single-run step, the ensemble step and the members' step-0 states of `config`, with
    the run's learning-rate schedule (``train.schedule_steps``); `progress` announces the data's
    loading and the states' building."""
    progress = Progress.silent() if progress is None else progress
    with progress.phase("loading the data into memory (in_memory.prepare_data)"):
        num_train = in_memory.prepare_data(config)
    with progress.phase(f"building the setup and {len(seeds)} seeds' step-0 states"):
        total, _, _ = train.schedule_steps(config, num_train)
        setup, _, init, _ = train.create_setup_and_state(config, mesh, total)
        members = jax.block_until_ready(init_members(init, seeds))
    return {
        "total": total,
        "setup": setup,
        "step": train.make_train_step(setup),
        "ensemble_step": make_ensemble_step(setup),
        "members": members,
        "configs": [seed_config(config, s) for s in seeds],
    }


# --------------------------------------------------------------------------- progress


class Progress:
    """What the probe is doing, said as it goes, and what it has measured, written as it goes.

    Each phase is a line on stderr (flushed) when it starts and one with its seconds when it
    ends, prefixed with the seconds since this object was made; `result` collects the rows,
    the steps each timed, the rows skipped and the phases' seconds, and is written to `out` (if
    any) after every phase (``main`` sets ``"complete"`` at the end). `budget`: seconds (of
    ``clock``, from this object's making) after which nothing more is timed; None: no limit.
    """

    def __init__(
        self,
        budget: float | None = None,
        out: str | None = None,
        quiet: bool = False,
        result: dict[str, Any] | None = None,
    ):
        self.start = time.perf_counter()
        self.budget_start = clock()
        self.budget = budget
        self.out = out
        self.quiet = quiet
        self.row_end = math.inf  # budget clock time at which the row being timed stops
        self.result: dict[str, Any] = {} if result is None else result

    @classmethod
    def silent(cls) -> Progress:
        return cls(quiet=True)

    def say(self, message: str) -> None:
        if not self.quiet:
            elapsed = time.perf_counter() - self.start
            print(f"[ensemble_probe {elapsed:7.1f} s] {message}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Announce `name`, run the block, then say and record its seconds and write."""
        self.say(f"{name} ...")
        tick = time.perf_counter()
        yield
        seconds = time.perf_counter() - tick
        self.result.setdefault("phases", {})[name] = round(seconds, 3)
        self.say(f"{name}: {seconds:.2f} s")
        self.write()

    def left(self) -> float:
        """Budget seconds left (infinite without a budget)."""
        if self.budget is None:
            return math.inf
        return self.budget - (clock() - self.budget_start)

    def spent(self) -> bool:
        return self.left() <= 0

    def start_row(self, rows_left: int) -> None:
        """The row about to be timed may use its share of the budget that is left."""
        self.row_end = clock() + self.left() / rows_left

    def row_spent(self) -> bool:
        return clock() >= self.row_end or self.spent()

    def write(self) -> None:
        """`result` as JSON to `out`, through a temporary file (a kill leaves the last whole
        one)."""
        if self.out:
            tmp = self.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.result, f, indent=1)
            os.replace(tmp, self.out)


# --------------------------------------------------------------------------- timing


@dataclasses.dataclass
class Timing:
    """A timed loop: `steps` calls timed (fewer than asked when the budget stopped it, 0 when
    it stopped in the warm-up) in `seconds`, each worth `per_call` seed-steps (or batches)."""

    steps: int
    seconds: float
    per_call: int = 1
    warmup_seconds: float = 0.0

    @property
    def rate(self) -> float | None:
        """Seed-steps (or batches) per second; None when no call was timed."""
        return self.per_call * self.steps / self.seconds if self.steps else None


def _timed_steps(
    step_fn: Callable,
    n: int,
    warmup: int,
    progress: Progress | None = None,
    name: str = "steps",
    per_call: int = 1,
) -> Timing:
    """`n` calls of step_fn(i) -> metrics timed after `warmup` untimed ones, reading call i-1's
    metrics after call i is dispatched (``loop.run_steps``'s host sync). Stops early, with the
    calls timed so far, when `progress`'s row share of the budget is spent (after at least one
    timed call), or in the warm-up when the whole budget is; says how far it got every
    ``PROGRESS_SECONDS``."""
    progress = Progress.silent() if progress is None else progress
    pending = None
    start = tick = last_line = time.perf_counter()
    timed = 0
    for i in range(warmup + n):
        if i == warmup:
            jax.block_until_ready(pending)
            tick = last_line = time.perf_counter()
            progress.say(f"  {name}: warm-up ({warmup} steps) {tick - start:.2f} s; timing {n}")
        elif i < warmup and progress.spent():
            jax.device_get(pending)
            progress.say(f"  {name}: budget spent in the warm-up, after {i} of {warmup} steps")
            return Timing(0, 0.0, per_call, time.perf_counter() - start)
        m = step_fn(i)
        if pending is not None:
            jax.device_get(pending)
        pending = m
        if i >= warmup:
            timed += 1
            now = time.perf_counter()
            if now - last_line >= PROGRESS_SECONDS:
                rate = per_call * (timed - 1) / (now - tick)  # call `timed` may still run
                progress.say(f"  {name}: {timed}/{n} steps in {now - tick:.1f} s, ~{rate:.1f}/s")
                last_line = now
            if timed < n and progress.row_spent():
                progress.say(f"  {name}: budget share spent after {timed} of {n} steps")
                break
    jax.device_get(pending)
    return Timing(timed, time.perf_counter() - tick, per_call, tick - start)


def time_single(
    built: dict,
    batches: Callable,
    n: int,
    warmup: int,
    progress: Progress | None = None,
    name: str = "single",
) -> Timing:
    """The members' plain steps, one seed after another per step (its rate: seed-steps per
    second).

    `batches(k, i)` is member k's batch of call i."""
    step = built["step"]
    states = [jax.tree.map(jnp.copy, state) for state, _, _ in built["members"]]

    def one(i):
        out = []
        for k, (_, other, dropout_key) in enumerate(built["members"]):
            states[k], m = step(states[k], batches(k, i), other, dropout_key)
            out.append(m)
        return out

    return _timed_steps(one, n, warmup, progress, name, per_call=len(states))


def ensemble_state(built: dict) -> tuple[Any, Any, jax.Array]:
    """(state_S, other_S, dropout_key_S): the members' step-0 states stacked (fresh arrays: the
    ensemble step donates its state)."""
    members = built["members"]
    state = stack([s for s, _, _ in members])
    other, dropout_key = stack([o for _, o, _ in members]), jnp.stack([d for _, _, d in members])
    return state, other, dropout_key


def time_ensemble(
    built: dict,
    batches: Callable,
    n: int,
    warmup: int,
    progress: Progress | None = None,
    name: str = "ensemble",
    scanned: bool = False,
) -> Timing:
    """The vmapped ensemble step (its rate: seed-steps per second); `batches(i)` is call i's
    stack. `scanned`: ``built["scanned_step"]`` instead, ``built["steps_per_call"]`` steps a
    call on a (K, S, ...) stack; `n` and `warmup` are calls."""
    state, other, dropout_key = ensemble_state(built)
    step = built["scanned_step"] if scanned else built["ensemble_step"]
    steps = built["steps_per_call"] if scanned else 1

    def one(i):
        nonlocal state
        state, m = step(state, batches(i), other, dropout_key)
        return m

    return _timed_steps(one, n, warmup, progress, name, per_call=steps * len(built["members"]))


def make_scanned_step(setup: train.Setup, steps_per_call: int) -> Callable:
    """Jitted (state_S, batches_KS, other_S, dropout_key_S) -> (state_S, last step's metrics_S):
    K = ``steps_per_call`` ensemble steps (``make_ensemble_step``'s vmapped train step) under
    ``lax.scan`` over K stacked batches (K, S, B, ...), in one dispatch and one host sync. The
    state is donated."""
    vstep = jax.vmap(train.make_train_step(setup))

    def call(state, batches, other, dropout_key):
        def body(st, batch):
            return vstep(st, batch, other, dropout_key)

        state, metrics = jax.lax.scan(body, state, batches, length=steps_per_call)
        return state, jax.tree.map(lambda m: m[-1], metrics)

    return jax.jit(call, donate_argnums=(0,))


def time_input(
    stream: Iterator, n: int, progress: Progress | None = None, name: str = "input"
) -> Timing:
    """Stacked S-seed batches that `stream` makes (input work alone, no step; its rate: batches
    per second), after one untimed batch; stops early when the row's budget share is spent."""
    progress = Progress.silent() if progress is None else progress
    start = time.perf_counter()
    jax.block_until_ready(next(stream))
    tick = time.perf_counter()
    last, made = None, 0
    for batch in itertools.islice(stream, n):
        last, made = batch, made + 1
        if made < n and progress.row_spent():
            progress.say(f"  {name}: budget share spent after {made} of {n} batches")
            break
    jax.block_until_ready(last)
    return Timing(made, time.perf_counter() - tick, 1, tick - start)


def probe(
    config: mc.ConfigDict,
    seeds: Sequence[int],
    steps: int,
    warmup: int,
    stream: bool,
    progress: Progress | None = None,
    steps_per_call: int = 0,
) -> dict[str, float]:
    """The rows of the table: name -> seed-steps (or S-seed batches) per second.

    `progress` says each phase as it goes and collects in its `result` the rows, the steps
    each timed (``steps_timed``), the rows the budget left out (``skipped``) and the phases'
    seconds. Rows are timed after everything is compiled; each may use its share of the
    budget left. With ``steps_per_call`` K > 0, also the ensemble K steps a call
    (``make_scanned_step``, batches made ahead), for steps // K calls. Returns the rows
    measured (all of them without a budget)."""
    if not in_memory.uses_memory(config):
        raise ValueError(f"input={config.get('input')!r}; the probe reads input='memory'")
    progress = Progress.silent() if progress is None else progress
    result = progress.result
    rows, steps_timed, skipped = result.setdefault("rows", {}), {}, []
    result.update(steps_timed=steps_timed, skipped=skipped)
    s = len(seeds)
    n_input = max(20, steps // 4)
    result["input_batches"] = n_input
    mesh = sharding.make_mesh(config.mesh)
    with jax.set_mesh(mesh):
        built = build(config, seeds, mesh, progress)
        configs = built["configs"]
        state, other, key = built["members"][0]
        with progress.phase(f"making the batch pool ({POOL} batches per seed)"):
            pool = [list(itertools.islice(member_batches(c, mesh), POOL)) for c in configs]
            pool_S = [stack([pool[k][i] for k in range(s)]) for i in range(POOL)]
            jax.block_until_ready(pool_S)
        if not progress.spent():
            with progress.phase("compiling the single step (and one step of seed 0)"):
                copy = jax.tree.map(jnp.copy, state)  # the step donates its state
                jax.block_until_ready(built["step"](copy, pool[0][0], other, key))
        if not progress.spent():
            with progress.phase(f"compiling the ensemble step (and one step of {s} seeds)"):
                state_S, other_S, key_S = ensemble_state(built)
                jax.block_until_ready(built["ensemble_step"](state_S, pool_S[0], other_S, key_S))
        pool_KS = []
        if steps_per_call and not progress.spent():
            k = steps_per_call
            with progress.phase(f"compiling the ensemble step {k} steps a call (and one call)"):
                built["steps_per_call"] = k
                built["scanned_step"] = make_scanned_step(built["setup"], k)
                pool_KS = [stack([pool_S[(i + j) % POOL] for j in range(k)]) for i in range(POOL)]
                state_S, other_S, key_S = ensemble_state(built)
                jax.block_until_ready(built["scanned_step"](state_S, pool_KS[0], other_S, key_S))
        make = None
        if not progress.spent():
            with progress.phase("compiling the device input (and one stacked batch)"):
                make = make_device_input(configs, mesh)
                jax.block_until_ready(next(device_batches(configs, mesh, make=make)))

        single_pool = functools.partial(time_single, built, lambda k, i: pool[k][i % POOL])
        ensemble_pool = functools.partial(time_ensemble, built, lambda i: pool_S[i % POOL])
        plan: list[tuple[str, Callable[[str], Timing]]] = [
            ("single (seeds in turn)", lambda name: single_pool(steps, warmup, progress, name)),
            ("ensemble (vmapped)", lambda name: ensemble_pool(steps, warmup, progress, name)),
        ]
        if pool_KS:
            k = steps_per_call
            calls, warmup_calls = max(1, steps // k), max(1, -(-warmup // k))
            plan.append(
                (
                    scanned_row(k),
                    lambda name: time_ensemble(
                        built,
                        lambda i: pool_KS[i % POOL],
                        calls,
                        warmup_calls,
                        progress,
                        name,
                        scanned=True,
                    ),
                )
            )
        if stream:
            singles = [member_batches(c, mesh) for c in configs]
            stacked = ensemble_batches(configs, mesh)
            device = device_batches(configs, mesh, make=make)
            plan += [
                (
                    "single, single-run input",
                    lambda name: time_single(
                        built, lambda k, i: next(singles[k]), steps, warmup, progress, name
                    ),
                ),
                (
                    "ensemble, single-run inputs stacked",
                    lambda name: time_ensemble(
                        built, lambda i: next(stacked), steps, warmup, progress, name
                    ),
                ),
                (
                    "ensemble, device input",
                    lambda name: time_ensemble(
                        built, lambda i: next(device), steps, warmup, progress, name
                    ),
                ),
            ]
        plan += [
            (
                "single-run inputs alone (batches/s)",
                lambda name: time_input(ensemble_batches(configs, mesh), n_input, progress, name),
            ),
            (
                "device input alone (batches/s)",
                lambda name: time_input(
                    device_batches(configs, mesh, make=make), n_input, progress, name
                ),
            ),
        ]
        for index, (name, run) in enumerate(plan):
            if progress.spent():
                skipped.extend(row for row, _ in plan[index:])
                progress.say(f"budget spent: skipping {', '.join(skipped)}")
                progress.write()
                break
            progress.start_row(len(plan) - index)
            with progress.phase(f"timing {name}"):
                timing = run(name)
                if timing.rate is None:
                    skipped.append(name)
                else:
                    scanned = steps_per_call and name == scanned_row(steps_per_call)
                    per_call = steps_per_call if scanned else 1
                    rows[name], steps_timed[name] = timing.rate, timing.steps * per_call
                    unit = "batches" if "batches" in name else "steps"
                    progress.say(f"{name}: {timing.rate:.1f} /s over {timing.steps} {unit}")
    return rows


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="recipe.py:argument (input=memory)")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated run seeds")
    parser.add_argument("--steps", type=int, default=300, help="timed steps")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps after compiling")
    parser.add_argument("--stream", action="store_true", help="also time with streamed input")
    parser.add_argument(
        "--steps-per-call",
        type=int,
        default=0,
        help="K > 0: also time the ensemble K steps a call (lax.scan); 0: not",
    )
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds after which timing stops and what was measured is written (default: none)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.steps_per_call < 0:
        parser.error(
            f"--steps={args.steps} must be >= 1, --warmup={args.warmup} >= 0 and "
            f"--steps-per-call={args.steps_per_call} >= 0"
        )
    seeds = [int(s) for s in args.seeds.split(",")]
    result = {"config": args.config, "seeds": seeds, "steps": args.steps, "device": None}
    result.update(rows={}, warmup=args.warmup, stream=args.stream, budget=args.budget)
    result["complete"] = False
    progress = Progress(args.budget, args.out, result=result)
    budget = f"budget {args.budget:g} s" if args.budget is not None else "no budget"
    progress.say(f"{args.config}  S={len(seeds)}  {args.steps} steps  {budget}")
    with progress.phase("starting the backend"):
        result["device"] = device = jax.devices()[0].device_kind
    config = load_config(args.config)
    k = args.steps_per_call
    result["steps_per_call"] = k
    rows = probe(config, seeds, args.steps, args.warmup, args.stream, progress, k)
    planned = {name: result["input_batches"] if "batches" in name else args.steps for name in rows}
    if k and scanned_row(k) in planned:  # whole calls of k steps
        planned[scanned_row(k)] = max(1, args.steps // k) * k
    result["complete"] = not result["skipped"] and result["steps_timed"] == planned
    result["seconds"] = round(time.perf_counter() - progress.start, 3)
    single = rows.get("single (seeds in turn)")
    print(f"{args.config}  S={len(seeds)}  {args.steps} steps  on {device}")
    for name, value in rows.items():
        ratio = f"{value / single:5.2f}x" if "batches" not in name and single else ""
        short = f"  ({result['steps_timed'][name]} of {planned[name]})" * (
            result["steps_timed"][name] < planned[name]
        )
        print(f"  {name:34s} {value:10.1f} /s  {ratio}{short}")
    for name in result["skipped"]:
        print(f"  {name:34s}    skipped (budget spent)")
    sys.stdout.flush()
    progress.write()
    progress.say(f"done ({'complete' if result['complete'] else 'partial'})")
    return result


if __name__ == "__main__":
    main()
