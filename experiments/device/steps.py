"""Stages 3 and 4, ``compile`` and ``steps``: the real train step, compiled and timed.

Stage 3 lowers the step of every case (``step_cases``: encoder, attention backend, LieRE 8x8's
variants) one after the other and compiles them in the queue's threads until its deadline;
stage 4 times each compiled step (``time_case``) into the rows of the step table and updates
issue 47's goal figures (``goal_figures``). The later stages reuse ``lower_case``, ``_compile``,
``time_case`` and ``best_rows``.
"""

from __future__ import annotations

import concurrent.futures
import time

from experiments.device.queue import Queue
from experiments.device.recipes import ENCODERS, run_config
from experiments.device.results import _fmt
from experiments.device.tests_stage import wait_for_encoder_tests
from experiments.device.variants import (
    ENCODER_VARIANTS,
    liere_variants,
    other_variant,
    queued,
    variant,
    variant_choices,
)

# Attention backends in the order they are compiled and timed ("pallas" runs on TPUs only).
ATTENTIONS = ("cudnn", "pallas", "xla", "chunked")


def lower_case(q: Queue, encoder: str, attention: str, batch: int) -> dict:
    """Lower one train step: its config, setup, lowered program and init (not yet run)."""
    import jax

    from experiments.benchmarks import device as bench
    from rope_lie import sharding, train

    config = run_config(q.recipes, encoder, attention, q.shapes["overrides"])
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    setup, abstract_state, init, _ = train.create_setup_and_state(config, mesh, 1000)
    args = bench.abstract_step_args(config, setup, abstract_state, batch)
    began = time.monotonic()
    lowered = train.make_train_step(setup).lower(*args)
    return {
        "config": config,
        "mesh": mesh,
        "init": init,
        "lowered": lowered,
        "lower_s": time.monotonic() - began,
    }


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
    LieRE 8x8 with the other block product after each backend's rows. Variants measured slower
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
        wanted = attention in ("cudnn", "xla") and queued(product, platform, every)
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
    lowered: list[tuple[tuple, dict]] = []
    # The variants first, before any other thread traces (a block product and a layer plan are
    # read when tracing, and switching them clears JAX's caches).
    for encoder, attention, name in [c for c in cases if c[2] is not None]:
        key = (encoder, attention, batch, name)
        try:
            with variant(name):
                lowered.append((key, lower_case(q, encoder, attention, batch)))
        except Exception as e:
            q.compiled[key] = {"error": f"lowering: {type(e).__name__}: {e}"[:2000]}
    futures = {}
    for key, case in lowered:
        futures[q.pool.submit(_compile, case)] = key
    for encoder, attention, name in cases:
        if name is not None:
            continue
        key = (encoder, attention, batch, None)
        if q.left("compile") <= 0:
            q.compiled[key] = {"skipped": "no time left in the compile stage"}
            continue
        try:
            case = lower_case(q, encoder, attention, batch)
        except Exception as e:
            q.compiled[key] = {"error": f"lowering: {type(e).__name__}: {e}"[:2000]}
            continue
        if encoder not in q.states:  # its own thread: never queued behind a compile
            q.states[encoder] = q.init_pool.submit(timed_init, q, encoder, case["init"])
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
    the JSON's ``"inits"``: a ViT-B initialisation is its own program, compiled on first call,
    and the rows wait for it (``init_wait_s``)."""
    import jax

    began = time.monotonic()
    started_s = q.elapsed()
    out = jax.block_until_ready(init(jax.random.key(0)))
    q.data.setdefault("inits", {})[encoder] = {
        "started_s": round(started_s, 1),
        "seconds": round(time.monotonic() - began, 1),
    }
    return out


def cancel_unused_inits(q: Queue) -> None:
    """Drop the initial states not yet started of the encoders with no compiled step: no stage
    times those, and an init left to run would share the device and the CPU with the steps
    timed beside it."""
    used = {key[0] for key, case in q.compiled.items() if "compiled" in case}
    for encoder in [e for e in q.states if e not in used]:
        if q.states[encoder].cancel():
            del q.states[encoder]


def flops_per_image(q: Queue) -> float:
    from experiments.benchmarks import flops

    config = run_config(q.recipes, "nope", "xla", q.shapes["overrides"])
    return flops.matmul_train_flops(config.model.to_dict(), 1)


def empty_row(encoder: str, attention: str, batch: int, **note) -> dict:
    """A row of the step table with nothing timed, and why (``skipped=`` or ``error=``)."""
    timed = dict(step_ms=None, images_per_s=None, mfu=None)
    return dict(encoder=encoder, attention=attention, batch=batch, **timed, **note)


def time_case(q: Queue, key: tuple, case: dict) -> dict:
    """Time one compiled step from a copy of its encoder's initial state; its row.

    Every row starts from the same state: a variant timed on a state trained by the rows
    before it could run LieRE's squaring loop another number of times (its trip count follows
    the generators' norms), and a step that fails after its input was donated leaves the
    initial state whole for the next."""
    import jax

    from experiments.benchmarks import device as bench

    began = time.monotonic()
    encoder, attention, batch, name = key
    row = empty_row(encoder, attention, batch, case="fixed_batch")
    if encoder.startswith("liere"):
        platform = q.data["platform"]
        choices = variant_choices(name, platform)
        row["block_product"] = choices["product"]
        row["layer_plan"] = choices["layers"]
        row["squaring_loop"] = choices["squarings"]
        row["small_products"] = choices["small_products"]
        row["combination_backward"] = choices["backward"]
        row["platform_default"] = name is None
    elif name is not None:
        row["variant"] = name
        row["platform_default"] = False
    if "error" in case or "skipped" in case:
        return row | {k: case[k] for k in ("error", "skipped") if k in case}
    (state, other), init_wait_s = waited(initial_state, q, encoder)
    data, batch_s = waited(bench.random_batch, case["config"], batch, case["mesh"])
    timed = time.monotonic()
    try:
        timing, state = bench.time_compiled(
            case["compiled"],
            state,
            data,
            other,
            jax.random.key(1),
            q.shapes["steps"],
            warmup=q.shapes["warmup"],
        )
    finally:
        del data, state
    timed_s = time.monotonic() - timed
    seconds = timing["step_ms_min"] / 1e3
    peak = (q.data.get("peak_tflops") or 0) * 1e12
    model_flops = q.data["flops_per_image"] * batch
    return row | dict(
        step_ms=timing["step_ms_min"],
        step_ms_median=timing["step_ms_median"],
        images_per_s=batch / seconds,
        mfu=model_flops / seconds / peak if peak else None,
        loss=timing["loss"],
        compile_s=round(case["compile_s"], 1),
        lower_s=round(case["lower_s"], 1),
        memory=case.get("memory"),
        seconds=round(time.monotonic() - began, 1),  # the row's wall time, waits included
        # where it went: the initial state (waited for, and copied), the batch, the steps
        init_wait_s=round(init_wait_s, 3),
        batch_s=round(batch_s, 3),
        timed_s=round(timed_s, 3),
    )


def waited(fn, *args) -> tuple:
    """``fn(*args)`` and the seconds until its arrays are ready: jax dispatches asynchronously,
    so without the wait a copy's or a transfer's time would fall into the next part's."""
    import jax

    began = time.monotonic()
    out = fn(*args)
    jax.block_until_ready(out)
    return out, time.monotonic() - began


