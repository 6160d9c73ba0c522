"""Stage 3, ``compile``: the real train step of every case, lowered and compiled.

The step of every case (``step_cases``: encoder, attention backend, LieRE 8x8's variants) is
lowered one after the other and compiled in the queue's threads until the stage's deadline;
each encoder's initial state is built beside them (``timed_init``), for the steps stage
(``steps.py``) and the later stages, which reuse ``lower_case`` and ``_compile``.
"""

from __future__ import annotations

import concurrent.futures
import time

from experiments.device.queue import Queue
from experiments.device.recipes import ENCODERS, run_config
from experiments.device.results import empty_row
from experiments.device.variants import (
    ENCODER_VARIANTS,
    liere_variants,
    other_variant,
    queued,
    variant,
)

# Attention backends in the order they are compiled and timed ("pallas" runs on TPUs only).
ATTENTIONS = ("cudnn", "pallas", "xla", "chunked")


def lower_case(q: Queue, encoder: str, attention: str, batch: int) -> dict:
    """Lower one train step: its config, setup, lowered program and init (not yet run)."""
    import jax
    from flax import nnx

    from experiments.benchmarks import device as bench
    from rope_lie import sharding, train

    config = run_config(q.recipes, encoder, attention, q.shapes["overrides"])
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    model = nnx.eval_shape(lambda: train.build_model(config.model, jax.random.key(0)))
    setup, abstract_state, _, _ = train.create_setup_and_state(
        config, mesh, 1000, abstract_model=model
    )
    args = bench.abstract_step_args(config, setup, abstract_state, batch)
    began = time.monotonic()
    lowered = train.make_train_step(setup).lower(*args)
    return {
        "config": config,
        "mesh": mesh,
        "init": host_init(config, model, setup),
        "lowered": lowered,
        "lower_s": time.monotonic() - began,
    }


def host_init(config, model, setup):
    """``init(key) -> (state, other)`` of a step: built by the host's CPU, then put on the
    step's devices with the step's shardings (``model``: the abstract model, or None).

    On an H200, with each ViT-B initialisation compiled for the GPU, every timed row after the
    first waited about 37 s, one after another, as if for its encoder's initialisation (the
    JSON's ``inits`` and the rows' ``init_wait_s`` now say). Compiled for the CPU at
    optimisation level 0 (``train._run_once``), a ViT-B initialisation took 9.7 s on this
    project's 2-core CPU beside a training run (5.4 s compiling, 3.7 s running). Its values
    may differ from a GPU initialisation's in the last bits (the same random bits through the
    CPU's float transforms); a step's time does not depend on them."""
    import jax
    from flax import nnx

    from rope_lie import sharding, train

    if model is None:
        model = nnx.eval_shape(lambda: train.build_model(config.model, jax.random.key(0)))
    cpu_mesh = sharding.make_mesh(config.mesh, jax.devices("cpu")[:1])
    _, _, init_on_cpu, _ = train.create_setup_and_state(
        config, cpu_mesh, 1000, abstract_model=model
    )
    shardings = (setup.state_shardings, setup.other_sharding)
    cpu = jax.devices("cpu")[0]
    return lambda key: jax.device_put(init_on_cpu(jax.device_put(key, cpu)), shardings)


def _compile(case: dict) -> dict:
    began = time.monotonic()
    case["compiled"] = case["lowered"].compile()
    case["compile_s"] = time.monotonic() - began
    case["memory"] = memory_bytes(case["compiled"])
    return case


def memory_bytes(compiled) -> dict | None:
    """XLA's buffer sizes of a compiled program and its peak: arguments + outputs - aliased
    (donated) + temporaries."""
    try:
        m = compiled.memory_analysis()
    except Exception:
        return None
    if m is None:
        return None
    sizes = {
        k: int(getattr(m, f"{k}_size_in_bytes"))
        for k in ("argument", "output", "alias", "temp", "generated_code")
    }
    sizes["peak"] = sizes["argument"] + sizes["output"] - sizes["alias"] + sizes["temp"]
    return sizes


# The encoders of issue 47's goal figures (LieRE 8x8 and RoPE-Mixed, RoPE-Mixed and NoPE), first
# in ``ENCODERS``; timed again at the end of the steps stage (``repeat_goal_steps``).
GOAL_ENCODERS = ("rope_mixed", "liere", "nope")
# How long the compile stage waits past its deadline for the compiles already running, as a
# share of the budget (the steps stage's own deadline is not moved).
DRAIN_SHARE = 0.04
# Compiled first, before LieRE 8x8's variants: the goal's encoders and dense LieRE (whose ratio
# to RoPE-Mixed is the goal's third figure).
LEAD_ENCODERS = (*GOAL_ENCODERS, "liere_dense")


