"""Running a study: its arms x seeds as `rope_lie.main` runs, resumable, results recorded.

A study is a list of arms; an arm is a recipe (``configs/<recipe>.py``), its argument string,
and config overrides. Each (arm, seed) is one training run in its own workdir under
``<root>/runs/``, named from the recipe, argument, overrides and seed, so studies that share an
arm share its runs. The runner:

1. skips (arm, seed) pairs already in the study's ``results.csv`` (a finished run is never
   redone);
2. otherwise copies the run's rows from another study's ``results.csv`` that recorded the same
   run (same recipe, argument, overrides, seed and scale: the same workdir name), so shared
   runs are shared through the committed results even when the workdirs are gone;
3. otherwise collects a run whose workdir has ``final.json`` and ``eval_examples.npz``;
4. otherwise starts (or resumes, from the run's last checkpoint) ``python -m rope_lie.main`` in
   a subprocess, then collects it. Before it starts, the run's workdir gets ``provenance.json``:
   the code tree (commit, "+dirty" with uncommitted changes to rope_lie/ or configs/) and the
   machine (the CPU's model and AVX2/AVX-512, or the GPU's name where ``nvidia-smi`` names
   one), which become the ``tree`` and ``cpu`` columns (empty for runs recorded before they
   were kept; the tree then "+resumed" when a run was resumed on another tree or machine, and
   "+ensemble" when a seed ensemble, ``rope_lie.ensemble``, trained it). ``jobs`` runs
   train side by side (for a GPU, which one small run leaves mostly idle); by default one at a
   time.

An arm with an ``eval_suffix`` trains nothing of its own: it reads the evaluations named
``<eval><suffix>`` (``EVAL_SUFFIX`` "@", e.g. ``px56@yarn``: an extrapolation tool applied at
evaluation) of the run of the same recipe, argument and overrides, recorded under their plain
names; an arm without one takes the evaluations without a suffix. So one trained model gives
several arms, paired by seed (they share its data orders: ``lib.shares_data``).

Collecting appends one row per evaluation to ``results.csv`` (columns ``RESULT_COLUMNS``) and the
per-example results to ``examples.npz`` (packed bits, key ``arm/seed/eval``), both written
atomically, so killing the runner at any moment loses at most the run in progress, and that
run resumes from its checkpoint. It also adds the run's training and held-out curves to
``training.csv`` and ``held_out.csv`` (``curves_csv``), so they outlive the workdir.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from experiments.studies import curves_csv

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUDIES_DIR = os.path.dirname(os.path.abspath(__file__))
RESULT_COLUMNS = (
    "study",
    "arm",
    "seed",
    "eval",
    "accuracy",
    "num_examples",
    "best_accuracy",
    "steps",
    "train_ex_per_s",
    "resolution",
    "tree",
    "cpu",
)
PROVENANCE = "provenance.json"  # in a run's workdir: the code tree and CPU that trained it
RESUMED = "+resumed"  # after the tree column's code tree: resumed on another tree or machine
ENSEMBLE = "+ensemble"  # after the tree column's code tree (and RESUMED): in a seed ensemble
TREE_MARKS = (RESUMED, ENSEMBLE)
CHECKPOINTS = "checkpoints"  # rope_lie's checkpoint folder in a workdir, one folder per step
ENSEMBLE_JSON = "ensemble.json"  # rope_lie.ensemble.ENSEMBLE_JSON, in each member's workdir
EVAL_SUFFIX = "@"  # <eval>@<name>: an evaluation that an arm with eval_suffix reads
DATA_STREAM_STRIDE = 1000  # Arm.data_stream k: data_seed = 1000 k + seed (seeds below 1000)


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm of a study.

    Attributes:
      name: short key used in files (``results.csv``'s arm column).
      label: the plain name printed in tables and plots (say whose variant it is).
      recipe: ``configs/<recipe>.py``.
      arg: the recipe's argument string at CPU scale (``pe=liere,block=8``).
      overrides: ``--config.<key>=<value>`` pairs, applied at every scale.
      paper_arg: the recipe's argument string for ``--scale paper`` (None: arg plus ",res=paper").
      cpu_overrides: overrides applied only at CPU scale (e.g. fewer training examples).
      paper_recipe: the recipe at ``--scale paper`` when it is another one (None: recipe).
      eval_suffix: None, or ``EVAL_SUFFIX`` + a name: this arm is the evaluations
        ``<eval><suffix>`` of the run (module docstring), not a run of its own.
      data_stream: None: the run's data order is its seed's (``config.data_seed`` unset), so
        seed k of every such arm saw the same batches and arms are compared as pairs; k >= 1:
        ``data_seed = DATA_STREAM_STRIDE * k + seed``, a data order no other stream shares
        (arms on different streams are compared as independent, by Welch's test). The init
        seed stays ``seed`` either way.
    """

    name: str
    label: str
    recipe: str
    arg: str
    overrides: tuple[tuple[str, Any], ...] = ()
    paper_arg: str | None = None
    cpu_overrides: tuple[tuple[str, Any], ...] = ()
    paper_recipe: str | None = None
    eval_suffix: str | None = None
    data_stream: int | None = None

    def __post_init__(self):
        if self.eval_suffix is not None and not (
            self.eval_suffix.startswith(EVAL_SUFFIX) and len(self.eval_suffix) > 1
        ):
            raise ValueError(
                f"arm {self.name!r}: eval_suffix={self.eval_suffix!r} must be "
                f"{EVAL_SUFFIX!r} followed by a name"
            )
        if self.data_stream is not None and (
            not isinstance(self.data_stream, int) or self.data_stream < 1
        ):
            raise ValueError(
                f"arm {self.name!r}: data_stream={self.data_stream!r}; expected None (the "
                "seed's data order) or an integer >= 1"
            )

    def data_seed(self, seed: int) -> int | None:
        """The run's ``config.data_seed``: None (the seed's own order) or its stream's."""
        if self.data_stream is None:
            return None
        if not 0 <= seed < DATA_STREAM_STRIDE:
            raise ValueError(f"seed={seed}: data streams hold seeds 0-{DATA_STREAM_STRIDE - 1}")
        return DATA_STREAM_STRIDE * self.data_stream + seed

    def recipe_for(self, scale: str) -> str:
        return self.paper_recipe if scale == "paper" and self.paper_recipe else self.recipe

    def argument(self, scale: str) -> str:
        if scale == "cpu":
            return self.arg
        return self.paper_arg if self.paper_arg is not None else f"{self.arg},res=paper"

    def all_overrides(self, scale: str) -> tuple[tuple[str, Any], ...]:
        return self.overrides + (self.cpu_overrides if scale == "cpu" else ())


