"""The device queue: what an accelerator run is for (issue 47), in one command of under 10 minutes.

    python -m experiments.device --out DIR              # on a GPU (or TPU): about 9 minutes
    python -m experiments.device --dry-run --out DIR    # anywhere: every stage at tiny shapes

Writes ``DIR/<device>-<date>.json`` and ``DIR/<device>-<date>.md`` (the same as tables) after
every stage and every timed row, so a run that is cut short keeps what it measured. The stages,
in order, each with a deadline (a share of ``--budget`` seconds from the start: time a stage
leaves unused goes to the ones after it); a stage that fails records its error and the queue
goes on:

1. ``environment``: the device kind and memory, the versions, and whether the jax APIs
   rope_lie uses that have moved or may move between releases import.
2. ``tests``: the GPU tests (``GPU_TESTS``: cuDNN attention against "xla", and LieRE's two block
   products) on the device, through pytest in a subprocess (pass/fail counts, failing test ids);
   meanwhile the encoder tests (``tests/encodings``) run in another subprocess on the device
   machine's CPU with its jax (``JAX_PLATFORMS=cpu``): the current-jax check of issue 47.4.
   Each run's whole log (short tracebacks, each failure's reason) is written beside the JSON,
   ``<stem>-tests-gpu.log`` and ``<stem>-tests-encoders-cpu.log``.
3. ``compile``: the real train step (``rope_lie.train.make_train_step``, AdamW's or Adam's
   update included; ViT-B/16 at 224 px, bfloat16 activations, dropout 0) of the ImageNet
   recipe's model for every encoder (``ENCODERS``; the recipes are read from
   ``experiments/device_recipes.json``) on the platform's first attention backend and for the
   first four encoders on the others, at batch 64: lowered one after the other and compiled by
   ``--compile-threads`` threads at once, each encoder's parameters initialised beside them,
   until the stage's deadline (the steps not compiled by then are recorded as skipped). LieRE
   8x8 is compiled again with what its platform does not use by default (``variant``): on the
   first backend the other form of the exponentials' small products (``expm.SMALL_PRODUCTS``:
   multiply-adds of slices, or one multiply summed), the other layer plan
   (``position_hook.LAYER_PLANS``: one precompute per layer, or one for all) and the other
   squaring loop (``expm.SQUARING_LOOPS``: a loop whose trip count is read from the data, or a
   fixed count first), and the other block product (``lie.BLOCK_PRODUCTS``) on "cudnn" and
   "xla".
4. ``steps``: every compiled step timed, min and median over ``--steps`` steps after 2
   warm-ups: rows ``{encoder, attention, batch, step_ms, images_per_s, mfu, ...}``; ``step_ms``
   is the min.
5. ``rotations``: ``lie.apply_blocks``'s two block products alone at ViT-B/16's shapes (LieRE
   8x8 and dense; forward, and forward plus backward), and each one's error against float64.
6. ``profile``: the LieRE 8x8 (and each of its variants) and RoPE-Mixed steps,
   on their fastest backend, traced by ``jax.profiler``: the top operations by device time per step
   (read from the trace's XSpace with ``jax.profiler.ProfileData``, no TensorBoard plugin),
   beside the compiled program's instruction counts and XLA's cost analysis.
7. ``largest_batch``: for the encoders in ``ENCODERS`` order, on their fastest backend, the
   largest power-of-two batch whose compiled step fits the device's memory (predicted from
   batch 64's buffer sizes, checked by compiling the candidate and its half), timed as in 4.
8. ``packing``: NaFlex train steps (issue 45) of ``PACKED_ENCODERS`` on "xla", on one batch of
   images whose sides are uniform from half the recipe's grid to all of it (7 to 14 patches at
   224 px): padded one image a row to the full grid (``tokens.pack``), and packed greedily
   into rows of that many tokens (``tokens.pack_images``, ``naflex.pack``'s packing), the
   same images; rows ``{encoder, case, rows, padding_fraction, step_ms, time_over_padded}``.

MFU = ``flops.matmul_train_flops`` (the ViT's matrix products by hand: the same count for every
encoder and backend) / step time / the device's dense bfloat16 peak
(``benchmarks/device.py``'s ``PEAK_TFLOPS``, or ``--peak-tflops``).

Needs only what the device image has: jax, flax, optax, orbax-checkpoint, chex and numpy, and
tqdm and absl-py (imported by rope_lie's training modules); pytest, with pytest-xdist if
installed, for stage 2, which records "pytest is not installed" and goes on without it. No
TensorFlow, TFDS or ml_collections (``tests/test_device_queue.py`` runs the dry run with them
blocked); nothing has to be carried in as wheels. ``--write-recipes`` (which needs
ml_collections) regenerates the recipes from ``configs/imagenet.py``.

On a CPU (``--dry-run``, automatic where the platform is "cpu") every stage runs at tiny shapes:
one layer of ViT-pico with 16 px patches on 32 x 32 images, batch 2, one step, batches up to 8,
and a few fast tests in stage 2.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import datetime
import glob
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform as platform_module
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = os.path.join(ROOT, "experiments", "device_recipes.json")
DEFAULT_OUT = os.path.join(ROOT, "experiments", "benchmarks", "device")

# label: the configs/imagenet.py argument; in this order (most wanted first) the stages compile,
# time and search when their time is short.
ENCODERS = {
    "rope_mixed": "pe=rope_mixed",
    "liere": "pe=liere,block=8",  # LieRE 8x8
    "nope": "pe=nope",
    "alibi": "pe=alibi",
    "liere_dense": "pe=liere",  # block_size None: one H x H generator (64 x 64 at ViT-B)
    "rope_axial": "pe=rope_axial",
    "visionllama": "pe=visionllama",
    "cayley_string": "pe=cayley_string",
    "circulant_string": "pe=circulant_string",
    "comrope": "pe=comrope",
    "dinov3": "pe=dinov3",
    "ape": "pe=ape",
}
# Attention backends in the order they are compiled and timed ("pallas" runs on TPUs only).
ATTENTIONS = ("cudnn", "pallas", "xla", "chunked")
# Where each stage must end, as a share of the budget from the start (stage 2's encoder tests
# run in the background until their own deadline, before stage 4 times anything).
DEADLINES = {
    "environment": 0.03,
    "tests": 0.20,
    "encoder_tests": 0.45,
    "compile": 0.55,
    "steps": 0.68,
    "rotations": 0.72,
    "profile": 0.77,
    "largest_batch": 0.87,  # before packing: issue 47's MFU goal is read at the largest batch
    "packing": 0.97,
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
GPU_TESTS = ("tests/models/test_attention_gpu.py", "tests/encodings/test_block_products.py")
ENCODER_TESTS = ("tests/encodings",)
PROFILED = ("liere", "rope_mixed")
PACKED_ENCODERS = ("rope_mixed", "liere")  # stage 7, in this order
# APIs whose place in jax has moved or may move between releases, as rope_lie uses them.
JAX_APIS = (
    "jax.set_mesh",
    "jax.typeof",
    "jax.sharding.reshard",
    "jax.sharding.AxisType",
    "jax.lax.platform_dependent",
    "jax.export.export",
    "jax.nn.dot_product_attention",
    "jax.profiler.ProfileData",
    "jax.experimental.multihost_utils.process_allgather",
    "jax._src.distributed.global_state",
    "jax.experimental.pallas.ops.tpu.flash_attention.flash_attention",
    "jax.experimental.pallas.tpu.force_tpu_interpret_mode",
)
# A batch whose predicted peak memory fits this share of the device's limit is a candidate.
MEMORY_SHARE = 0.92

# The shapes of a run: the real ones on an accelerator, tiny ones for a dry run.
# largest_encoders: how many encoders (in ENCODERS order) stage 8 may search (None: until its
# deadline); rotation_shape: (B, N) of stage 5; packing_batch: images of stage 7's batches.
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
# The dry run checks the stage's path on a CPU, not the tests themselves (the suite runs them):
# the quick ones of the GPU tests' file.
DRY_TESTS = ("tests/encodings/test_block_products.py", "-k", "lowers or bfloat16")
DRY_ENCODER_TESTS = ("tests/encodings/test_block_products.py", "-k", "lowers")


class Config(dict):
    """A recipe read from JSON, with the attribute access and ``to_dict`` that
    ``train.create_setup_and_state`` and ``train.build_model`` use (no ml_collections)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(name) from e

    def to_dict(self) -> dict:
        return {k: v.to_dict() if isinstance(v, Config) else v for k, v in self.items()}