def step_cases(q: Queue, platform: str) -> list[tuple[str, str, str | None]]:
    """(encoder, attention, variant) of stage 3, in the order they are compiled and timed:
    every encoder on the first backend, then the next, ``LEAD_ENCODERS`` first; on the first
    backend LieRE 8x8's variants (``liere_variants``) come right after ``LEAD_ENCODERS``,
    before the rest, so that a compile stage cut short by its deadline still times them; each
    encoder's own variants (``ENCODER_VARIANTS``) right after its row on the first backend;
    LieRE 8x8 with the other block product after the second backend's rows ("xla" on a GPU;
    on the first, the block products are among LieRE 8x8's variants). Variants measured slower
    on this platform are left out (``variants.MEASURED_SLOWER``) unless ``--every-variant``."""
    from rope_lie.models.backends import BACKENDS

    every = getattr(q.args, "every_variant", False)
    chosen = [e for e in ENCODERS if not q.args.encoders or e in q.args.encoders.split(",")]
    encoders = [e for e in LEAD_ENCODERS if e in chosen]
    encoders += [e for e in chosen if e not in LEAD_ENCODERS]
    attentions = [
        a
        for a in ATTENTIONS
        if platform in BACKENDS[a].platforms
        and (not q.args.attention or a in q.args.attention.split(","))
    ]
    cases = []
    for i, attention in enumerate(attentions):
        # every encoder on the first backend, a few on the others (each is the same path with
        # another attention function; a ViT-B step compiles in ~40 s on an H100 machine)
        limit = q.shapes.get("other_backend_encoders") if i else None
        # (the others: the first few in ``ENCODERS`` order, ALiBi's bias among them)
        rows = [(e, attention, None) for e in (chosen[:limit] if i else encoders)]
        if i == 0:
            # the lead encoders, LieRE 8x8's variants, the lead encoders' own variants, then
            # every other encoder followed by its own variants
            own = {e: [(e, attention, o) for o in ENCODER_VARIANTS.get(e, ())] for e in encoders}
            lead = [r for r in rows if r[0] in LEAD_ENCODERS]
            rest = [r for r in rows if r[0] not in LEAD_ENCODERS]
            variants = []
            if "liere" in encoders:
                variants = [("liere", attention, v) for v in liere_variants(platform, every)]
            rows = lead + variants + [v for e, _, _ in lead for v in own[e]]
            rows += [row for r in rest for row in [r, *own[r[0]]]]
        cases += rows
        product = other_variant("product", platform)
        wanted = i == 1 and attention in ("cudnn", "xla") and queued(product, platform, every)
        if "liere" in encoders and wanted:
            cases.append(("liere", attention, product))
    return cases


def skipped_attentions(q: Queue, platform: str) -> list[dict]:
    """A row per backend this platform does not run, with the check's message (once)."""
    from rope_lie.models import options
    from rope_lie.models.backends import BACKENDS

    rows = []
    for attention in ATTENTIONS:
        if platform in BACKENDS[attention].platforms:
            continue
        if q.args.attention and attention not in q.args.attention.split(","):
            continue
        config = run_config(q.recipes, "rope_mixed", attention, q.shapes["overrides"])
        try:
            options.check_model_attention(config.model, platform)
            message = f"not run on {platform}"
        except ValueError as e:
            message = str(e)
        rows.append(empty_row("*", attention, q.shapes["batch"], skipped=message))
    return rows