@dataclasses.dataclass(frozen=True)
class Study:
    """A study: arms, the evaluations it reports, and what the paper says."""

    name: str
    title: str
    arms: tuple[Arm, ...]
    evals: tuple[str, ...]  # evaluation names reported (all a run makes are recorded)
    paper: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    comparisons: tuple[tuple[str, str], ...] = ()  # (arm a, arm b) paired tests
    default_seeds: int = 3
    # Arms that are points of one curve (the same encoding at several training fractions):
    # (x-axis label, ((line label, ((x, arm name), ...)), ...)); drawn as curves.png.
    curves: tuple[str, tuple[tuple[str, tuple[tuple[float, str], ...]], ...]] | None = None
    # Evaluations that are points of one axis (a test at several sizes): (x-axis label,
    # ((panel title, ((x, eval name), ...)), ...)); one line per arm, drawn as scaling.png.
    eval_curves: tuple[str, tuple[tuple[str, tuple[tuple[float, str], ...]], ...]] | None = None
    # What differs at --scale paper, where the recipes evaluate under other names (arrows
    # res=paper: g09 / g14 / g23; CIFAR-100 and UCF101: test / test_shuffled; cayley: test):
    # field -> value (evals, paper, eval_curves), applied by `at_scale`.
    paper_scale: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        fields = {f.name for f in dataclasses.fields(self)} - {"name", "arms", "paper_scale"}
        unknown = sorted(set(self.paper_scale) - fields)
        if unknown:
            raise ValueError(
                f"study {self.name!r}: paper_scale sets {unknown}; expected some of "
                f"{sorted(fields)}"
            )

    def at_scale(self, scale: str) -> Study:
        """The study as reported at `scale` ("cpu": itself; "paper": with `paper_scale`)."""
        if scale == "cpu":
            return self
        if scale != "paper":
            raise ValueError(f"scale={scale!r}; expected 'cpu' or 'paper'")
        return dataclasses.replace(self, **self.paper_scale)

    def arm(self, name: str) -> Arm:
        for arm in self.arms:
            if arm.name == name:
                return arm
        raise KeyError(f"study {self.name!r} has no arm {name!r}; arms: {self.arm_names}")

    @property
    def arm_names(self) -> list[str]:
        return [a.name for a in self.arms]


def same_runs(a: Arm, b: Arm) -> bool:
    """Whether two arms read the same trained runs (same recipe, argument and overrides at
    every scale), so that their seeds pair: one is the other's evaluations under a suffix."""
    return all(
        (a.recipe_for(s), a.argument(s), a.all_overrides(s))
        == (b.recipe_for(s), b.argument(s), b.all_overrides(s))
        for s in ("cpu", "paper")
    )


def own_evals(arm: Arm, names) -> dict[str, str]:
    """{recorded name: run's evaluation name} of the evaluations ``names`` that ``arm`` reads:
    those ending in its ``eval_suffix`` (suffix removed), or those with no suffix."""
    if arm.eval_suffix is None:
        return {n: n for n in names if EVAL_SUFFIX not in n}
    return {n[: -len(arm.eval_suffix)]: n for n in names if n.endswith(arm.eval_suffix)}


def run_dir(root: str, arm: Arm, seed: int, scale: str) -> str:
    """The run's workdir: readable name plus a hash of everything that defines the run (not the
    runner's extra flags, which must not change what a run computes: a data directory, say)."""
    key = json.dumps(_run_parts(arm, scale, seed))
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    return os.path.join(root, "runs", scale, f"{_readable(arm, scale)}_seed{seed}_{digest}")