def _from_json(value: Any) -> Any:
    """JSON to what the recipes hold: dicts as ``Config``, lists as tuples."""
    if isinstance(value, dict):
        return Config({k: _from_json(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_from_json(v) for v in value)
    return value


# ---------------------------------------------------------------------------------------------
# Recipes


def recipes_from_configs() -> dict:
    """Every encoder's model and optimiser from configs/imagenet.py (needs ml_collections)."""
    from configs import imagenet

    encoders = {}
    for label, arg in ENCODERS.items():
        config = imagenet.get_config(arg)
        model = config.model.to_dict()
        if label == "liere_dense":
            model["pe_hparams"] = dict(model["pe_hparams"], block_size=None)
        encoders[label] = {"arg": arg, "model": model, "optim": config.optim.to_dict()}
    return {
        "source": "configs/imagenet.py; regenerate with python -m experiments.device "
        "--write-recipes",
        "fsdp_min_size": imagenet.get_config().fsdp_min_size,
        "encoders": json.loads(json.dumps(encoders)),  # tuples as lists, as read back
    }


def read_recipes(path: str = RECIPES) -> dict:
    with open(path) as f:
        return json.load(f)


def run_config(recipes: dict, encoder: str, attention: str, overrides: dict) -> Config:
    """The config of one timed step: the recipe's model with this backend, dropout 0 (the
    timing is of the model, not of dropout's random bits) and ``overrides``, on one device."""
    recipe = recipes["encoders"][encoder]
    model = dict(recipe["model"], attention=attention, dropout=0.0, **overrides)
    return _from_json(
        {
            "model": model,
            "optim": recipe["optim"],
            "fsdp_min_size": recipes["fsdp_min_size"],
            "mesh": {"data": 1, "fsdp": 1},
        }
    )


# ---------------------------------------------------------------------------------------------
# Results


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "device"


class Results:
    """The run's results, written (JSON and Markdown, each replaced atomically) on every
    ``save``."""

    def __init__(self, out_dir: str, device_kind: str, data: dict):
        os.makedirs(out_dir, exist_ok=True)
        stem = f"{_safe_name(device_kind)}-{datetime.date.today().isoformat()}"
        path = os.path.join(out_dir, stem)
        n = 1
        while os.path.exists(f"{path}.json"):
            n += 1
            path = os.path.join(out_dir, f"{stem}-{n}")
        self.json_path, self.md_path = f"{path}.json", f"{path}.md"
        self.stem_path = path  # logs beside them: f"{stem_path}-<name>.log"
        self.data = data
        self.lock = threading.Lock()
        self.save()

    def save(self) -> None:
        with self.lock:
            for path, text in (
                (self.json_path, json.dumps(self.data, indent=1, default=str)),
                (self.md_path, markdown(self.data)),
            ):
                tmp = f"{path}.tmp"
                with open(tmp, "w") as f:
                    f.write(text + "\n")
                os.replace(tmp, path)


def _fmt(value, spec: str = ".1f", missing: str = "") -> str:
    return missing if value is None else format(value, spec)


def markdown(data: dict) -> str:
    """The results as Markdown tables."""
    lines = [
        f"# Device queue: {data.get('device')} (jax {data.get('jax')})",
        "",
        f"{data.get('date')}, `{' '.join(data.get('command', []))}`"
        + (" (dry run: tiny shapes)" if data.get("dry_run") else ""),
        f"peak {data.get('peak_tflops')} TFLOP/s bf16; model FLOPs per image per step "
        f"{_fmt(data.get('flops_per_image'), '.4g')} (matrix products by hand)",
        "",
        "| encoder | attention | batch | step ms (min / median) | images/s | MFU | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in data.get("rows", []):
        note = r.get("error") or r.get("skipped") or ""
        if r.get("block_product"):
            choices = f"block product {r['block_product']}, layers {r.get('layer_plan')}"
            choices += f", squarings {r.get('squaring_loop')}"
            choices += f", small products {r.get('small_products')}"
            note = choices + (f"; {note}" if note else "")
        ms = (
            f"{r['step_ms']:.2f} / {r['step_ms_median']:.2f}"
            if r.get("step_ms") is not None
            else ""
        )
        mfu = "" if r.get("mfu") is None else f"{100 * r['mfu']:.1f} %"
        lines.append(
            f"| {r['encoder']} | {r['attention']} | {r['batch']} | {ms} | "
            f"{_fmt(r.get('images_per_s'), ',.0f')} | {mfu} | {note[:160]} |"
        )
    goal = data.get("goal") or {}
    if goal:
        lines += ["", "## Issue 47's goal figures (each encoder on its fastest backend)", ""]
        lines += [f"- {k}: {v}" for k, v in goal.items()]
    if data.get("rotations"):
        lines += [
            "",
            "## lie.apply_blocks's block products alone",
            "",
            "| blocks | product | forward ms | forward + backward ms | max error / max value vs float64 |",  # noqa: E501
            "|---|---|---|---|---|",
        ]
        for r in data["rotations"]:
            lines.append(
                f"| {r['blocks']} | {r['product']} | {_fmt(r.get('forward_ms'), '.3f')} | "
                f"{_fmt(r.get('forward_backward_ms'), '.3f')} | {_fmt(r.get('rel_err'), '.2e')} |"
                + (f" {r['error'][:120]}" if r.get("error") else "")
            )
    for name, prof in (data.get("profiles") or {}).items():
        lines += ["", f"## Profile: {name}", ""]
        if prof.get("error"):
            lines.append(f"error: {prof['error'][:300]}")
        trace = prof.get("trace") or {}
        if trace.get("top_ops"):
            lines += [
                f"{trace['source']}: {trace['total_ms']:.2f} ms of ops per step",
                "",
                "| ms per step | op | op_name |",
                "|---|---|---|",
            ]
            lines += [f"| {ms:.3f} | {op} | {name_[:100]} |" for op, name_, ms in trace["top_ops"]]
        elif trace:
            lines.append(f"trace: {trace.get('note', '')}")
        if prof.get("hlo_ops"):
            top = sorted(prof["hlo_ops"].items(), key=lambda kv: -kv[1])[:12]
            lines.append("")
            lines.append("compiled HLO instructions: " + ", ".join(f"{k} {v}" for k, v in top))
    if data.get("packing"):
        lines += [
            "",
            "## NaFlex batches: padded against packed (the same images)",
            "",
            "| encoder | case | images | rows x tokens | padding | step ms (min / median) | time / padded |",  # noqa: E501
            "|---|---|---|---|---|---|---|",
        ]
        for r in data["packing"]:
            ms = r.get("error") or r.get("skipped") or ""
            if r.get("step_ms") is not None:
                ms = f"{r['step_ms']:.2f} / {r['step_ms_median']:.2f}"
            lines.append(
                f"| {r['encoder']} | {r['case']} | {r['images']} | {r['rows']} x {r['tokens']} | "
                f"{100 * r['padding_fraction']:.1f} % | {ms[:160]} | "
                f"{_fmt(r.get('time_over_padded'), '.2f')} |"
            )
    tests = data.get("tests") or {}
    if tests:
        lines += ["", "## Tests", ""]
        for name, t in tests.items():
            counts = ", ".join(f"{k} {v}" for k, v in (t.get("counts") or {}).items())
            extra = t.get("error") or t.get("summary") or ""
            if t.get("timed_out"):
                extra += " (stopped at the stage's deadline)"
            log = f" (log: {t['log']})" if t.get("log") else ""
            lines.append(f"- {name}: {counts} {extra}{log}".rstrip())
            lines += [f"  - failed: {f}" for f in t.get("failed", [])[:20]]
    lines += ["", "## Stages", "", "| stage | status | seconds | note |", "|---|---|---|---|"]
    for name, s in (data.get("stages") or {}).items():
        note = (s.get("error") or s.get("note") or "").splitlines()
        lines.append(
            f"| {name} | {s['status']} | {_fmt(s.get('seconds'))} | {(note[-1] if note else '')[:160]} |"  # noqa: E501
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The queue


class Queue:
    """Shared state of one run: the clock, the results and the compiled programs."""

    def __init__(self, args, shapes: dict, results: Results):
        self.args, self.shapes, self.results = args, shapes, results
        self.start = time.monotonic()
        self.recipes = read_recipes(args.recipes)
        self.compiled: dict[tuple, dict] = {}  # (encoder, attention, batch, variant) -> info
        self.cases: list[tuple] = []  # the keys of stage 3, in the order they are timed
        self.states: dict[str, Any] = {}  # encoder -> future of (state, other)
        self.background: dict[str, Any] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(args.compile_threads)

    @property
    def data(self) -> dict:
        return self.results.data

    def deadline(self, stage: str) -> float:
        return self.start + DEADLINES[stage] * self.args.budget

    def left(self, stage: str) -> float:
        return self.deadline(stage) - time.monotonic()

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


def _import_path(path: str) -> None:
    """Import ``a.b.c.attr`` (the longest importable module prefix, then attributes)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return
    raise ImportError(path)


def stage_environment(q: Queue) -> str:
    import jax

    from experiments.benchmarks import device as bench

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    versions = {}
    for dist in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "pytest"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    apis = {}
    for path in JAX_APIS:
        try:
            _import_path(path)
            apis[path] = "ok"
        except Exception as e:
            apis[path] = f"{type(e).__name__}: {e}"[:300]
    q.data.update(
        platform=jax.default_backend(),
        device_count=jax.device_count(),
        memory_bytes_limit=stats.get("bytes_limit"),
        versions=versions,
        jax_apis=apis,
        python=platform_module.python_version(),
        cpu_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        peak_tflops=(bench.peak_flops(device.device_kind, q.args.peak_tflops) or 0) / 1e12 or None,
    )
    missing = [p for p, ok in apis.items() if ok != "ok"]
    return f"apis missing: {missing}" if missing else "all checked jax apis import"


# --- stage 2: tests -----------------------------------------------------------------------------

_STATUS = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def pytest_counts(log: str) -> dict:
    """Counts per status and the failing ids from pytest's ``-v`` lines (with or without
    xdist: ``path::id STATUS`` or ``[gw0] [ 5%] STATUS path::id``); complete even when the run
    was stopped before its summary). The short summary's ``FAILED path::id - why`` lines, which
    repeat failures already counted, end the count."""
    counts, failed = collections.Counter(), []
    for line in log.splitlines():
        if "short test summary info" in line:
            break
        if "::" not in line:
            continue
        m = _STATUS.search(line)
        if not m:
            continue
        counts[m.group(1).lower()] += 1
        if m.group(1) in ("FAILED", "ERROR"):
            failed.append(next((w for w in line.split() if "::" in w), line.strip()))
    return {"counts": dict(counts), "failed": failed}


def start_pytest(paths: tuple[str, ...], env_extra: dict, workers: int, log_path: str):
    """pytest on ``paths`` in a subprocess of its own process group, output to ``log_path``."""
    # Plugins an image may carry that warn at start-up (pytest-benchmark beside xdist): the
    # project's filterwarnings make a warning an error, so they are blocked.
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:benchmark"]
    # -v: a line per test (counted as it runs); short tracebacks and the failures' one-line
    # reasons (-rfE) at the end, where the log's tail (recorded on failure) shows them.
    cmd += ["-v", "--tb=short", "-rfE", *paths]
    if importlib.util.find_spec("xdist") is not None:  # tests/conftest.py uses its hook
        cmd += ["-n", str(workers), "--dist", "load"] if workers > 1 else ["-n", "0"]
    else:
        cmd += ["-o", "addopts=--import-mode=importlib"]
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    log = open(log_path, "w")  # noqa: SIM115  (closed by finish_pytest)
    # A process group of its own (xdist's workers included) to stop at the deadline; not a
    # session of its own, so nothing outlives the command that started the queue.
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0
    )
    return {"proc": proc, "log": log, "log_path": log_path, "cmd": cmd, "began": time.monotonic()}


def finish_pytest(run: dict, deadline: float) -> dict:
    """Wait for a pytest run until ``deadline`` (monotonic), stopping its process group then;
    its counts, failures, summary line and, on failure, the log's end."""
    proc = run["proc"]
    timed_out = False
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    run["log"].close()
    with open(run["log_path"]) as f:
        log = f.read()
    out = pytest_counts(log)
    summary = [ln for ln in log.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    out.update(
        command=" ".join(run["cmd"][1:]),
        returncode=proc.returncode,
        seconds=round(time.monotonic() - run["began"], 1),
        timed_out=timed_out,
        summary=summary[-1].strip("= ") if summary else "",
        log=os.path.basename(run["log_path"]),
    )
    if timed_out or proc.returncode != 0:  # 5: no tests collected, a failure here too
        out["log_tail"] = log[-3000:]
    if proc.returncode == 5:
        out["error"] = "no tests collected"
    return out


def stage_tests(q: Queue) -> str:
    if importlib.util.find_spec("pytest") is None:
        q.data["tests"] = {"gpu": {"error": "pytest is not installed"}}
        return "pytest is not installed: no tests run"
    logs = q.results.stem_path  # the full logs come back beside the JSON
    dry = q.args.dry_run
    # The encoder tests on this machine's CPU with its jax, in the background until their own
    # deadline: they use no accelerator, so they may overlap the compile stage, not the timing.
    cpu_env = {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    q.background["encoder_tests"] = start_pytest(
        DRY_ENCODER_TESTS if dry else ENCODER_TESTS,
        cpu_env,
        workers=1 if dry else max(1, (os.cpu_count() or 2) // 4),
        log_path=f"{logs}-tests-encoders-cpu.log",
    )
    gpu_env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2"}
    run = start_pytest(
        DRY_TESTS if dry else GPU_TESTS,
        gpu_env,
        workers=1 if dry else 2,
        log_path=f"{logs}-tests-gpu.log",
    )
    gpu = finish_pytest(run, q.deadline("tests"))
    q.data["tests"] = {"gpu": gpu}
    if gpu.get("error"):
        raise RuntimeError(f"GPU tests: {gpu['error']} (pytest exit code {gpu['returncode']})")
    return gpu.get("summary", "")


def stop_background(q: Queue) -> None:
    """Stop the background tests' process groups (a run that ends early or overstays)."""
    for run in q.background.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run["proc"].pid, signal.SIGKILL)


def wait_for_encoder_tests(q: Queue) -> None:
    run = q.background.pop("encoder_tests", None)
    if run is not None:
        q.data.setdefault("tests", {})["encoders_on_cpu"] = finish_pytest(
            run, q.deadline("encoder_tests")
        )
        q.results.save()


# --- stages 3 and 4: compile and time the steps -------------------------------------------------


@contextlib.contextmanager
def every_platform(table: dict, name: str):
    """Trace with every entry of ``table`` (a per-platform choice read when a program is
    traced: ``lie.BLOCK_PRODUCTS``, ``position_hook.LAYER_PLANS``, ``expm.SQUARING_LOOPS``) set
    to ``name``; JAX's caches are cleared on entry and exit, so that programs are traced again."""
    saved = dict(table)
    table.update({k: name for k in saved})
    jax_clear_caches()
    try:
        yield
    finally:
        table.clear()
        table.update(saved)
        jax_clear_caches()


def jax_clear_caches() -> None:
    import jax

    jax.clear_caches()


# LieRE 8x8's variants, each one choice its platform does not make by default, named
# "<kind>=<choice>": kind "product" a block product (``lie.BLOCK_PRODUCTS``), "layers" a layer
# plan (``position_hook.LAYER_PLANS``), "squarings" a squaring loop (``expm.SQUARING_LOOPS``),
# "small_products" how the exponentials' small products are written (``expm.SMALL_PRODUCTS``).
# Each is a per-platform table read when a program is traced; a variant sets it everywhere.
VARIANT_KINDS = {
    "product": "block product",
    "layers": "layer plan",
    "squarings": "squaring loop",
    "small_products": "small product",
}


def variant_table(kind: str) -> dict:
    from rope_lie.encodings import expm, lie
    from rope_lie.models import position_hook

    tables = {
        "product": lie.BLOCK_PRODUCTS,
        "layers": position_hook.LAYER_PLANS,
        "squarings": expm.SQUARING_LOOPS,
        "small_products": expm.SMALL_PRODUCTS,
    }
    return tables[kind]


def split_variant(name: str | None) -> tuple[str, str] | None:
    """(kind, choice) of a variant's name; None for None (the platform's defaults)."""
    if name is None:
        return None
    kind, sep, choice = name.partition("=")
    if not sep or kind not in VARIANT_KINDS:
        raise ValueError(
            f"variant {name!r}: expected '<kind>=<choice>', kind in {list(VARIANT_KINDS)}"
        )
    return kind, choice


def variant(name: str | None):
    """The context a variant is traced in (None: the platform's defaults)."""
    split = split_variant(name)
    return (
        contextlib.nullcontext()
        if split is None
        else every_platform(variant_table(split[0]), split[1])
    )


def platform_choice(kind: str, platform: str) -> str:
    """What ``platform`` uses of a variant kind by default."""
    from rope_lie.encodings import expm
    from rope_lie.models import position_hook

    if kind == "layers":
        return position_hook.layer_plan(platform)
    if kind == "squarings":
        return "fixed" if expm.Host(platform, 1).fixed_squarings else "while"
    if kind == "small_products":
        return expm.Host(platform, 1).small_products
    table = variant_table(kind)
    # jax.default_backend()'s "gpu" is "cuda" or "rocm" to lax.platform_dependent.
    for key in {"gpu": ("cuda", "rocm")}.get(platform, (platform,)):
        if key in table:
            return table[key]
    return table["default"]


_OTHER = {
    "product": ("einsum", "broadcast"),
    "layers": ("each", "batched"),
    "squarings": ("while", "fixed"),
    "small_products": ("adds", "reduce"),
}


def other_variant(kind: str, platform: str) -> str:
    """The variant of ``kind`` that ``platform`` does not use by default ("by_size" block
    products are the broadcast at 8 x 8, so its other is the einsum)."""
    first, second = _OTHER[kind]
    return f"{kind}={second if platform_choice(kind, platform) == first else first}"


def variant_choices(name: str | None, platform: str) -> dict[str, str]:
    """Every kind's choice in a step traced with variant ``name`` on ``platform``."""
    choices = {kind: platform_choice(kind, platform) for kind in VARIANT_KINDS}
    split = split_variant(name)
    return choices if split is None else choices | dict([split])


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


def step_cases(q: Queue, platform: str) -> list[tuple[str, str, str | None]]:
    """(encoder, attention, variant) of stage 3, in the order they are compiled and timed:
    every encoder on the first backend, then the next; LieRE 8x8 with the other block product
    after each backend's rows, and with the other layer plan after the first backend's."""
    from rope_lie.models.backends import BACKENDS

    encoders = [e for e in ENCODERS if not q.args.encoders or e in q.args.encoders.split(",")]
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
        cases += [(e, attention, None) for e in encoders[:limit]]
        if "liere" in encoders and i == 0:
            kinds = ("small_products", "layers", "squarings")
            cases += [("liere", attention, other_variant(k, platform)) for k in kinds]
        if "liere" in encoders and attention in ("cudnn", "xla"):
            cases.append(("liere", attention, other_variant("product", platform)))
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
        if encoder not in q.states:
            q.states[encoder] = q.pool.submit(case["init"], jax.random.key(0))
        futures[q.pool.submit(_compile, case)] = key
    # Until the stage's deadline: a ViT-B step took ~40 s to compile on an H100 machine, so not
    # every case may fit; the steps compiled by then are timed, the others recorded as skipped
    # (a compile already running finishes in its thread, unused).
    try:
        for future in concurrent.futures.as_completed(futures, timeout=max(0.0, q.left("compile"))):
            key = futures[future]
            try:
                q.compiled[key] = future.result()
            except Exception as e:
                q.compiled[key] = {"error": f"compile: {type(e).__name__}: {e}"[:2000]}
    except concurrent.futures.TimeoutError:
        for future, key in futures.items():
            if not future.done():
                future.cancel()
                q.compiled[key] = {"skipped": "no time left in the compile stage"}
    ok = sum("compiled" in c for c in q.compiled.values())
    skipped = sum("skipped" in c for c in q.compiled.values())
    failed = len(q.compiled) - ok - skipped
    return f"{ok} of {len(cases)} steps compiled ({failed} failed, {skipped} out of time)"


def flops_per_image(q: Queue) -> float:
    from experiments.benchmarks import flops

    config = run_config(q.recipes, "nope", "xla", q.shapes["overrides"])
    return flops.matmul_train_flops(config.model.to_dict(), 1)


def empty_row(encoder: str, attention: str, batch: int, **note) -> dict:
    """A row of the step table with nothing timed, and why (``skipped=`` or ``error=``)."""
    timed = dict(step_ms=None, images_per_s=None, mfu=None)
    return dict(encoder=encoder, attention=attention, batch=batch, **timed, **note)


def time_case(q: Queue, key: tuple, case: dict) -> dict:
    """Time one compiled step; its row."""
    import jax

    from experiments.benchmarks import device as bench

    encoder, attention, batch, name = key
    row = empty_row(encoder, attention, batch, case="fixed_batch")
    if encoder.startswith("liere"):
        platform = q.data["platform"]
        choices = variant_choices(name, platform)
        row["block_product"] = choices["product"]
        row["layer_plan"] = choices["layers"]
        row["squaring_loop"] = choices["squarings"]
        row["small_products"] = choices["small_products"]
        row["platform_default"] = name is None
    if "error" in case or "skipped" in case:
        return row | {k: case[k] for k in ("error", "skipped") if k in case}
    state, other = q.states[encoder].result()
    data = bench.random_batch(case["config"], batch, case["mesh"])
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
        del data
    q.states[encoder] = _done((state, other))
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
    )


def _done(value) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(value)
    return future


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
            f"  {key}: {_fmt(row.get('step_ms'), '.2f')} ms {row.get('error', '')[:200]}",
            flush=True,
        )
    return f"{timed} steps timed"


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


def goal_figures(rows: list[dict], batch: int) -> dict:
    """Issue 47's goal, measured: step ratios of the encoders on their fastest backends."""
    best = best_rows([r for r in rows if r.get("case") == "fixed_batch"], batch)
    out = {}

    def ratio(a, b, target):
        if a in best and b in best:
            out[
                f"{a} / {b} step ({best[a]['attention']} / {best[b]['attention']}), goal <= "
                f"{target}"
            ] = round(best[a]["step_ms"] / best[b]["step_ms"], 3)

    ratio("liere", "rope_mixed", 1.10)
    ratio("liere_dense", "rope_mixed", 1.5)
    ratio("rope_mixed", "nope", 1.05)
    largest = [r for r in rows if r.get("case") == "largest_batch" and r.get("mfu")]
    if largest:
        top = max(largest, key=lambda r: r["mfu"])
        out["best MFU at the largest batch, goal >= 40 %"] = (
            f"{100 * top['mfu']:.1f} % ({top['encoder']}, {top['attention']}, batch {top['batch']})"
        )
    return out


# --- stage 5: the block products alone ----------------------------------------------------------


def stage_rotations(q: Queue) -> str:
    import jax.numpy as jnp
    import numpy as np

    batch, heads = q.shapes["rotation_shape"]
    config = run_config(q.recipes, "liere", "xla", q.shapes["overrides"])
    grid = [s // 16 for s in config.model.image_shape]
    tokens = math.prod(grid) + 1
    head_dim = 16 if q.args.dry_run else 64
    rng = np.random.default_rng(0)
    x_np = rng.normal(size=(batch, tokens, heads, head_dim)).astype(np.float32)
    rows = []
    for block in (8, head_dim):
        k = head_dim // block
        # Orthogonal blocks (QR of normal matrices), as rotations are.
        r_np = np.linalg.qr(rng.normal(size=(tokens, heads, k, block, block)))[0]
        r_np = r_np.astype(np.float32)
        want = np.einsum(
            "tnkij,btnkj->btnki",
            r_np.astype(np.float64),
            x_np.astype(np.float64).reshape(batch, tokens, heads, k, block),
        ).reshape(x_np.shape)
        x = jnp.asarray(x_np, jnp.bfloat16)
        r = jnp.asarray(r_np)
        cot = jnp.asarray(rng.normal(size=x_np.shape), jnp.bfloat16)
        for product in ("einsum", "broadcast"):
            if q.left("rotations") <= 0:
                break
            row = {"blocks": f"{block}x{block}", "product": product, "shape_BTNH": list(x_np.shape)}
            try:
                row |= time_product(
                    product, x, jnp.asarray(x_np), r, cot, want, q.shapes["steps"] + 9
                )
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:1000]
            rows.append(row)
            q.data["rotations"] = rows
            q.results.save()
    return f"{len(rows)} cases"


def time_product(product: str, x, x32, r, cot, want, repeats: int) -> dict:
    """``lie.apply_blocks`` with one block product: forward and forward + backward (the VJP
    for both x and r) times on ``x`` (bfloat16), and the forward's error on ``x32``, the same
    values in float32, against ``want`` (float64)."""
    import jax
    import numpy as np

    from rope_lie.encodings import lie

    def forward_backward(x, r):
        return jax.vjp(lie.apply_blocks, x, r)[1](cot)

    with variant(f"product={product}"):
        forward = jax.jit(lie.apply_blocks).lower(x, r).compile()
        both = jax.jit(forward_backward).lower(x, r).compile()
        exact = jax.jit(lie.apply_blocks)(x32, r)
    err = np.max(np.abs(np.asarray(exact, np.float64) - want)) / np.max(np.abs(want))
    return dict(
        forward_ms=_min_ms(lambda: forward(x, r), repeats),
        forward_backward_ms=_min_ms(lambda: both(x, r), repeats),
        rel_err=float(err),
    )


def _min_ms(call, repeats: int) -> float:
    import jax

    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - began)
    return 1e3 * min(times)


# --- stage 6: profiles --------------------------------------------------------------------------

# Host events in a CPU trace that are not XLA ops (profile_step.py's rule).
_NOT_OPS = ("$", "Thunk", "Pjit", "Parse", "Slinky", "end:", "Handle inputs")
# Lines of a device plane that summarise rather than time operations.
_NOT_OP_LINES = ("XLA Modules", "Steps", "Launch Stats", "Source", "TraceMe", "Framework")


def op_times(xplane_path: str, steps: int, names: dict[str, str], top: int = 20) -> dict:
    """The top operations by time per step in a ``jax.profiler`` trace (its XSpace).

    Device planes (``/device:GPU:0``, ``/device:TPU:0``): the "XLA Ops" line where there is one,
    else every line but the summaries. Without a device plane (XLA:CPU) the host threads' XLA op
    events. ``names`` maps HLO instruction names to their ``op_name`` metadata.
    """
    import jax

    profile = jax.profiler.ProfileData.from_file(xplane_path)
    planes = [p for p in profile.planes if p.name.startswith("/device:")]
    events, source = [], None
    for plane in planes:
        lines = list(plane.lines)
        chosen = [ln for ln in lines if ln.name == "XLA Ops"] or [
            ln for ln in lines if not ln.name.startswith(_NOT_OP_LINES)
        ]
        found = [(e.name, e.duration_ns) for ln in chosen for e in ln.events]
        if found:
            events += found
            source = f"{plane.name}: " + ", ".join(sorted({ln.name for ln in chosen}))[:200]
    if not events:
        for plane in profile.planes:
            if plane.name != "/host:CPU":
                continue
            for ln in plane.lines:
                if ln.name == "python":
                    continue
                events += [
                    (e.name, e.duration_ns)
                    for e in ln.events
                    if not e.name.startswith(_NOT_OPS) and "::" not in e.name
                ]
            source = "/host:CPU: XLA op events of the host threads"
    if not events:
        return {"source": None, "note": "no operation events in the trace"}
    per_op = collections.Counter()
    for name, ns in events:
        per_op[name] += ns / 1e6 / steps
    kinds = collections.Counter()
    for name, ms in per_op.items():
        kinds[re.sub(r"[.\d]+$", "", name)] += ms
    return {
        "source": source,
        "total_ms": round(sum(per_op.values()), 3),
        "top_ops": [[op, names.get(op, "?"), round(ms, 4)] for op, ms in per_op.most_common(top)],
        "kinds_ms": [[k, round(ms, 4)] for k, ms in kinds.most_common(top)],
    }


def kernel_op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its ``op_name`` (``profile_step.op_names``), also under the name
    of the kernel XLA:GPU emits for it (the instruction's name with every character other than
    a letter, digit or ``_`` made ``_``: ``gemm_fusion_dot.360`` runs as
    ``gemm_fusion_dot_360``, the name a GPU trace's events carry). A fusion without metadata
    takes the ``op_name`` most instructions of its fused computation carry."""
    from experiments.benchmarks.profile_step import op_names

    names = op_names(hlo_text)
    inside = collections.defaultdict(collections.Counter)  # computation: op_name counts
    calls = {}  # instruction: the computation it calls
    computation = None
    for line in hlo_text.splitlines():
        head = re.match(r"(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
        if head:
            computation = head.group(1)
            continue
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if not m:
            continue
        if computation and names.get(m.group(1)):
            inside[computation][names[m.group(1)]] += 1
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if called:
            calls[m.group(1)] = called.group(1)
    for name, computation in calls.items():
        if not names.get(name) and inside[computation]:
            names[name] = inside[computation].most_common(1)[0][0]
    for name, op in list(names.items()):
        names.setdefault(re.sub(r"\W", "_", name), op)
    return names


def hlo_op_counts(hlo_text: str) -> dict[str, int]:
    """Instructions per opcode in a compiled HLO module's text."""
    counts = collections.Counter()
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][\w\-]*)\(", line)
        if m:
            counts[m.group(1)] += 1
    return dict(counts)


def profile_case(q: Queue, key: tuple, case: dict) -> dict:
    import jax

    from experiments.benchmarks import device as bench

    compiled = case["compiled"]
    hlo = compiled.as_text()
    out = {"attention": key[1], "batch": key[2], "hlo_ops": hlo_op_counts(hlo)}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    out["cost_analysis"] = {
        k: float(v)
        for k, v in (cost or {}).items()
        if k in ("flops", "bytes accessed", "transcendentals")
    }
    state, other = q.states[key[0]].result()
    data = bench.random_batch(case["config"], key[2], case["mesh"])
    rng = jax.random.key(1)
    state, m = compiled(state, data, other, rng)
    jax.block_until_ready(m)
    steps = 3
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                state, m = compiled(state, data, other, rng)
            jax.block_until_ready(m)
        q.states[key[0]] = _done((state, other))
        paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            out["trace"] = {"source": None, "note": "the profiler wrote no .xplane.pb"}
        else:
            out["trace"] = op_times(paths[0], steps, kernel_op_names(hlo))
    return out


def stage_profile(q: Queue) -> str:
    best = best_rows(q.data["rows"], q.shapes["batch"])
    q.data["profiles"] = {}
    targets = {}  # name: key of the compiled step
    for encoder in PROFILED:
        if encoder in best:
            row = best[encoder]
            targets[encoder] = (encoder, row["attention"], row["batch"], None)
    if "liere" in targets:  # LieRE 8x8's variants: on the same backend when compiled there,
        platform = q.data["platform"]  # else where they were
        for kind, label in VARIANT_KINDS.items():
            other = other_variant(kind, platform)
            for attention in (targets["liere"][1], *ATTENTIONS):
                key = ("liere", attention, q.shapes["batch"], other)
                if "compiled" in q.compiled.get(key, {}):
                    targets[f"liere ({split_variant(other)[1]} {label})"] = key
                    break
    for name, key in targets.items():
        if q.left("profile") <= 0:
            break
        try:
            q.data["profiles"][name] = profile_case(q, key, q.compiled[key])
        except Exception as e:
            q.data["profiles"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        q.results.save()
    return f"profiled {sorted(q.data['profiles'])}"


# --- stage 7: padded against packed NaFlex batches ----------------------------------------------


def naflex_batches(
    grid: tuple[int, ...], patch: tuple[int, ...], channels: int, batch: int, num_classes: int
) -> dict[str, tuple[dict, float, int]]:
    """One batch of random square images of sides uniform in [grid / 2, grid] patches, as a
    padded NaFlex batch and packed: case -> (host arrays, padding fraction, rows)."""
    import numpy as np

    from rope_lie.evaluate import PACKED_KEYS, TOKEN_KEYS
    from rope_lie.models import tokens

    rng = np.random.default_rng(0)
    high = grid[0]
    low = max(1, high // 2)
    sides = rng.integers(low, high + 1, batch)
    images = [
        rng.normal(size=(s * patch[0], s * patch[1], channels)).astype(np.float32) for s in sides
    ]
    labels = rng.integers(0, num_classes, batch).astype(np.int32)
    length = high * high
    padded = tokens.pack(images, patch, length)
    real = float(padded.mask_BT.sum())
    packed, place = tokens.pack_images(images, patch, length, max(1, length // low**2))
    return {
        "padded": (
            {**dict(zip(TOKEN_KEYS, padded, strict=True)), "label": labels},
            1 - real / padded.mask_BT.size,
            batch,
        ),
        "packed": (
            {
                **dict(zip(PACKED_KEYS, packed, strict=True)),
                "image_row": place[:, 0],
                "image_slot": place[:, 1],
                "label": labels,
            },
            1 - real / packed.segment_BT.size,
            packed.segment_BT.shape[0],
        ),
    }


def packing_case(q: Queue, encoder: str, batches: dict) -> dict:
    """Lower and compile the train step of each case of ``batches`` (in the pool, at once)."""
    import jax

    from rope_lie import sharding, train

    config = run_config(q.recipes, encoder, "xla", q.shapes["overrides"])
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    setup, _, init, _ = train.create_setup_and_state(config, mesh, 1000)
    state, other = init(jax.random.key(0))
    step = train.make_train_step(setup)
    key = jax.random.key(1)
    futures = {}
    for case, (host, _, _) in batches.items():
        data = sharding.shard_batch(host, mesh)
        lowered = step.lower(state, data, other, key)
        futures[case] = (q.pool.submit(_compile, {"lowered": lowered}), data)
    return {"state": state, "other": other, "key": key, "futures": futures}


def stage_packing(q: Queue) -> str:
    import jax
    from flax import nnx

    from experiments.benchmarks import device as bench
    from rope_lie import train

    q.data["packing"] = rows = []
    timed = 0
    for encoder in PACKED_ENCODERS:
        config = run_config(q.recipes, encoder, "xla", q.shapes["overrides"])
        model = nnx.eval_shape(
            lambda config=config: train.build_model(config.model, jax.random.key(0))
        )
        images = q.shapes["packing_batch"]
        batches = naflex_batches(
            model.train_grid, model.patch, config.model.channels, images, config.model.num_classes
        )
        base = dict(
            encoder=encoder, attention="xla", images=images, tokens=model.train_grid[0] ** 2
        )
        own = [base | dict(case=c, rows=r, padding_fraction=f) for c, (_, f, r) in batches.items()]
        rows += own
        if q.left("packing") <= 0:
            for r in own:
                r["skipped"] = "no time left in the packing stage"
            continue
        try:
            prepared = packing_case(q, encoder, batches)
        except Exception as e:
            for r in own:
                r["error"] = f"{type(e).__name__}: {e}"[:1000]
            continue
        state = prepared["state"]
        for r in own:
            future, data = prepared["futures"][r["case"]]
            try:
                case = future.result(timeout=max(1.0, q.left("packing")))
                timing, state = bench.time_compiled(
                    case["compiled"],
                    state,
                    data,
                    prepared["other"],
                    prepared["key"],
                    q.shapes["steps"],
                    warmup=q.shapes["warmup"],
                )
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {e}"[:1000]
                continue
            r.update(
                step_ms=timing["step_ms_min"],
                step_ms_median=timing["step_ms_median"],
                compile_s=round(case["compile_s"], 1),
                loss=timing["loss"],
            )
            timed += 1
        padded = own[0].get("step_ms")
        for r in own:
            if padded and r.get("step_ms"):
                r["time_over_padded"] = r["step_ms"] / padded
        q.results.save()
    return f"{timed} NaFlex steps timed"


# --- stage 8: the largest batch -----------------------------------------------------------------


def batch_candidates(memory: dict | None, batch: int, limit: int | None, max_batch: int) -> list:
    """Batches to try, largest first: the largest power of two whose predicted peak fits
    ``MEMORY_SHARE`` of ``limit``, and its half (at least ``2 batch``; ``max_batch`` at most).

    The prediction is linear in the batch from one compile at ``batch``: the arguments (train
    state and images) stay, everything else (activations, gradients' temporaries) scales.
    Without a device limit (XLA:CPU) the candidates are ``max_batch`` and its half.
    """
    if limit is None or memory is None:
        top = max_batch
    else:
        per_image = max(1.0, (memory["peak"] - memory["argument"]) / batch)
        fits = (MEMORY_SHARE * limit - memory["argument"]) / per_image
        top = min(max_batch, 2 ** int(math.floor(math.log2(max(fits, 1.0)))))
    return [b for b in (top, top // 2) if b >= 2 * batch] or []


def stage_largest_batch(q: Queue) -> str:
    best = best_rows(q.data["rows"], q.shapes["batch"])
    limit = q.data.get("memory_bytes_limit")
    found = []
    for encoder in [e for e in ENCODERS if e in best][: q.shapes["largest_encoders"]]:
        if q.left("largest_batch") <= 0:
            break
        row = best[encoder]
        case64 = q.compiled[(encoder, row["attention"], row["batch"], None)]
        candidates = batch_candidates(
            case64.get("memory"), row["batch"], limit, q.shapes["max_batch"]
        )
        if not candidates:
            continue
        lowered = {
            b: q.pool.submit(_compile, lower_case(q, encoder, row["attention"], b))
            for b in candidates
        }
        result = None
        for b in candidates:
            key = (encoder, row["attention"], b, None)
            try:
                case = lowered[b].result()
            except Exception as e:
                result = empty_row(
                    encoder, row["attention"], b, error=f"compile: {type(e).__name__}: {e}"[:1000]
                )
                continue
            if limit and case["memory"] and case["memory"]["peak"] > limit:
                result = empty_row(
                    encoder,
                    row["attention"],
                    b,
                    skipped=f"peak {case['memory']['peak']} B > {limit} B",
                )
                continue
            q.compiled[key] = case
            try:
                result = time_case(q, key, case)
            except Exception as e:  # out of memory at run time: try the half
                result = empty_row(
                    encoder, row["attention"], b, error=f"{type(e).__name__}: {e}"[:1000]
                )
                continue
            finally:
                q.compiled.pop(key, None)
            if result.get("step_ms") is not None:
                break
        if result is not None:
            result["case"] = "largest_batch"
            result["candidates"] = candidates
            q.data["rows"].append(result)
            found.append(f"{encoder} {result['batch']}")
            q.data["goal"] = goal_figures(q.data["rows"], q.shapes["batch"])
            q.results.save()
    return ", ".join(found)


# ---------------------------------------------------------------------------------------------


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="folder of the JSON and Markdown")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for every stage")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (automatic on CPU)")
    parser.add_argument("--encoders", default="", help="a subset of ENCODERS, comma-separated")
    parser.add_argument("--attention", default="", help="a subset of the backends")
    parser.add_argument("--skip", default="", help="stages not to run, comma-separated")
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
        data["seconds"] = round(time.monotonic() - q.start, 1)
        results.save()
    print(f"wrote {results.json_path} and {results.md_path} in {data['seconds']} s", flush=True)
    return data


if __name__ == "__main__":
    main()