def initial_state(q: Queue, encoder: str) -> tuple:
    """A copy of ``encoder``'s initial train state (the steps donate theirs), and the rest."""
    import jax

    state, other = q.states[encoder].result()
    return jax.tree.map(lambda x: x.copy(), state), other


def stage_steps(q: Queue) -> str:
    wait_for_encoder_tests(q)
    q.data["flops_per_image"] = flops_per_image(q)
    timed = 0
    for key in q.cases:
        case = q.compiled.get(key, {"skipped": "not compiled"})
        if q.left("steps") <= 0:
            q.data["rows"].append(
                empty_row(key[0], key[1], key[2], skipped="no time left in the steps stage")
            )
            continue
        try:
            row = time_case(q, key, case)
        except Exception as e:
            row = empty_row(key[0], key[1], key[2], error=f"{type(e).__name__}: {e}"[:2000])
        q.data["rows"].append(row)
        timed += row.get("step_ms") is not None
        q.data["goal"] = goal_figures(q.data["rows"], q.shapes["batch"])
        q.results.save()
        print(
            f"  [{q.elapsed():.0f} s] {key}: {_fmt(row.get('step_ms'), '.2f')} ms in "
            f"{row.get('seconds', '')} s{row_breakdown(row)} {row.get('error', '')[:200]}",
            flush=True,
        )
    repeated = repeat_goal_steps(q)
    return f"{timed} steps timed" + (f", {repeated} timed again" if repeated else "")