def _run_parts(arm: Arm, scale: str, seed: int | None) -> list:
    """What defines the arm's run of `seed` (None: of any seed, the arm's own part)."""
    overrides = [list(o) for o in arm.all_overrides(scale)]
    parts = [arm.recipe_for(scale), arm.argument(scale), overrides, seed, scale]
    if arm.data_stream is not None:  # runs without a stream keep the names they had
        parts.append(["data_stream", arm.data_stream])
    return parts


def _readable(arm: Arm, scale: str) -> str:
    name = f"{arm.recipe_for(scale)}_{arm.argument(scale)}"
    return re.sub(r"[^A-Za-z0-9=.]+", "_", name).strip("_")


def ensemble_dir(root: str, arm: Arm, seeds: Sequence[int], scale: str) -> str:
    """Where the ensemble of `arm`'s `seeds` keeps its stacked checkpoints: the arm's readable
    name, the seeds, and a hash of the arm and the seed set (an ensemble resumes only as the
    same seeds)."""
    key = json.dumps([_run_parts(arm, scale, None), list(seeds)])
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    named = "-".join(map(str, seeds))
    return os.path.join(root, "runs", scale, f"{_readable(arm, scale)}_seeds{named}_{digest}")


def ensemble_dirs(root: str, arm: Arm, scale: str) -> dict[str, list[int]]:
    """The ensemble directories of `arm` under `root`, of any seed set: path -> its seeds. The
    seeds are read from the name and the name checked against ``ensemble_dir``, so an arm of
    the same readable name (other overrides) does not count."""
    runs = os.path.join(root, "runs", scale)
    if not os.path.isdir(runs):
        return {}
    prefix = f"{_readable(arm, scale)}_seeds"
    out = {}
    for name in sorted(os.listdir(runs)):
        seeds = _named_seeds(name.removeprefix(prefix)) if name.startswith(prefix) else None
        path = os.path.join(runs, name)
        if seeds is not None and ensemble_dir(root, arm, seeds, scale) == path:
            out[path] = seeds
    return out


def _named_seeds(tail: str) -> list[int] | None:
    """The seeds of an ensemble directory's name after "_seeds" ("0-1-2_<hash>"), or None."""
    named, _, _ = tail.rpartition("_")
    parts = named.split("-")
    return [int(p) for p in parts] if all(p.isdigit() for p in parts) else None


class HeldEnsemble(NamedTuple):
    """An ensemble directory that holds training to resume: its seeds, those of them it holds
    (``ensembles_in_progress``) and its newest checkpoint step."""

    path: str
    seeds: list[int]
    held: list[int]
    step: int


def ensembles_in_progress(root: str, arm: Arm, scale: str) -> list[HeldEnsemble]:
    """The ensembles of `arm` under `root` with a checkpoint and seeds they hold: seeds whose
    workdirs are neither finished nor hold a checkpoint of their own (a member's own checkpoint
    is its final state, which ``rope_lie.main`` finishes). Such a seed resumes only as that
    ensemble: trained any other way it restarts from step 0 in the workdir the ensemble writes.
    A directory without a checkpoint (stopped before its first) holds nothing."""
    out = []
    for path, seeds in ensemble_dirs(root, arm, scale).items():
        step = newest_step(path)
        if step is None:
            continue
        held = [
            s
            for s in seeds
            if not is_finished(w := run_dir(root, arm, s, scale)) and newest_step(w) is None
        ]
        if held:
            out.append(HeldEnsemble(path, seeds, held, step))
    return out


def newest_step(workdir: str) -> int | None:
    """The newest checkpoint step in `workdir` (None without one). Orbax renames a step's
    folder into place once it is written, so a folder named by its step is complete."""
    folder = os.path.join(workdir, CHECKPOINTS)
    if not os.path.isdir(folder):
        return None
    steps = [int(n) for n in os.listdir(folder) if n.isdigit()]
    return max(steps, default=None)


def command(arm: Arm, seed: int, scale: str, workdir: str, extra: Sequence[str] = ()) -> list[str]:
    """The ``rope_lie.main`` command line of one run."""
    config = os.path.join(REPO, "configs", f"{arm.recipe_for(scale)}.py")
    arg = arm.argument(scale)
    cmd = [sys.executable, "-m", "rope_lie.main", f"--config={config}:{arg}"]
    cmd += [f"--workdir={workdir}", f"--config.seed={seed}"]
    if arm.data_stream is not None:
        cmd.append(f"--config.data_seed={arm.data_seed(seed)}")
    cmd += [f"--config.{k}={v}" for k, v in arm.all_overrides(scale)]
    return cmd + list(extra)


def ensemble_command(
    arm: Arm,
    seeds: Sequence[int],
    scale: str,
    workdirs: Sequence[str],
    directory: str,
    extra: Sequence[str] = (),
) -> list[str]:
    """The ``rope_lie.ensemble`` command line that trains `arm`'s `seeds` in one program, each
    written to its workdir as ``command``'s run would be."""
    for path in [*workdirs, directory]:
        if "," in path:
            raise ValueError(f"{path!r}: an ensemble's directories are a comma-separated list")
    config = os.path.join(REPO, "configs", f"{arm.recipe_for(scale)}.py")
    cmd = [sys.executable, "-m", "rope_lie.ensemble", f"--config={config}:{arm.argument(scale)}"]
    cmd += [f"--seeds={','.join(map(str, seeds))}", f"--workdirs={','.join(workdirs)}"]
    cmd.append(f"--ensemble_dir={directory}")
    if arm.data_stream is not None:
        cmd.append(f"--data_seeds={','.join(str(arm.data_seed(s)) for s in seeds)}")
    cmd += [f"--config.{k}={v}" for k, v in arm.all_overrides(scale)]
    return cmd + list(extra)


