"""The device queue (experiments/device/): its dry run on CPU, with TensorFlow, TFDS and
ml_collections blocked as on the device image, writes every stage's results in the schema the
GPU run will; its recipes are configs/imagenet.py's; its parsers read what pytest and XLA
write."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from experiments import device

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW_KEYS = {"encoder", "attention", "batch", "step_ms", "images_per_s", "mfu"}

# Runs the queue as ``python -m experiments.device`` would, with the modules the device image
# lacks made unimportable.
_BLOCKED_RUN = textwrap.dedent(
    """
    import importlib.abc, runpy, sys
    BLOCKED = {"tensorflow", "tensorflow_datasets", "ml_collections"}
    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"{name} is blocked (not on the device image)")
    sys.meta_path.insert(0, Blocker())
    sys.argv = ["experiments.device", *sys.argv[1:]]
    runpy.run_module("experiments.device", run_name="__main__", alter_sys=True)
    assert not BLOCKED & set(sys.modules), BLOCKED & set(sys.modules)
    """
)


def _run_queue(out_dir, *args: str, timeout: int = 1200) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED_RUN, "--out", str(out_dir), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = [p for p in os.listdir(out_dir) if p.endswith(".json")]
    assert os.path.exists(os.path.join(out_dir, path[: -len(".json")] + ".md"))
    with open(os.path.join(out_dir, path)) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    # A budget no stage reaches: what the dry run checks are the stages' paths, so a loaded
    # machine must not cut them short (the deadlines have their own test, a zero budget).
    return _run_queue(
        tmp_path_factory.mktemp("device_queue"), "--dry-run", "--budget", "3000", timeout=3000
    )


def test_recipes_are_configs_imagenet():
    assert device.read_recipes() == device.recipes_from_configs(), (
        "experiments/device_recipes.json is out of date: python -m experiments.device "
        "--write-recipes"
    )


def test_dry_run_top_level(dry_run):
    assert dry_run["device"] == "cpu" and dry_run["platform"] == "cpu"
    assert dry_run["jax"] == dry_run["versions"]["jax"]
    assert dry_run["dry_run"] is True
    assert all(ok == "ok" for ok in dry_run["jax_apis"].values()), dry_run["jax_apis"]
    stages = dry_run["stages"]
    assert list(stages) == list(device.STAGES)
    assert {name: s["status"] for name, s in stages.items()} == dict.fromkeys(device.STAGES, "ok")


def test_dry_run_times_every_encoder_on_every_cpu_backend(dry_run):
    rows = dry_run["rows"]
    assert all(ROW_KEYS <= set(r) for r in rows)
    timed = {
        (r["encoder"], r["attention"])
        for r in rows
        if r.get("case") == "fixed_batch" and r["step_ms"] is not None
    }
    first_two = list(device.ENCODERS)[: device.DRY["other_backend_encoders"]]
    assert timed == {(e, "xla") for e in device.ENCODERS} | {(e, "chunked") for e in first_two}
    for r in rows:
        if r["step_ms"] is not None:
            assert r["step_ms"] > 0 and r["images_per_s"] == pytest.approx(
                r["batch"] / r["step_ms"] * 1e3
            )
            assert r["mfu"] is None  # no peak is known for a CPU
    # cuDNN and Pallas are refused on CPU by the platform check, with its message.
    refused = {r["attention"]: r["skipped"] for r in rows if r["encoder"] == "*"}
    assert set(refused) == {"cudnn", "pallas"}
    assert all("needs platform" in message for message in refused.values())


def test_dry_run_times_the_goal_encoders_again_in_reverse_order(dry_run):
    rows = dry_run["rows"]
    first = [
        r["encoder"]
        for r in rows
        if r.get("case") == "fixed_batch"
        and r["encoder"] in device.GOAL_ENCODERS
        and r.get("platform_default", True)
        and r["attention"] == "xla"
    ]
    repeat = [r for r in rows if r.get("case") == "repeat"]
    assert [r["encoder"] for r in repeat] == first[::-1]
    assert all(r["attention"] == "xla" and r["step_ms"] > 0 for r in repeat)
    # From the same initial state on the same batch as the first pass: the same loss.
    loss = {
        r["encoder"]: r["loss"]
        for r in rows
        if r.get("case") == "fixed_batch"
        and r.get("platform_default", True)
        and r["attention"] == "xla"
    }
    for r in repeat:
        assert r["loss"] == pytest.approx(loss[r["encoder"]], rel=1e-6), r
    goal = dry_run["goal"]
    for name in ("liere / rope_mixed", "rope_mixed / nope"):
        (once,) = [v for k, v in goal.items() if k.startswith(name) and "repeat" not in k]
        (again,) = [
            v for k, v in goal.items() if k.startswith(name) and k.endswith("(repeat pass)")
        ]
        assert once > 0 and again > 0


def test_dry_run_times_every_row_from_its_encoder_s_initial_state(dry_run):
    # LieRE 8x8's defaults and each variant on "xla", one after another: the same state and
    # batch, so the same loss to float32 rounding. A variant timed on the state the rows before
    # it trained (an H100 run: losses 5.59 down to 2.47) would differ, and LieRE's
    # squaring loop follows its generators' norms.
    rows = [
        r
        for r in dry_run["rows"]
        if r["encoder"] == "liere" and r.get("case") == "fixed_batch" and r["attention"] == "xla"
    ]
    assert len(rows) == 10, rows  # the defaults, seven variants, the two other block products
    losses = [r["loss"] for r in rows]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0]), losses
    assert all(r["seconds"] >= 0 for r in rows)  # each row's wall time, for the next budget


def test_dry_run_rows_say_where_their_time_went(dry_run):
    # On an H200 the rows after the first took 37 s each for steps of 22-67 ms, and nothing
    # said which wait it was.
    timed = [r for r in dry_run["rows"] if r["step_ms"] is not None]
    assert timed
    for r in timed:
        parts = (r["init_wait_s"], r["batch_s"], r["background_wait_s"], r["timed_s"])
        assert min(parts) >= 0 and r["timed_s"] > 0, r
        # timed alone: no other encoder's initialisation and no compile beside it
        assert r["concurrent"] == [], r
        # the parts are the row's wall time, but for its bookkeeping and their roundings
        assert r["seconds"] - 0.5 <= sum(parts) <= r["seconds"] + 0.1, r
        # the same step's training throughput: dispatched back to back, waited for once
        assert r["step_ms_pipelined"] > 0 and r["mfu_pipelined"] is None, r  # no CPU peak
    compile_stage = dry_run["stages"]["compile"]
    assert compile_stage["still_compiling"] == 0  # the budget leaves time for every compile
    assert 0 <= compile_stage["inits_not_ready"] <= len(device.ENCODERS)
    assert "initial states not ready" in compile_stage["note"]
    # each timed encoder's initialisation, when it started and how long it took
    inits = dry_run["inits"]
    assert {r["encoder"] for r in timed} <= set(inits)
    assert all(i["seconds"] > 0 and i["started_s"] >= 0 for i in inits.values()), inits


_HOST_INIT = textwrap.dedent(
    """
    import jax, numpy as np
    from flax import nnx
    from experiments.device import compile_stage, recipes, run
    from rope_lie import sharding, train

    config = recipes.run_config(
        recipes.read_recipes(recipes.RECIPES), "liere", "xla", run.DRY["overrides"]
    )
    step_devices = jax.devices()[1:]  # not the device the CPU initialisation runs on (cpu:0)
    mesh = sharding.make_mesh(config.mesh, step_devices)
    model = nnx.eval_shape(lambda: train.build_model(config.model, jax.random.key(0)))
    setup, _, init, _ = train.create_setup_and_state(config, mesh, 1000, abstract_model=model)
    put = compile_stage.host_init(config, model, setup)(jax.random.key(0))
    direct = init(jax.random.key(0))
    shardings = (setup.state_shardings, setup.other_sharding)
    for a, b, s in zip(jax.tree.leaves(put), jax.tree.leaves(direct), jax.tree.leaves(shardings)):
        assert a.sharding == s == b.sharding, (a.sharding, s)
        assert set(a.devices()) == set(step_devices)
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    print("leaves", len(jax.tree.leaves(put)))
    """
)


def test_host_init_builds_on_the_cpu_and_puts_the_state_on_the_step_s_shardings():
    # The queue builds each encoder's initial state with the CPU (a ViT-B initialisation compiled
    # for a GPU held every timed row up) and puts it where the step's own init would: here the
    # step's mesh is another simulated device, and the state equals that init's.
    from tests import helpers

    proc = subprocess.run(
        [sys.executable, "-c", _HOST_INIT],
        capture_output=True,
        text=True,
        env=helpers.subprocess_env(devices=2),
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert int(proc.stdout.split("leaves")[-1]) > 10, proc.stdout


def test_a_step_is_timed_once_the_background_inits_and_compiles_are_done(monkeypatch):
    # On an H200 each timed row ran beside the next encoder's initialisation: a row now waits
    # for the work left in the background, up to its stage's deadline, and names what is left.
    import threading
    from concurrent.futures import Future
    from types import SimpleNamespace

    import jax.numpy as jnp

    from experiments.benchmarks import device as bench
    from experiments.device import steps

    def done(value):
        future = Future()
        future.set_result(value)
        return future

    later, stuck = Future(), Future()
    running_when_timed = []

    def time_compiled(compiled, state, data, other, key, n, warmup):
        running_when_timed.append([f.done() for f in (later, stuck)])
        ms = dict.fromkeys(("step_ms_min", "step_ms_median", "step_ms_pipelined"), 1.0)
        return ms | {"loss": 1.0}, state

    def random_batch(config, batch, mesh):  # the last thing before the wait: the init ends in it
        if not later.done():
            threading.Timer(0.5, lambda: later.set_result(({"w": jnp.zeros(2)}, None))).start()

    monkeypatch.setattr(bench, "random_batch", random_batch)
    monkeypatch.setattr(bench, "time_compiled", time_compiled)
    left = {"compile": 30.0, "steps": 60.0, "largest_batch": 60.0}
    q = SimpleNamespace(
        args=SimpleNamespace(budget=100.0),
        data={"platform": "cpu", "flops_per_image": 1.0, "peak_tflops": None},
        shapes={"steps": 2, "warmup": 1},
        states={"nope": done(({"w": jnp.ones(2)}, None)), "liere": later},
        compiling={done({}): ("nope", "xla", 8, None)},
        left=lambda stage: left[stage],
    )
    case = {"compiled": None, "config": None, "mesh": None, "compile_s": 1.0, "lower_s": 1.0}
    row = steps.time_case(q, ("nope", "xla", 8, None), case)
    assert running_when_timed == [[True, False]] == [[later.done(), stuck.done()]]
    assert row["concurrent"] == [] and row["background_wait_s"] > 0.3, row
    # a compile past the drain that outlasts the wait (8 % of the budget past the compile
    # stage's deadline, before the stage's own): timed then, and named
    q.compiling[stuck] = ("liere", "cudnn", 8, "squarings=pallas")
    left.update(compile=-7.9)
    began = time.monotonic()
    row = steps.time_case(q, ("nope", "xla", 8, None), case, "largest_batch")
    assert row["concurrent"] == ["compile liere cudnn 8 squarings=pallas"], row
    assert 0.05 < row["background_wait_s"] < time.monotonic() - began < 5, row
    assert "beside compile liere" in steps.row_breakdown(row)


def test_initial_states_of_encoders_with_no_compiled_step_are_dropped():
    # No stage times them, and an init left to run would share the device with timed steps.
    from concurrent.futures import Future
    from types import SimpleNamespace

    from experiments.device import compile_stage

    running = Future()
    assert running.set_running_or_notify_cancel()  # started: it cannot be cancelled
    q = SimpleNamespace(
        compiled={
            ("liere", "xla", 8, None): {"compiled": object()},
            ("liere_dense", "xla", 8, None): {"error": "compile: XlaRuntimeError"},
            ("liere_dense", "xla", 8, "backward=reverse"): {"compiled": object()},
            ("ape", "xla", 8, None): {"skipped": "no time left in the compile stage"},
            ("alibi", "xla", 8, None): {"skipped": "no time left in the compile stage"},
        },
        states={"liere": Future(), "liere_dense": Future(), "ape": Future(), "alibi": running},
    )
    kept = dict(q.states)
    compile_stage.cancel_unused_inits(q)
    assert q.states == {e: kept[e] for e in ("liere", "liere_dense", "alibi")}
    assert kept["ape"].cancelled() and not any(f.cancelled() for f in q.states.values())


def test_dry_run_times_circulant_string_with_the_dft_right_after_its_own_step(dry_run):
    rows = [r for r in dry_run["rows"] if r.get("case") == "fixed_batch"]
    i = next(i for i, r in enumerate(rows) if r["encoder"] == "circulant_string")
    own, dft = rows[i], rows[i + 1]
    assert own.get("variant") is None and own.get("platform_default", True)
    assert dft["encoder"] == "circulant_string" and dft["variant"] == "spectral=dft"
    assert dft["platform_default"] is False and dft["step_ms"] > 0
    # A variant is never an encoder's figure: the goal ratios use the platform's defaults.
    best = device.steps.best_rows(rows, dry_run["shapes"]["batch"])
    assert best["circulant_string"].get("variant") is None


def test_dry_run_times_liere_with_each_of_its_variants(dry_run):
    # each timed variant is set against its defaults in the Markdown, one line each
    timed = [
        r
        for r in dry_run["rows"]
        if r.get("variant") and r.get("case") == "fixed_batch" and r.get("step_ms") is not None
    ]
    section = device.results.variant_lines(dry_run["rows"])
    assert len(timed) >= 9 and len(section) == 5 + len(timed)
    # both ratios given (their values are the CPU's timings beside other work: not checked)
    assert all(re.search(r"\| \d+\.\d{3} \| \d+\.\d{3} \|$", line) for line in section[5:]), section
    variants = {
        (r["attention"], r["block_product"], r["layer_plan"], r["squaring_loop"])
        + (r["small_products"], r["combination_backward"], r["platform_default"])
        for r in dry_run["rows"]
        if r["encoder"] == "liere" and r.get("case") == "fixed_batch"
    }
    assert variants == {
        # the CPU's defaults, every backend
        ("xla", "einsum", "each", "while", "adds", "frechet", True),
        ("chunked", "einsum", "each", "while", "adds", "frechet", True),
        ("xla", "broadcast", "each", "while", "adds", "frechet", False),
        ("xla", "adds", "each", "while", "adds", "frechet", False),
        ("xla", "einsum", "batched", "while", "adds", "frechet", False),
        ("xla", "einsum", "each", "fixed", "adds", "frechet", False),
        ("xla", "einsum", "each", "while", "reduce", "frechet", False),
        ("xla", "einsum", "each", "pallas", "adds", "frechet", False),  # interpret mode on CPU
        ("xla", "einsum", "each", "while", "adds", "reverse", False),
        ("xla", "einsum", "each", "pallas", "adds", "reverse", False),  # device.COMBINED
        ("xla", "adds", "each", "while", "adds", "reverse", False),  # device.COMBINATIONS[1]
    }
    rotations = {(r["blocks"], r["product"]): r for r in dry_run["rotations"]}
    assert set(rotations) == {
        (b, p) for b in ("8x8", "16x16") for p in ("einsum", "broadcast", "adds")
    }
    for r in rotations.values():
        assert r["forward_ms"] > 0 and r["forward_backward_ms"] > 0
        assert r["rel_err"] < 1e-6


def test_dry_run_times_a_step_s_rotations_chained(dry_run):
    from experiments.device.rotations import CHAIN, CHAINED

    rows = {r["encoder"]: r for r in dry_run["chained_rotations"]}
    assert list(rows) == [label for label, _, _ in CHAINED]
    for r in rows.values():
        assert "error" not in r, r
        assert r["chain"] == CHAIN and r["forward_us"] > 0 and r["forward_backward_us"] > 0
        assert r["forward_over_rope_mixed"] == pytest.approx(
            r["forward_us"] / rows["rope_mixed"]["forward_us"]
        )
    assert rows["rope_mixed"]["forward_backward_over_rope_mixed"] == pytest.approx(1.0)


def test_dry_run_times_liere_s_exponentials_alone_with_each_variant(dry_run):
    from experiments.device.rotations import EXPONENTIAL_VARIANTS

    rows = dry_run["exponentials"]
    assert [r["variant"] for r in rows] == list(EXPONENTIAL_VARIANTS)
    assert {(r["squarings"], r["small_products"], r["backward"]) for r in rows} == {
        ("while", "adds", "frechet"),  # the CPU's defaults
        ("while", "adds", "reverse"),
        ("pallas", "adds", "frechet"),
        ("pallas", "adds", "reverse"),  # device.COMBINED
        ("while", "reduce", "frechet"),
        ("fixed", "adds", "frechet"),
    }
    for r in rows:
        assert "error" not in r, r
        assert r["forward_ms"] > 0 and r["forward_backward_ms"] > 0
        assert r["orthogonality_error"] < 1e-4  # rotations, whatever the program


def test_liere_s_exponentials_alone_are_taken_at_the_recipe_s_positions():
    # LieRE's recipe gives "sequential" positions ([0, 1] across the grid): at integer ones
    # the generators' norms, and the squaring loop's trip count, are those of another model.
    import jax
    import numpy as np

    from experiments.device import rotations
    from experiments.device.recipes import read_recipes
    from rope_lie.encodings import liere, positions

    encoders = read_recipes()["encoders"]
    assert encoders["liere"]["model"]["position_convention"] == "sequential"
    assert rotations.liere_positions(8, 64) == "sequential"
    assert (
        rotations.liere_positions(64, 64) == encoders["liere_dense"]["model"]["position_convention"]
    )
    forward, _, params = rotations.exponential_programs(None, 1, 1, 8, (3, 3))
    pos = positions.grid_positions([3, 3], "sequential", num_prefix=1)
    one = jax.tree.map(lambda x: x[0], params)
    want = liere.precompute(one, pos, num_heads=1, head_dim=8, num_prefix=1).r_TNKbb
    np.testing.assert_allclose(np.asarray(forward(params))[0], np.asarray(want), atol=1e-5)


def test_dry_run_largest_batch(dry_run):
    largest = [r for r in dry_run["rows"] if r.get("case") == "largest_batch"]
    assert [r["encoder"] for r in largest] == list(device.ENCODERS)[:2]
    for r in largest:
        assert r["batch"] == 8 and r["candidates"] == [8, 4] and r["step_ms"] > 0


def test_dry_run_profiles_read_the_trace(dry_run):
    assert set(dry_run["profiles"]) == {
        *device.PROFILED,
        "liere (broadcast block product)",
        "liere (adds block product)",
        "liere (batched layer plan)",
        "liere (fixed squaring loop)",
        "liere (reduce small product)",
        "liere (pallas squaring loop)",
        "liere (reverse combination backward)",
        "liere (reverse combination backward, pallas squaring loop)",
        "liere (reverse combination backward, adds block product)",
    }
    # dense LieRE before LieRE 8x8's variants: it has no GPU profile yet
    assert list(dry_run["profiles"])[:3] == ["liere", "rope_mixed", "liere_dense"]
    for encoder in dry_run["profiles"]:
        profile = dry_run["profiles"][encoder]
        assert "error" not in profile, profile
        trace = profile["trace"]
        assert trace["source"].startswith("/host:CPU")
        assert trace["total_ms"] > 0 and len(trace["top_ops"]) > 5
        assert profile["hlo_ops"]["fusion"] > 0 and profile["cost_analysis"]["flops"] > 0
    # LieRE's exponentials are named in its profile, not in RoPE-Mixed's.
    names = {
        p: " ".join(op[1] for op in dry_run["profiles"][p]["trace"]["top_ops"])
        for p in device.PROFILED
    }
    assert "_rotations" in names["liere"] and "_rotations" not in names["rope_mixed"]


def test_dry_run_times_padded_and_packed_naflex_batches(dry_run):
    """Stage 8: the same images padded one a row and packed, both steps timed per encoder."""
    rows = dry_run["packing"]
    assert [(r["encoder"], r["case"]) for r in rows] == [
        (e, c) for e in device.PACKED_ENCODERS for c in ("padded", "packed")
    ]
    for padded, packed in zip(rows[::2], rows[1::2], strict=True):
        assert padded["rows"] == padded["images"] == 8 and packed["rows"] < 8
        assert 0 <= packed["padding_fraction"] < padded["padding_fraction"] < 1
        for r in (padded, packed):
            assert r["step_ms"] > 0 and np.isfinite(r["loss"]), r
        assert packed["time_over_padded"] == pytest.approx(packed["step_ms"] / padded["step_ms"])


def test_dry_run_runs_the_tests_in_subprocesses(dry_run):
    tests = dry_run["tests"]
    assert tests["gpu"]["counts"]["passed"] > 5 and tests["gpu"]["failed"] == []
    assert tests["gpu"]["returncode"] == 0 and not tests["gpu"]["timed_out"]
    # DRY_ENCODER_TESTS: test_block_products.py's lowering cases, one per (platform, block)
    assert tests["encoders_on_cpu"]["counts"] == {"passed": 8}  # and the adds product's


def test_a_spent_budget_skips_every_stage_and_still_writes(tmp_path):
    out = _run_queue(tmp_path, "--dry-run", "--budget", "0", timeout=300)
    assert {s["status"] for s in out["stages"].values()} == {"skipped"}
    assert out["rows"] == []


def test_a_pytest_run_that_collects_nothing_is_an_error_with_its_log(tmp_path):
    # On the H100 image the GPU tests once ended in pytest's exit code 5 (no tests collected),
    # which the stage recorded as "ok" with no log to say why.
    run = device.start_pytest(
        ("tests/test_device_queue.py", "-k", "no_test_has_this_name"),
        {},
        workers=1,
        log_path=str(tmp_path / "log"),
    )
    out = device.finish_pytest(run, deadline=float("inf"))
    assert out["returncode"] == 5
    assert out["error"] == "no tests collected"
    assert "deselected" in out["log_tail"]


# A test file for the stage's pytest runs: one failure, then a test that outlives any deadline.
# The failure's message quotes a -v line, which must not be counted as a result.
_FAILS_THEN_SLEEPS = textwrap.dedent(
    """
    import time

    def test_fails():
        off = 1.5e-3
        assert off < 1e-3, f"tests/other.py::test_quoted PASSED is not a result; off by {off}"

    def test_outlives_the_deadline():
        time.sleep(600)
    """
)


def _wait_for(path, text: str, timeout: float = 120.0) -> None:
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        with open(path) as f:
            if text in f.read():
                return
        time.sleep(0.2)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failure_s_message_is_kept_when_the_deadline_stops_pytest(tmp_path, workers):
    # On the H200 the GPU tests were stopped at the stage's deadline, before pytest's
    # end-of-session tracebacks: two failures were logged without a word of why.
    (tmp_path / "test_cut.py").write_text(_FAILS_THEN_SLEEPS)
    log_path = tmp_path / "log"
    run = device.start_pytest(
        (str(tmp_path / "test_cut.py"),), {}, workers=workers, log_path=str(log_path)
    )
    # Stopped once test_fails is over: without xdist, when the next test starts; with it (a
    # worker each), when the report is in the log.
    _wait_for(log_path, "test_outlives_the_deadline" if workers == 1 else device.FAILURE_PREFIX)
    out = device.finish_pytest(run, deadline=time.monotonic())
    assert out["timed_out"], out
    assert out["counts"] == {"failed": 1}, out
    (failed,) = out["failed"]
    assert failed.endswith("test_cut.py::test_fails"), out
    message = out["failure_messages"][failed]
    assert message.startswith("AssertionError: tests/other.py::test_quoted PASSED"), message
    assert "off by 0.0015" in message, message
    with open(log_path) as f:  # written once, by xdist's controller alone
        assert f.read().count(f"{device.FAILURE_PREFIX}{failed} (call):") == 1
    assert f"- failed: {failed}: AssertionError: " in device.markdown({"tests": {"gpu": out}})


def test_pytest_counts_read_plain_and_xdist_lines_of_a_cut_run():
    log = "\n".join(
        [
            "tests/a.py::test_one PASSED                                  [ 10%]",
            "tests/a.py::test_two[x-1] FAILED                             [ 20%]",
            "[gw0] [ 30%] PASSED tests/b.py::test_three ",
            "[gw1] [ 40%] SKIPPED tests/b.py::test_four ",
            "[gw1] [ 50%] ERROR tests/b.py::test_five ",
            "collecting ... PASSED without a test id is not a result",
        ]
    )
    out = device.pytest_counts(log)
    assert out["counts"] == {"passed": 2, "failed": 1, "skipped": 1, "error": 1}
    assert out["failed"] == ["tests/a.py::test_two[x-1]", "tests/b.py::test_five"]


def test_steps_timed_back_to_back_carry_the_state_of_the_step_before():
    # The back-to-back pass times what a training loop runs: each step on the state the one
    # before returned (the step donates its input), waited for only at the end.
    import jax.numpy as jnp

    from experiments.benchmarks import device as bench

    def step(state, data, other, key):
        return state + 1, {"loss": state}

    timing, state = bench.time_compiled(step, jnp.int32(0), None, None, None, steps=3, warmup=2)
    assert int(state) == 2 + 3 + 3 and timing["loss"] == 7
    assert timing["step_ms_pipelined"] > 0 and timing["step_ms_min"] > 0


def test_batch_candidates_from_batch_64_buffers():
    memory = {"argument": 2 * 2**30, "peak": 10 * 2**30}  # 8 GiB above the arguments at 64
    limit = 80 * 2**30  # fits (0.92 * 80 - 2) / (8 / 64) = 572.8 images: 512 and 256
    assert device.batch_candidates(memory, 64, limit, 4096) == [512, 256]
    # 10 GiB already held (other encoders' states): (73.6 - 10 - 2) / 0.125 = 492.8 images
    assert device.batch_candidates(memory, 64, limit, 4096, 10 * 2**30) == [256, 128]
    assert device.batch_candidates(memory, 64, limit, 256) == [256, 128]
    assert device.batch_candidates(memory, 64, 12 * 2**30, 4096) == []  # 64 is the largest
    assert device.batch_candidates(None, 2, None, 8) == [8, 4]  # no limit known: up to max


def test_pytest_counts_stop_at_the_short_summary_that_repeats_failures():
    log = "\n".join(
        [
            "tests/a.py::test_x PASSED",
            "tests/a.py::test_y FAILED",
            "=========================== short test summary info ============================",
            "FAILED tests/a.py::test_y - ValueError: Operands could not be broadcast together",
        ]
    )
    assert device.pytest_counts(log) == {
        "counts": {"passed": 1, "failed": 1},
        "failed": ["tests/a.py::test_y"],
    }


def test_kernel_op_names_reach_gpu_kernel_names_and_fusions_without_metadata():
    # A GPU trace names a fusion's kernel as its instruction with "." made "_"; the profile of
    # the H100 run found op_names for none of them.
    text = textwrap.dedent(
        """
        %fused_computation.7 (param_0: f32[4]) -> f32[4] {
          %param_0 = f32[4]{0} parameter(0)
          ROOT %sine.3 = f32[4]{0} sine(%param_0), metadata={op_name="jit(step)/blocks.3/sin"}
        }

        ENTRY %main.9 (p0: f32[4]) -> f32[4] {
          %p0 = f32[4]{0} parameter(0)
          %gemm_fusion_dot.360 = f32[4]{0} fusion(%p0), kind=kCustom, calls=%fused_computation.7, metadata={op_name="jit(step)/dot_general"}
          ROOT %loop_sine_fusion = f32[4]{0} fusion(%gemm_fusion_dot.360), kind=kLoop, calls=%fused_computation.7
        }
        """  # noqa: E501
    )
    names = device.kernel_op_names(text)
    assert names["gemm_fusion_dot.360"] == names["gemm_fusion_dot_360"] == "dot_general"
    assert names["loop_sine_fusion"] == "blocks.#/sin"


def test_hlo_op_counts():
    text = textwrap.dedent(
        """
        ENTRY %main {
          %p0 = f32[4]{0} parameter(0)
          %fusion.1 = f32[4]{0} fusion(f32[4]{0} %p0), kind=kLoop, calls=%fused
          ROOT %dot.2 = f32[] dot(f32[4]{0} %fusion.1, f32[4]{0} %p0), lhs_contracting_dims={0}
        }
        """
    )
    assert device.hlo_op_counts(text) == {"parameter": 1, "fusion": 1, "dot": 1}


def test_liere_variants_on_a_gpu_are_what_it_does_not_use_by_default(monkeypatch):
    # What the GPU run compiles beside LieRE 8x8's defaults (the dry run sees the CPU's only).
    assert device.variant_choices(None, "gpu") == {
        "product": "by_size",
        "layers": "batched",
        "squarings": "while",
        "small_products": "adds",
        "spectral": "fft",
        "backward": "frechet",
    }
    others = [device.other_variants(kind, "gpu") for kind in device.VARIANT_KINDS]
    assert others == [
        ["product=einsum", "product=adds"],
        ["layers=each"],
        ["squarings=fixed", "squarings=pallas"],
        ["small_products=reduce"],
        ["spectral=dft"],
        ["backward=reverse"],
    ]
    assert device.other_variants("squarings", "tpu") == ["squarings=fixed"]  # no Mosaic kernel
    every = [
        "backward=reverse",
        "squarings=pallas",
        device.COMBINED,
        "product=adds",
        "backward=reverse,product=adds",  # the H200's profile's pair
        "product=einsum",
        "small_products=reduce",
        "layers=each",
        "squarings=fixed",
    ]
    assert device.liere_variants("gpu", every=True) == every
    # None is measured slower from the same initial state as the defaults yet: all compiled.
    assert device.liere_variants("gpu") == every
    from experiments.device import variants

    assert variants.MEASURED_SLOWER == {"gpu": {}}
    # one measured slower is left out, unless every variant is asked for
    monkeypatch.setitem(variants.MEASURED_SLOWER, "gpu", {"layers=each": "48 ms against 42 ms"})
    assert device.liere_variants("gpu") == [v for v in every if v != "layers=each"]
    assert device.liere_variants("gpu", every=True) == every
    monkeypatch.undo()
    assert device.COMBINATIONS == (device.COMBINED, "backward=reverse,product=adds")
    assert device.liere_variants("cpu") == device.liere_variants("cpu", every=True)
    assert device.variant_choices(device.COMBINED, "gpu") == {
        "product": "by_size",
        "layers": "batched",
        "squarings": "pallas",
        "small_products": "adds",
        "spectral": "fft",
        "backward": "reverse",
    }
    assert device.variant_label(device.COMBINED) == (
        "reverse combination backward, pallas squaring loop"
    )
    assert device.variant_choices("squarings=fixed", "gpu")["squarings"] == "fixed"
    with pytest.raises(ValueError, match="variant 'broadcast': expected '<kind>=<choice>'"):
        device.split_variant("broadcast")


def test_on_a_gpu_liere_s_variants_compile_right_after_the_goal_encoders():
    # The compile stage stops at its deadline: what issue 47's figures need comes first.
    from types import SimpleNamespace

    from experiments.device import compile_stage

    q = SimpleNamespace(
        args=SimpleNamespace(encoders="", attention=""), shapes={"other_backend_encoders": 4}
    )
    cases = compile_stage.step_cases(q, "gpu")
    variants = device.liere_variants("gpu")
    lead = [*compile_stage.GOAL_ENCODERS, "liere_dense"]
    assert cases[:4] == [(e, "cudnn", None) for e in lead]
    assert cases[4 : 4 + len(variants)] == [("liere", "cudnn", v) for v in variants]
    # then the lead encoders' own variants: dense LieRE with the reverse-mode VJP
    assert cases[4 + len(variants)] == ("liere_dense", "cudnn", "backward=reverse")
    assert {e for e, a, v in cases if a == "cudnn" and v is None} == set(device.ENCODERS)
    q.args.every_variant = True
    cases = compile_stage.step_cases(q, "gpu")
    every = device.liere_variants("gpu", True)
    assert cases[4 : 4 + len(every)] == [("liere", "cudnn", v) for v in every]
    assert ("liere", "cudnn", "product=einsum") in cases[4 : 4 + len(every)]
    # the other backend's own block product comes after its rows
    assert cases.index(("liere", "xla", "product=einsum")) > cases.index(("liere", "xla", None))


def _stub_compile_stage(monkeypatch, budget_s: float, lower_s: float = 10.0):
    """A queue for ``compile_stage.stage_compile`` on a "gpu" whose lowering takes ``lower_s``
    seconds of a stubbed clock and whose compile stage has ``budget_s`` of them: the pool
    records what is queued, in its order, and runs it at once."""
    import contextlib
    from concurrent.futures import Future
    from types import SimpleNamespace

    import jax

    from experiments.device import compile_stage

    clock, active, queued = [0.0], [None], []

    @contextlib.contextmanager
    def variant(name):
        active[0] = name
        yield

    def lower_case(q, encoder, attention, batch):
        clock[0] += lower_s
        return {"key": (encoder, attention, batch, active[0]), "init": None}

    def done(value):
        future = Future()
        future.set_result(value)
        return future

    def submit(fn, case, *args):
        if fn is compile_stage._compile:
            queued.append(case["key"])
            return done({"compiled": case["key"]})
        return done(fn(case, *args))

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(compile_stage, "variant", variant)
    monkeypatch.setattr(compile_stage, "lower_case", lower_case)
    monkeypatch.setattr(compile_stage, "timed_init", lambda q, encoder, init: None)
    monkeypatch.setattr(compile_stage, "skipped_attentions", lambda q, platform: [])
    pool = SimpleNamespace(submit=submit)
    q = SimpleNamespace(
        args=SimpleNamespace(encoders="", attention="", budget=100.0),
        shapes={"batch": 64, "other_backend_encoders": 4},
        data={"rows": [], "stages": {}},
        compiled={},
        compiling={},
        states={},
        pool=pool,
        init_pool=pool,
        left=lambda stage: budget_s - clock[0],
    )
    return q, queued


def test_the_compile_stage_queues_its_steps_in_their_order_the_baselines_first(monkeypatch):
    from experiments.device import compile_stage

    q, queued = _stub_compile_stage(monkeypatch, budget_s=1e6)
    compile_stage.stage_compile(q)
    assert queued == q.cases  # the pool's order is the order the steps stage times them


def test_a_compile_stage_cut_short_compiles_the_goal_s_baselines_before_any_variant(monkeypatch):
    # Time for five lowerings: the lead encoders' four steps (the goal's encoders and dense
    # LieRE) and one variant; every other case is skipped, the baselines never.
    from experiments.device import compile_stage

    q, queued = _stub_compile_stage(monkeypatch, budget_s=45.0)
    compile_stage.stage_compile(q)
    lead = [(e, "cudnn", 64, None) for e in compile_stage.LEAD_ENCODERS]
    assert queued[:4] == lead
    assert all("compiled" in q.compiled[k] for k in lead)
    assert [k[3] for k in queued[4:]] == [device.liere_variants("gpu")[0]]
    assert all("skipped" in q.compiled[k] for k in q.cases if k not in queued)
    assert set(q.states) == {k[0] for k in lead}


def test_markdown_sets_each_variant_against_its_encoder_s_defaults():
    # What a default's change would buy, read from one run: the variant's step over its
    # encoder's defaults on the same backend and batch (first pass only), and over RoPE-Mixed.
    from experiments.device.results import variant_lines

    def row(encoder, attention, ms, variant=None, case="fixed_batch", batch=64):
        timed = dict(step_ms=ms, step_ms_median=ms)
        return (
            dict(encoder=encoder, attention=attention, batch=batch, variant=variant, case=case)
            | timed
        )

    rows = [
        row("rope_mixed", "cudnn", 20.0),
        row("liere", "cudnn", 30.0),
        row("liere", "cudnn", 24.0, "backward=reverse"),
        row("liere", "cudnn", 22.0, "backward=reverse", case="repeat"),  # not the first pass
        row("liere", "xla", 40.0, "product=adds"),  # no defaults on "xla" in this run
        row("liere", "cudnn", None, "squarings=pallas"),  # not timed
    ]
    lines = variant_lines(rows)
    table = [line for line in lines if line.startswith("| liere")]
    assert table == [
        "| liere | cudnn | backward=reverse | 24.00 | 30.00 | 0.800 | 1.200 |",
        "| liere | xla | product=adds | 40.00 |  |  |  |",
    ]
    assert variant_lines(rows[:2]) == []  # no variant timed: no section
    assert "## Variants against their encoder's defaults" in device.markdown({"rows": rows})
    # the step table gives the steps timed back to back beside them, with their MFU
    rows[0] |= dict(step_ms_pipelined=17.5, mfu_pipelined=0.3861)
    assert "| rope_mixed | cudnn | 64 | 20.00 / 20.00 |  |  | 17.50, 38.6 % |" in device.markdown(
        {"rows": rows}
    )


def test_collect_copies_a_run_under_its_committed_names(tmp_path):
    # A run's files as the device tool brings them back (read-only), into a folder that already
    # holds that device and date's first run: the copies are run 2, writable, and the JSON and
    # Markdown name the renamed logs.
    from experiments.device import collect

    run, into = tmp_path / "files_at", tmp_path / "device"
    run.mkdir()
    into.mkdir()
    stem = "NVIDIA_H200-2026-11-29"
    data = {"schema": 1, "rows": [], "tests": {"gpu": {"log": f"{stem}-tests-gpu.log"}}}
    (run / f"{stem}.json").write_text(json.dumps(data))
    (run / f"{stem}.md").write_text(f"- gpu: passed 3 (log: {stem}-tests-gpu.log)\n")
    (run / f"{stem}-tests-gpu.log").write_text("gpu log\n")
    (run / f"{stem}-tests-encoders-cpu.log").write_text("cpu log\n")
    (run / "queue.log").write_text("queue\n")
    (run / "other.json").write_text(json.dumps({"rows": {}}))  # not the queue's (no schema)
    for path in run.iterdir():
        path.chmod(0o444)
    (into / f"{stem}-1-full.json").write_text("{}")
    written = collect.collect(str(run), "full", str(into))
    new = f"{stem}-2-full"
    assert sorted(os.path.basename(p) for p in written) == sorted(
        [f"{new}.json", f"{new}.md", f"{new}.log", f"{new}-tests-gpu.log"]
        + [f"{new}-tests-encoders-cpu.log"]
    )
    assert json.loads((into / f"{new}.json").read_text())["tests"]["gpu"]["log"] == (
        f"{new}-tests-gpu.log"
    )
    assert f"(log: {new}-tests-gpu.log)" in (into / f"{new}.md").read_text()
    assert (into / f"{new}.log").read_text() == "queue\n"
    assert all(os.access(p, os.W_OK) for p in written)
    with pytest.raises(ValueError, match="tag='Full run'"):
        collect.collect(str(run), "Full run", str(into))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="found neither"):
        collect.collect(str(tmp_path / "empty"), "full", str(into))
    # The seed-ensemble probe's files, as the studies README's command writes them: numbered
    # with the queue's runs of that device and date.
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "ensemble.json").write_text(json.dumps({"device": "NVIDIA H200", "rows": {}}))
    (probe / "probe.log").write_text("probe\n")
    written = collect.collect(str(probe), into=str(into), date="2026-11-29")
    assert sorted(os.path.basename(p) for p in written) == [
        f"{stem}-3-ensemble-probe.json",
        f"{stem}-3-ensemble-probe.log",
    ]


def test_the_run_s_picture_has_each_encoder_s_best_step_and_liere_s_variants(tmp_path):
    from experiments.device import collect, plot

    def row(encoder, attention, ms, variant=None, case="fixed_batch", batch=64, **choices):
        r = dict(encoder=encoder, attention=attention, batch=batch, step_ms=ms, case=case)
        if encoder.startswith("liere"):
            r |= dict(variant=variant, platform_default=variant is None, **choices)
        return r

    rows = [
        row("nope", "cudnn", 20.0),
        row("nope", "xla", 25.0),  # slower backend: not drawn
        row("rope_mixed", "cudnn", 21.0),
        row("liere", "cudnn", 30.0, squaring_loop="while"),
        row("liere", "cudnn", 27.0, "backward=reverse"),
        row("liere", "xla", 26.0, "product=adds"),  # another backend than the defaults' best
        row("liere", "cudnn", 19.0, case="repeat"),  # the repeat pass
        row("liere", "cudnn", 200.0, batch=1024, case="largest_batch"),
        row("liere", "cudnn", 29.0, squaring_loop="fixed"),  # an unnamed variant, older runs
        row("ape", "cudnn", None),  # not timed
    ]
    rows[-2]["platform_default"] = False
    data = {"schema": 1, "device": "NVIDIA H200", "shapes": {"batch": 64}, "rows": rows}
    assert plot.bars(data) == [
        ("nope (cudnn)", 20.0, False),
        ("rope_mixed (cudnn)", 21.0, False),
        ("liere (cudnn)", 30.0, False),
        ("liere: backward=reverse", 27.0, True),
        ("liere: squaring loop fixed", 29.0, True),
    ]
    assert plot.plot(data, str(tmp_path / "a.png")).endswith("a.png")
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="nothing to draw"):
        plot.plot({"rows": rows[-1:]}, str(tmp_path / "b.png"))
    # collect draws it beside the JSON it copies
    run, into = tmp_path / "files_at", tmp_path / "device"
    run.mkdir()
    into.mkdir()
    (run / "NVIDIA_H200-2026-11-29.json").write_text(json.dumps(data))
    written = collect.collect(str(run), "full", str(into))
    assert str(into / "NVIDIA_H200-2026-11-29-1-full.png") in written