def row_breakdown(row: dict) -> str:
    """Where a timed row's wall time went, for the progress line ("" for a row not timed)."""
    if row.get("timed_s") is None:
        return ""
    return f" (init {row['init_wait_s']}, batch {row['batch_s']}, steps {row['timed_s']} s)"


def repeat_goal_steps(q: Queue) -> int:
    """Time the goal encoders' default steps on the first backend again, in the reverse of their
    first order (a drift of the device's clocks over the stage then moves the two passes' ratios
    opposite ways): rows with ``case`` "repeat". RoPE-Mixed / NoPE was 1.049 against a goal of
    1.05 in one run and RoPE-Mixed's step moved 5 % between two runs on the same kind of card,
    so one pass does not resolve a ratio that close. Each is timed from its initial state, as
    every row is (``time_case``)."""
    if not q.cases:
        return 0
    first_backend = q.cases[0][1]
    keys = [k for k in q.cases if k[0] in GOAL_ENCODERS and k[1] == first_backend and k[3] is None]
    timed = 0
    for key in reversed(keys):
        case = q.compiled.get(key, {})
        if q.left("steps") <= 0 or "compiled" not in case:
            continue
        try:
            row = time_case(q, key, case) | {"case": "repeat"}
        except Exception as e:
            row = empty_row(*key[:3], case="repeat", error=f"{type(e).__name__}: {e}"[:2000])
        q.data["rows"].append(row)
        timed += row.get("step_ms") is not None
        q.data["goal"] = goal_figures(q.data["rows"], q.shapes["batch"])
        q.results.save()
        step_ms = _fmt(row.get("step_ms"), ".2f")
        print(f"  [{q.elapsed():.0f} s] {key} again: {step_ms} ms{row_breakdown(row)}", flush=True)
    return timed


def best_rows(rows: list[dict], batch: int | None) -> dict[str, dict]:
    """Per encoder, its fastest timed row (the platform's defaults) at ``batch`` (None: any)."""
    best = {}
    for r in rows:
        if r.get("step_ms") is None or r["encoder"] == "*":
            continue
        if batch is not None and r["batch"] != batch:
            continue
        if not r.get("platform_default", True):
            continue
        if r["encoder"] not in best or r["step_ms"] < best[r["encoder"]]["step_ms"]:
            best[r["encoder"]] = r
    return best


# Issue 47's step ratios: (encoder, baseline, goal).
GOAL_RATIOS = (
    ("liere", "rope_mixed", 1.10),
    ("liere_dense", "rope_mixed", 1.5),
    ("rope_mixed", "nope", 1.05),
)


def goal_figures(rows: list[dict], batch: int) -> dict:
    """Issue 47's goal, measured: step ratios of the encoders on their fastest backends, and
    the same ratios from the repeat pass (``repeat_goal_steps``) where it ran."""
    out = {}
    for case, suffix in (("fixed_batch", ""), ("repeat", " (repeat pass)")):
        best = best_rows([r for r in rows if r.get("case") == case], batch)
        for a, b, target in GOAL_RATIOS:
            if a in best and b in best:
                backends = f"{best[a]['attention']} / {best[b]['attention']}"
                key = f"{a} / {b} step ({backends}), goal <= {target}{suffix}"
                out[key] = round(best[a]["step_ms"] / best[b]["step_ms"], 3)
    largest = [r for r in rows if r.get("case") == "largest_batch" and r.get("mfu")]
    if largest:
        top = max(largest, key=lambda r: r["mfu"])
        out["best MFU at the largest batch, goal >= 40 %"] = (
            f"{100 * top['mfu']:.1f} % ({top['encoder']}, {top['attention']}, batch {top['batch']})"
        )
    return out