def recipe_errors(arms: Sequence[Arm], scale: str) -> list[str]:
    """Why the runs of `arms` would stop before they train: for each recipe and error, the
    error that ``configs/<recipe>.py``'s ``get_config(argument)`` raises (as ``rope_lie.main``
    would, first) and the arms it stops; [] when every recipe builds (overrides not applied)."""
    import importlib

    failed: dict[tuple[str, str], list[str]] = {}
    for arm in dict.fromkeys(arms):
        recipe = arm.recipe_for(scale)
        try:
            importlib.import_module(f"configs.{recipe}").get_config(arm.argument(scale))
        except Exception as e:  # reported: the message is what rope_lie.main would print
            failed.setdefault((recipe, f"{type(e).__name__}: {e}"), []).append(arm.name)
    return [
        f"configs/{recipe}.py does not build for arms {', '.join(names)}: {error}"
        for (recipe, error), names in failed.items()
    ]


def shares_data(study: Study | None, arm_a: str, arm_b: str) -> bool:
    """Whether seed k of `arm_a` and seed k of `arm_b` saw the same data order (the same
    ``data_stream``), so that they are compared as pairs. Arms `study` does not define (or no
    study) ran with the seed's own order, as every run before data streams existed."""
    streams = {a.name: a.data_stream for a in study.arms} if study is not None else {}
    return streams.get(arm_a) == streams.get(arm_b)


def is_finished(workdir: str) -> bool:
    return all(os.path.exists(os.path.join(workdir, f)) for f in ("final.json", EXAMPLES))


EXAMPLES = "eval_examples.npz"  # rope_lie.metrics.EXAMPLES_FILE (not imported: no JAX here)


def code_tree() -> str:
    """The checkout's commit (short hash), with "+dirty" when rope_lie/ or configs/ have
    uncommitted changes; "unknown" outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", REPO, "status", "--porcelain", "--", "rope_lie", "configs"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def cpu_kind() -> str:
    """The CPU model and its widest vector extension ("AMD EPYC 9B14 avx512"): float32 results
    differ between AVX2 and AVX-512 machines in the last bits."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = " ".join(value.split())
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    vector = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    return f"{model} {vector}"