def stage_compile(q: Queue) -> str:
    import jax

    platform = jax.default_backend()
    batch = q.shapes["batch"]
    q.data["rows"] += skipped_attentions(q, platform)
    cases = step_cases(q, platform)
    q.cases = [(e, a, batch, p) for e, a, p in cases]
    # future -> key, in the pool's (first-in-first-out) order; kept for the steps stage, which
    # waits for the compiles still running before it times a step (``steps.wait_for_background``)
    futures = q.compiling

    def lower(key):
        """The case lowered under its variant, or None with the reason in ``q.compiled``."""
        if q.left("compile") <= 0:
            q.compiled[key] = {"skipped": "no time left in the compile stage"}
            return None
        try:
            with variant(key[3]):
                return lower_case(q, key[0], key[1], batch)
        except Exception as e:
            q.compiled[key] = {"error": f"lowering: {type(e).__name__}: {e}"[:2000]}
            return None

    def start_init(encoder, case):
        if encoder not in q.states:  # its own thread: never queued behind a compile
            q.states[encoder] = q.init_pool.submit(timed_init, q, encoder, case["init"])

    # The pool compiles in the order of ``cases``: the lead encoders' default steps (the goal's
    # encoders and their baselines) are lowered and queued first; then every variant is
    # lowered, before any other thread traces (a block product or a layer plan is read when
    # tracing, and switching one clears JAX's caches), and only then are the lead encoders'
    # initial states started; the variants and the rest follow in ``cases`` order.
    keys = q.cases
    n_lead = next(
        (i for i, k in enumerate(keys) if k[3] is not None or k[0] not in LEAD_ENCODERS),
        len(keys),
    )
    lead = []
    for key in keys[:n_lead]:
        if (case := lower(key)) is not None:
            futures[q.pool.submit(_compile, case)] = key
            lead.append((key, case))
    lowered_variants = {key: lower(key) for key in keys if key[3] is not None}
    for key, case in lead:
        start_init(key[0], case)
    for key in keys[n_lead:]:
        case = lowered_variants[key] if key[3] is not None else lower(key)
        if case is None:
            continue
        if key[3] is None:
            start_init(key[0], case)
        futures[q.pool.submit(_compile, case)] = key

    # Until the stage's deadline: a ViT-B step took 12-93 s to compile on an H100 machine (four
    # at once, beside the tests), so not every case may fit; the steps
    # compiled by then are timed, those not yet started are recorded as skipped, and those
    # already compiling are waited for (and timed) up to ``DRAIN_SHARE`` of the budget: XLA:GPU
    # times candidate kernels on the device while it compiles, which would disturb the steps
    # timed beside it.
    def record(future, key):
        try:
            q.compiled[key] = future.result()
        except Exception as e:
            q.compiled[key] = {"error": f"compile: {type(e).__name__}: {e}"[:2000]}

    try:
        for future in concurrent.futures.as_completed(futures, timeout=max(0.0, q.left("compile"))):
            record(future, futures[future])
    except concurrent.futures.TimeoutError:
        running = []
        for future, key in futures.items():
            if future.done() and key not in q.compiled:
                record(future, key)
            elif not future.done():
                if future.cancel():
                    q.compiled[key] = {"skipped": "no time left in the compile stage"}
                else:
                    running.append(future)
        try:
            drain = DRAIN_SHARE * q.args.budget
            for future in concurrent.futures.as_completed(running, timeout=drain):
                record(future, futures[future])
        except concurrent.futures.TimeoutError:
            for future in running:
                if not future.done():
                    q.compiled[futures[future]] = {"skipped": "still compiling at the deadline"}
    cancel_unused_inits(q)
    ok = sum("compiled" in c for c in q.compiled.values())
    skipped = sum("skipped" in c for c in q.compiled.values())
    failed = len(q.compiled) - ok - skipped
    # What goes on running into the steps stage: compiles past the drain cannot be cancelled
    # (XLA:GPU autotunes on the device), and the initial states the rows will wait for.
    left = {
        "still_compiling": sum(not f.done() for f in futures),
        "inits_not_ready": sum(not f.done() for f in q.states.values()),
    }
    q.data["stages"].setdefault("compile", {}).update(left)
    return (
        f"{ok} of {len(cases)} steps compiled ({failed} failed, {skipped} out of time); at its "
        f"end {left['still_compiling']} still compiling, {left['inits_not_ready']} of "
        f"{len(q.states)} initial states not ready"
    )


def timed_init(q: Queue, encoder: str, init) -> tuple:
    """``init(key 0)``, its arrays ready, with when it started and its seconds recorded under
    the JSON's ``"inits"``: a ViT-B initialisation is its own program (``host_init``: compiled
    for the CPU on first call, then put on the device), and the rows wait for it
    (``init_wait_s``)."""
    import jax

    started_s = q.elapsed()
    out, seconds = waited(init, jax.random.key(0))
    q.data.setdefault("inits", {})[encoder] = {
        "started_s": round(started_s, 1),
        "seconds": round(seconds, 1),
        "built_on": "cpu",
    }
    return out


def waited(fn, *args) -> tuple:
    """``fn(*args)`` and the seconds until its arrays are ready: jax dispatches asynchronously,
    so without the wait a copy's or a transfer's time would fall into the next part's."""
    import jax

    began = time.monotonic()
    out = fn(*args)
    jax.block_until_ready(out)
    return out, time.monotonic() - began


def cancel_unused_inits(q: Queue) -> None:
    """Drop the initial states not yet started of the encoders with no compiled step: no stage
    times those, and an init left to run would share the device and the CPU with the steps
    timed beside it."""
    used = {key[0] for key, case in q.compiled.items() if "compiled" in case}
    for encoder in [e for e in q.states if e not in used]:
        if q.states[encoder].cancel():
            del q.states[encoder]