def gpu_kind() -> str | None:
    """The first GPU's name as ``nvidia-smi`` gives it ("NVIDIA H100 80GB HBM3"), or None
    where there is none (no JAX here: the runner does not import it)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in out.splitlines() if line.strip()]
    return names[0] if names else None


def machine_kind() -> str:
    """Where a run computes: the GPU's name where there is one (JAX's default backend then),
    else ``cpu_kind()``."""
    gpu = gpu_kind()
    return f"{gpu} gpu" if gpu else cpu_kind()


def record_provenance(workdir: str) -> dict:
    """Writes the code tree and machine kind into the run's workdir when the run starts; a
    resumed run keeps the first record and adds each other tree or machine it is resumed on to
    ``resumed_elsewhere``, in order (results.csv's tree then says ``RESUMED``); returns it."""
    path = os.path.join(workdir, PROVENANCE)
    now = {"tree": code_tree(), "cpu": machine_kind()}
    if os.path.exists(path):
        with open(path) as f:
            first = json.load(f)
        elsewhere = first.get("resumed_elsewhere") or []
        if isinstance(elsewhere, dict):  # a record that kept only the first other tree
            elsewhere = [elsewhere]
        if now != {"tree": first["tree"], "cpu": first["cpu"]} and now not in elsewhere:
            first["resumed_elsewhere"] = [*elsewhere, now]
            _atomic_json(path, first)
        return first
    os.makedirs(workdir, exist_ok=True)
    _atomic_json(path, now)
    return now


def _atomic_json(path: str, obj: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _provenance(workdir: str) -> tuple[str, str]:
    """The run's (tree, cpu) columns: its first code tree, then ``RESUMED`` when it was resumed
    on another tree or machine, and ``ENSEMBLE`` when a seed ensemble trained it (its workdir
    has ``ENSEMBLE_JSON``); the tree and cpu are "" without a provenance record."""
    ensemble = ENSEMBLE if os.path.exists(os.path.join(workdir, ENSEMBLE_JSON)) else ""
    path = os.path.join(workdir, PROVENANCE)
    if not os.path.exists(path):
        return ensemble, ""
    with open(path) as f:
        record = json.load(f)
    resumed = RESUMED if record.get("resumed_elsewhere") else ""
    return record["tree"] + resumed + ensemble, record["cpu"]


def split_tree(tree: str) -> tuple[str, set[str]]:
    """A ``tree`` column's code tree ("abc1234", "abc1234+dirty", "" where not recorded) and
    the marks after it (``TREE_MARKS``)."""
    marks = set()
    while mark := next((m for m in TREE_MARKS if tree.endswith(m)), None):
        marks.add(mark)
        tree = tree.removesuffix(mark)
    return tree, marks


def collect(study: Study, arm: Arm, seed: int, workdir: str) -> tuple[list[dict], dict]:
    """Rows for results.csv and per-example arrays of a finished run."""
    with open(os.path.join(workdir, "final.json")) as f:
        final = json.load(f)
    throughput = _median_throughput(os.path.join(workdir, "metrics.jsonl"))
    tree, cpu = _provenance(workdir)
    rows = []
    evals = own_evals(arm, final["evals"])
    if not evals:
        raise ValueError(
            f"{workdir} has no evaluation for arm {arm.name!r} (eval_suffix={arm.eval_suffix!r}): "
            f"it has {sorted(final['evals'])}"
        )
    for name, run_name in sorted(evals.items()):
        res = final["evals"][run_name]
        rows.append(
            dict(
                study=study.name,
                arm=arm.name,
                seed=seed,
                eval=name,
                accuracy=res["accuracy"],
                num_examples=res["num_examples"],
                best_accuracy=res.get("best_accuracy", res["accuracy"]),
                steps=final["step"],
                train_ex_per_s=throughput,
                resolution=res.get("resolution", ""),
                tree=tree,
                cpu=cpu,
            )
        )
    with np.load(os.path.join(workdir, EXAMPLES)) as npz:
        examples = {
            f"{arm.name}/{seed}/{name}": np.asarray(npz[run_name], bool)
            for name, run_name in evals.items()
            if run_name in npz.files
        }
    return rows, examples


def _median_throughput(path: str) -> float:
    values = []
    if os.path.exists(path):
        with open(path) as f:
            values = [json.loads(line).get("throughput") for line in f if line.strip()]
    values = [v for v in values if v]
    return float(np.median(values)) if values else float("nan")


# --------------------------------------------------------------------------- results files


def results_path(study_dir: str) -> str:
    return os.path.join(study_dir, "results.csv")


def read_results(study_dir: str) -> list[dict]:
    """Rows of results.csv with numbers parsed; [] when there is none yet."""
    path = results_path(study_dir)
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row["seed"], row["num_examples"], row["steps"] = (
            int(row["seed"]),
            int(row["num_examples"]),
            int(row["steps"]),
        )
        for key in ("accuracy", "best_accuracy", "train_ex_per_s"):
            row[key] = float(row[key])
        for key in ("tree", "cpu"):  # not recorded before provenance was kept: ""
            row[key] = row.get(key) or ""
    seen = set()
    for row in rows:  # a run recorded twice would count as two seeds in every statistic
        key = (row["arm"], row["seed"], row["eval"])
        if key in seen:
            raise ValueError(f"{path}: arm {key[0]} seed {key[1]} has two {key[2]!r} rows")
        seen.add(key)
    return rows


def read_examples(study_dir: str) -> dict[str, np.ndarray]:
    """``arm/seed/eval`` -> bool per-example results."""
    path = os.path.join(study_dir, "examples.npz")
    if not os.path.exists(path):
        return {}
    out = {}
    with np.load(path) as npz:
        for key in npz.files:
            if key.endswith("/bits"):
                base = key[: -len("/bits")]
                out[base] = np.unpackbits(npz[key], count=int(npz[base + "/n"])).astype(bool)
    return out


def append_results(study_dir: str, rows: list[dict], examples: Mapping[str, np.ndarray]) -> None:
    """Add one run's rows and examples; each file is replaced atomically, results.csv last: a
    run is recorded once its rows are there, so a kill before that leaves it to record again
    (its examples, keyed by run, are then rewritten with the same values)."""
    os.makedirs(study_dir, exist_ok=True)
    recorded = read_results(study_dir)
    keys = {(r["arm"], r["seed"], r["eval"]) for r in recorded}
    again = [k for k in ((r["arm"], int(r["seed"]), r["eval"]) for r in rows) if k in keys]
    if again:
        raise ValueError(f"{results_path(study_dir)} already records {again[0]} (arm, seed, eval)")
    merged = {**read_examples(study_dir), **examples}
    packed = {}
    for key, bits in merged.items():
        packed[f"{key}/bits"] = np.packbits(bits)
        packed[f"{key}/n"] = np.array(len(bits))
    tmp = os.path.join(study_dir, "examples.tmp.npz")
    np.savez_compressed(tmp, **packed)
    os.replace(tmp, os.path.join(study_dir, "examples.npz"))
    _atomic_csv(results_path(study_dir), recorded + rows)


def record_run(study: Study, study_dir: str, arm: Arm, seed: int, workdir: str) -> None:
    """Record the finished run `workdir` (`arm`'s `seed`): its curves (replaced by run, so a
    second call rewrites the same rows), then its examples and results.csv rows."""
    rows, examples = collect(study, arm, seed, workdir)
    curves_csv.record_run(study_dir, study.arm_names, arm.name, seed, workdir, study.evals)
    append_results(study_dir, rows, examples)


def _atomic_csv(path: str, rows: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RESULT_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in sorted(rows, key=lambda r: (r["arm"], r["seed"], r["eval"])):
            writer.writerow({k: _fmt(row[k]) for k in RESULT_COLUMNS})
    os.replace(tmp, path)


POST_HOC_COLUMNS = ("arm", "seed", "eval", "accuracy", "tree", "cpu")


def post_hoc_args(description: str, study: str, argv=None) -> argparse.Namespace:
    """The command line of a post hoc evaluation of ``study``'s finished runs: ``--seeds``
    (comma-separated, parsed to ints), ``--root`` (the runs) and ``--results`` (its folder)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seeds", default="0,1,2", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--root", default=os.path.join(REPO, "workdirs", "studies"))
    parser.add_argument(
        "--results", default=os.path.join(STUDIES_DIR, study), help="the study's results"
    )
    return parser.parse_args(argv)


def post_hoc_row(arm: str, seed: int, eval_name: str, accuracy: float) -> dict:
    """A row of a post hoc evaluation's CSV (trained runs evaluated again another way)."""
    return {
        "arm": arm,
        "seed": seed,
        "eval": eval_name,
        "accuracy": f"{accuracy:.4f}",
        "tree": code_tree(),
        "cpu": cpu_kind(),
    }


def post_hoc_rows_kept(path: str, seeds: Sequence[int]) -> list[dict]:
    """The rows of ``path`` (if it exists) for seeds other than ``seeds``: what a new call
    that evaluates ``seeds`` keeps from earlier ones."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if int(r["seed"]) not in seeds]


def post_hoc_accuracy(forward, config, images, labels, size: int, states_per_batch) -> float:
    """Accuracy on Fashion-MNIST test images (uint8, (N, h, w) or (N, h, w, 1)), resized to
    ``size`` px as the study's px evaluations are (canvases are already that size), 500 a batch,
    each batch with the next of ``states_per_batch`` (cycled): ``forward(x, states)`` gives
    the logits."""
    import jax.numpy as jnp

    from rope_lie import in_memory

    right, batch = 0, 500
    for b, i in enumerate(range(0, len(labels), batch)):
        x = jnp.asarray(images[i : i + batch]).reshape(-1, *images.shape[1:3], 1)
        if x.shape[1] != size:
            x = in_memory.resize(x, size)
        states = states_per_batch[b % len(states_per_batch)]
        logits = forward(in_memory.normalise(x, config.dataset), states)
        right += int((np.asarray(logits).argmax(-1) == labels[i : i + batch]).sum())
    return right / len(labels)


def write_post_hoc(path: str, rows: list[dict]) -> None:
    """Writes ``rows`` sorted by (arm, seed, eval), atomically."""
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=POST_HOC_COLUMNS)
        writer.writeheader()
        writer.writerows(sorted(rows, key=lambda r: (r["arm"], int(r["seed"]), r["eval"])))
    os.replace(tmp, path)


def _fmt(value: Any) -> Any:
    return f"{value:.6g}" if isinstance(value, float) else value


def recorded_elsewhere(
    arm: Arm, seed: int, scale: str, others: Sequence[tuple[Study, str]]
) -> tuple[str, str] | None:
    """(study directory, arm name) of another study that recorded this very run, or None.

    Runs are the same when their workdir names are (``run_dir``: recipe, argument, overrides,
    seed, scale); the root does not matter.
    """
    name = os.path.basename(run_dir("", arm, seed, scale))
    for other, directory in others:
        recorded = {(r["arm"], r["seed"]) for r in read_results(directory)}
        for candidate in other.arms:
            if (
                (candidate.name, seed) in recorded
                and candidate.eval_suffix == arm.eval_suffix
                and os.path.basename(run_dir("", candidate, seed, scale)) == name
            ):
                return directory, candidate.name
    return None


def copy_recorded(
    study: Study, arm: Arm, seed: int, directory: str, source_arm: str
) -> tuple[list[dict], dict]:
    """Rows and per-example results of `source_arm`'s `seed` in `directory`, renamed to this
    study and arm."""
    rows = [
        {**r, "study": study.name, "arm": arm.name}
        for r in read_results(directory)
        if r["arm"] == source_arm and r["seed"] == seed
    ]
    prefix = f"{source_arm}/{seed}/"
    examples = {
        f"{arm.name}/{seed}/{k[len(prefix) :]}": v
        for k, v in read_examples(directory).items()
        if k.startswith(prefix)
    }
    return rows, examples


# --------------------------------------------------------------------------- the runner


def run_study(
    study: Study,
    *,
    seeds: int,
    scale: str,
    root: str,
    study_dir: str,
    dry_run: bool = False,
    extra_flags: Sequence[str] = (),
    arms: Sequence[str] | None = None,
    others: Sequence[tuple[Study, str]] = (),
    jobs: int = 1,
    log=print,
    ensemble: bool = False,
) -> list[tuple[str, int]]:
    """Run every missing (arm, seed) of `study` in order, ``jobs`` at a time.

    Seeds are 0..seeds-1, taken seed-major (every arm's seed 0 before any seed 1), so a study
    cut short still has every arm. A run that one of `others` ((study, its results directory)
    pairs) has recorded is copied from there, not trained again. Each run is recorded as it
    finishes. With `ensemble`, the seeds of an arm still to train are trained together as one
    ``rope_lie.ensemble`` job (each in its own workdir, recorded when the job ends; an arm with
    one such seed runs ``rope_lie.main``). With `dry_run`, the commands are logged instead,
    none when a recipe to train does not build (``recipe_errors``: SystemExit saying why). A
    seed that a stopped ensemble holds trains only as that ensemble (``_check_held``: otherwise
    SystemExit). Returns the (arm, seed) pairs that were run, copied or collected.
    """
    if scale not in ("cpu", "paper"):
        raise ValueError(f"scale={scale!r}; expected 'cpu' or 'paper'")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs={jobs!r}; expected a positive int (runs trained at once)")
    selected = [study.arm(a) for a in arms] if arms else list(study.arms)
    done = {(r["arm"], r["seed"]) for r in read_results(study_dir)}
    todo = [(arm, s) for s in range(seeds) for arm in selected if (arm.name, s) not in done]
    log(f"{study.name}: {len(done)} runs recorded, {len(todo)} to do ({scale} scale)")
    if dry_run:  # commands that would stop at once are not printed as if they could run
        to_train = [a for a, s in todo if recorded_elsewhere(a, s, scale, others) is None]
        unbuilt = recipe_errors(to_train, scale)
        if unbuilt:
            raise SystemExit(f"{study.name} cannot run: " + "; ".join(unbuilt))
    handled = []

    def record(arm: Arm, seed: int, workdir: str) -> None:
        record_run(study, study_dir, arm, seed, workdir)
        handled.append((arm.name, seed))

    to_train: dict[str, _Run] = {}  # by workdir
    group_dry_run = dry_run and ensemble  # the commands are printed once the seeds are grouped
    for arm, seed in todo:
        workdir = run_dir(root, arm, seed, scale)
        cmd = command(arm, seed, scale, workdir, extra_flags)
        source = recorded_elsewhere(arm, seed, scale, others)
        if source is not None:
            rows, examples = copy_recorded(study, arm, seed, *source)
            log(f"{arm.name} seed {seed}: recorded by {source[0]} as {source[1]}")
            if not dry_run:
                append_results(study_dir, rows, examples)
                handled.append((arm.name, seed))
            continue
        if dry_run and not group_dry_run:
            _check_held(_Run("", cmd, [(arm, seed, workdir)]), root, scale)
            if arm.eval_suffix is not None:  # the same run as its base arm's
                log(f"# {arm.name} seed {seed}: the {arm.eval_suffix} evaluations of")
            log(" ".join(cmd))
            continue
        if not dry_run and is_finished(workdir):
            record(arm, seed, workdir)
            continue
        readers = [a.name for a in study.arms if (a.name, seed) in done and same_runs(a, arm)]
        if readers:  # trained again, it would be another model than the one recorded
            raise SystemExit(
                f"{arm.name} seed {seed} reads the run that {readers[0]} seed {seed} was "
                f"recorded from, and {workdir} no longer holds it finished; compare would pair "
                "the two as one model. Restore that workdir (run.py --pack carries runs between "
                f"machines), or remove {readers[0]}'s seed-{seed} rows to train both again"
            )
        if workdir in to_train:  # a tool arm of a run to train: trained once, recorded for each
            to_train[workdir].readers.append((arm, seed, workdir))
        else:
            to_train[workdir] = _Run("", cmd, [(arm, seed, workdir)])
    runs = list(to_train.values())
    if ensemble:
        runs = _ensembles(runs, root, scale, extra_flags)
    runs = [dataclasses.replace(r, label=f"[{k}/{len(runs)}]") for k, r in enumerate(runs, 1)]
    for run in runs:
        _check_held(run, root, scale)
    if group_dry_run:
        for run in runs:
            log(f"# {run}")
            log(" ".join(run.cmd))
        return handled
    _train(runs, jobs, record, log)
    return handled


def _ensembles(runs: list[_Run], root: str, scale: str, extra: Sequence[str]) -> list[_Run]:
    """`runs` with those of one arm (the same run but for the seed) made one ensemble run,
    in the order of each arm's first run; an arm with one run to train keeps it."""
    groups: dict[str, list[_Run]] = {}
    for run in runs:
        arm = run.readers[0][0]
        groups.setdefault(json.dumps(_run_parts(arm, scale, None)), []).append(run)
    out = []
    for members in groups.values():
        if len(members) == 1:
            out.extend(members)
            continue
        arm = members[0].readers[0][0]
        seeds = [m.readers[0][1] for m in members]
        workdirs = [m.readers[0][2] for m in members]
        directory = ensemble_dir(root, arm, seeds, scale)
        cmd = ensemble_command(arm, seeds, scale, workdirs, directory, extra)
        readers = [r for m in members for r in m.readers]
        out.append(_Run("", cmd, readers, ensemble=directory))
    return out


def _check_held(run: _Run, root: str, scale: str) -> None:
    """SystemExit when an ensemble other than `run`'s own holds one of its seeds
    (``ensembles_in_progress``): `run` would restart that seed from step 0 in the workdir the
    ensemble writes, and the ensemble could no longer resume."""
    for arm, seed, _ in run.readers:
        holders = [e for e in ensembles_in_progress(root, arm, scale) if seed in e.held]
        if any(e.path != run.ensemble for e in holders):
            raise SystemExit(_held_message(run, arm, seed, holders))


def _held_message(run: _Run, arm: Arm, seed: int, holders: list[HeldEnsemble]) -> str:
    held = "; ".join(f"{e.path} (seeds {e.seeds}, step {e.step})" for e in holders)
    if len(holders) > 1:
        return (
            f"{arm.name} seed {seed} is part-trained in {len(holders)} seed ensembles: {held}. "
            "They write the same workdirs, so at most one can resume: keep the one that the "
            f"seed's workdir's {ENSEMBLE_JSON} names (the last to write it), remove the others, "
            "then rerun with the kept one's --seeds and --ensemble"
        )
    [e] = holders
    seeds = list(dict.fromkeys(s for _, s, _ in run.readers))
    how = (
        f"as the ensemble of seeds {seeds} ({run.ensemble})"
        if run.ensemble is not None
        else "alone (rope_lie.main)"
    )
    return (
        f"{arm.name} seed {seed} is part-trained in the seed ensemble {held}. This call would "
        f"train it {how}, from step 0 in the workdir that ensemble writes, and an ensemble "
        f"resumes only with the same seeds. Rerun with --ensemble --seeds {max(e.seeds) + 1} "
        f"to finish it, --pack to carry it to another machine, or remove {e.path} to train "
        f"seeds {e.held} afresh"
    )


@dataclasses.dataclass
class _Run:
    """One training job: its log label (``[k/n]``: the k-th of the call's n jobs) and command,
    and the (arm, seed, workdir) triples that read it (the first is the one it is named for).
    A ``rope_lie.main`` run has one workdir; a ``rope_lie.ensemble`` job one per seed."""

    label: str
    cmd: list[str]
    readers: list[tuple[Arm, int, str]]
    ensemble: str | None = None  # a rope_lie.ensemble job's ensemble directory

    @property
    def workdirs(self) -> list[str]:
        return list(dict.fromkeys(w for _, _, w in self.readers))

    def __str__(self) -> str:
        arm = self.readers[0][0]
        seeds = list(dict.fromkeys(s for _, s, _ in self.readers))
        if len(seeds) == 1:
            return f"{self.label} {arm.name} seed {seeds[0]}"
        return f"{self.label} {arm.name} seeds {','.join(map(str, seeds))} (one ensemble)"


def _train(runs: list[_Run], jobs: int, record, log) -> None:
    """Train ``runs``, ``jobs`` at once, recording each as it finishes. A failed run stops the
    rest (SIGTERM: each saves its next step and exits, to be resumed) and raises."""
    env = dict(os.environ)
    if jobs > 1:  # XLA:GPU would give the first process 75 % of the memory
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    pending, running = list(runs), {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                run = pending.pop(0)
                log(f"{run}: {', '.join(run.workdirs)}")
                for workdir in run.workdirs:
                    record_provenance(workdir)
                    if run.ensemble is None and _drop_ensemble_record(workdir):
                        log(f"{workdir}: trained from step 0 alone, no longer in an ensemble")
                proc = subprocess.Popen(run.cmd, cwd=REPO, env=env)
                running[proc] = (run, time.perf_counter())
            proc = _wait_any(running)
            run, start = running.pop(proc)
            if proc.returncode != 0:
                raise subprocess.CalledProcessError(proc.returncode, proc.args)
            log(f"{run}: {time.perf_counter() - start:.0f} s")
            for workdir in run.workdirs:
                if not is_finished(workdir):  # preempted (SIGTERM): the rerun resumes it
                    raise RuntimeError(f"{workdir} stopped before the end; rerun to resume it")
            for arm, seed, workdir in run.readers:
                record(arm, seed, workdir)
    finally:
        for proc in running:
            proc.terminate()
        for proc in running:
            proc.wait()
        for run, _ in running.values():  # finished in their SIGTERM grace: recorded, not lost
            if all(is_finished(w) for w in run.workdirs):
                for arm, seed, workdir in run.readers:
                    record(arm, seed, workdir)


def _drop_ensemble_record(workdir: str) -> bool:
    """Removes `workdir`'s ``ENSEMBLE_JSON`` when the workdir holds no checkpoint of its own
    (``rope_lie.main`` then trains it from step 0, so no ensemble's training is left in it);
    returns whether it did. Kept with a checkpoint: an ensemble member's own checkpoint is its
    final state, which ``rope_lie.main`` only evaluates."""
    path = os.path.join(workdir, ENSEMBLE_JSON)
    if not os.path.exists(path) or newest_step(workdir) is not None:
        return False
    os.remove(path)
    return True


def _wait_any(running: Mapping) -> subprocess.Popen:
    """The first of the running processes to exit (polled every 0.2 s)."""
    while True:
        for proc in running:
            if proc.poll() is not None:
                return proc
        time.sleep(0.2)
