"""Unfinished study runs carried to the next machine through the repository.

A study run can outlast the machine it started on (a 160-epoch Fashion-MNIST run takes about
3 h of a 2-core CPU, and a lent GPU is held for minutes; workdirs live outside git). ``pack``
writes what a run needs to resume into ``<study results>/unfinished/<name>.tar.gz``, to be
committed: its workdir with only the newest checkpoint (about 2 MB for the Fashion-MNIST ViT),
or for a seed ensemble (``rope_lie.ensemble``) the ensemble's directory with its newest stacked
checkpoint and the members' workdirs. ``unpack`` puts it back under the runs directory of a
new machine, where the runner resumes it from that checkpoint as it would after a kill: the
metrics past the checkpoint are rewritten and the provenance says "+resumed" if the tree or
machine changed. ``prune`` drops archives whose runs have finished or are recorded.

    python -m experiments.studies.run fashion_plateau_length --pack   # after stopping the runner

The runner unpacks before it trains and prunes after. An archive holds ``carry.json``
(``{"lead": the directory with the checkpoints, "runs": the runs' workdirs}``) and those
directories, named as under ``<root>/runs/<scale>/``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Collection, Sequence

from experiments.studies import lib

UNFINISHED = "unfinished"  # the folder, beside a study's results.csv, of the carried runs
SUFFIX = ".tar.gz"
MANIFEST = "carry.json"


def _name(path: str) -> str:
    return os.path.basename(path.rstrip("/"))


def archive_path(directory: str, lead: str) -> str:
    return os.path.join(directory, UNFINISHED, _name(lead) + SUFFIX)


def pack(lead: str, directory: str, runs: Sequence[str] | None = None) -> tuple[str, int]:
    """Archives `lead` (the directory with the checkpoints; its newest one only) and `runs`
    (the runs' workdirs, in the same runs directory; default: `lead` itself, a single run) to
    ``archive_path(directory, lead)``, atomically; returns the archive and the step."""
    step = lib.newest_step(lead)
    if step is None:
        raise ValueError(f"{lead}: no checkpoint to carry (expected {lib.CHECKPOINTS}/<step>)")
    runs = [lead] if runs is None else list(runs)
    parent = os.path.dirname(lead.rstrip("/"))
    for run in runs:
        if os.path.dirname(run.rstrip("/")) != parent:
            raise ValueError(f"{run}: not in {parent}, the runs directory of {lead}")
        if not os.path.isdir(run):
            raise ValueError(f"{run}: no such workdir to carry with {lead}")
    manifest = {"lead": _name(lead), "runs": [_name(r) for r in runs]}

    def newest_only(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = info.name.split("/")
        older = len(parts) >= 3 and parts[1] == lib.CHECKPOINTS and parts[2] != str(step)
        return None if older else info

    path = archive_path(directory, lead)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for name in os.listdir(os.path.dirname(path)):  # left by a pack killed mid-write
        if name.endswith(".tmp"):
            os.remove(os.path.join(os.path.dirname(path), name))
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), suffix=".tmp", delete=False) as f:
        tmp = f.name
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            data = json.dumps(manifest).encode()
            info = tarfile.TarInfo(MANIFEST)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            for name in dict.fromkeys([manifest["lead"], *manifest["runs"]]):
                tar.add(os.path.join(parent, name), arcname=name, filter=newest_only)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path, step


def read_manifest(path: str) -> dict:
    """An archive's ``carry.json`` and the checkpoint step its lead carries (``"step"``)."""
    with tarfile.open(path) as tar:
        try:
            manifest = json.load(tar.extractfile(MANIFEST))
        except KeyError:
            raise ValueError(
                f"{path}: no {MANIFEST}; expected an archive written by carry.pack"
            ) from None
        steps = {
            int(parts[2])
            for parts in (m.name.split("/") for m in tar.getmembers())
            if len(parts) >= 3
            and parts[0] == manifest["lead"]
            and parts[1] == lib.CHECKPOINTS
            and parts[2].isdigit()
        }
    if len(steps) != 1:
        raise ValueError(f"{path}: carries checkpoint steps {sorted(steps)}; expected one")
    return {**manifest, "step": steps.pop()}


def _archives(directory: str) -> list[str]:
    folder = os.path.join(directory, UNFINISHED)
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(SUFFIX))


def _finished(runs_dir: str, manifest: dict) -> bool:
    return all(lib.is_finished(os.path.join(runs_dir, r)) for r in manifest["runs"])


def unpack(directory: str, runs_dir: str, log=print) -> list[str]:
    """Puts each archive of `directory` under `runs_dir` where its runs there are missing or
    behind it (finished runs, or a lead at the same or a later step with all its runs, are
    kept); returns the leads written. The lead goes in last, so an unpack cut short is done
    again: its runs are then missing."""
    written = []
    if os.path.isdir(runs_dir):  # staging left by an unpack cut short
        for name in os.listdir(runs_dir):
            if name.startswith(".unpack-"):
                shutil.rmtree(os.path.join(runs_dir, name), ignore_errors=True)
    for path in _archives(directory):
        manifest = read_manifest(path)
        lead = os.path.join(runs_dir, manifest["lead"])
        here = lib.newest_step(lead) if os.path.isdir(lead) else None
        whole = all(os.path.isdir(os.path.join(runs_dir, r)) for r in manifest["runs"])
        if _finished(runs_dir, manifest) or (
            whole and here is not None and here >= manifest["step"]
        ):
            continue
        os.makedirs(runs_dir, exist_ok=True)
        staging = tempfile.mkdtemp(dir=runs_dir, prefix=".unpack-")
        try:
            with tarfile.open(path) as tar:
                tar.extractall(staging, filter="data")
            runs = [r for r in manifest["runs"] if r != manifest["lead"]]
            for name in [*runs, manifest["lead"]]:  # the lead last: it marks the unpack done
                target = os.path.join(runs_dir, name)
                if os.path.isdir(target):
                    shutil.rmtree(target)
                os.replace(os.path.join(staging, name), target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log(f"carried in: {manifest['lead']} at step {manifest['step']} (from {path})")
        written.append(lead)
    return written


def prune(directory: str, runs_dir: str, recorded: Collection[str] = ()) -> list[str]:
    """Removes the archives of `directory` whose runs under `runs_dir` have all finished or
    whose workdir names are all in `recorded` (runs the results hold, copied from another
    study's, say); returns them."""
    removed = []
    for path in _archives(directory):
        manifest = read_manifest(path)
        if set(manifest["runs"]) <= set(recorded) or _finished(runs_dir, manifest):
            os.remove(path)
            removed.append(path)
    return removed


def pack_study(
    study: lib.Study,
    arms: Sequence[lib.Arm],
    seeds: int,
    root: str,
    scale: str,
    directory: str,
    log=print,
) -> list[str]:
    """The runner's ``--pack``: archives the started, unfinished runs of `arms` under `root`:
    each seed ensemble (``--ensemble``) that holds training to resume
    (``lib.ensembles_in_progress``), of whatever seeds, as one archive with its members'
    workdirs, and the other runs of seeds 0..seeds-1 that `directory`'s results do not hold
    yet one by one; returns the archives. Runs of those seeds that finished but are not
    recorded yet (stopped in their final seconds) are recorded first, so that what
    `directory` carries holds them."""
    done = {(r["arm"], r["seed"]) for r in lib.read_results(directory)}
    for arm in arms:
        for seed in range(seeds):
            workdir = lib.run_dir(root, arm, seed, scale)
            if (arm.name, seed) not in done and lib.is_finished(workdir):
                lib.record_run(study, directory, arm, seed, workdir)
                done.add((arm.name, seed))
                log(f"{study.name}: {arm.name} seed {seed} had finished: recorded")
    leads: dict[str, tuple[str, list[str]]] = {}  # lead -> (what, runs): tool arms share runs
    for arm in arms:
        members = set()
        for held in lib.ensembles_in_progress(root, arm, scale):  # of any seeds
            what = f"{arm.name} seeds {','.join(map(str, held.seeds))} (one ensemble)"
            runs = [lib.run_dir(root, arm, s, scale) for s in held.seeds]
            leads.setdefault(held.path, (what, runs))
            members.update(held.seeds)
        for seed in sorted(set(range(seeds)) - members):
            workdir = lib.run_dir(root, arm, seed, scale)
            pending = (arm.name, seed) not in done and not lib.is_finished(workdir)
            if pending and lib.newest_step(workdir) is not None:
                leads.setdefault(workdir, (f"{arm.name} seed {seed}", [workdir]))
    paths = []
    for lead, (what, runs) in leads.items():
        path, step = pack(lead, directory, runs)
        size = f"{os.path.getsize(path) / 2**20:.1f} MiB"
        log(f"{study.name}: {what} carried at step {step}: {path} ({size})")
        paths.append(path)
    if not leads:
        log(f"{study.name}: no unfinished run with a checkpoint under {root}")
    return paths


def prune_study(study: lib.Study, root: str, scale: str, directory: str) -> list[str]:
    """``prune`` of `directory`'s archives against the runs under `root` and the runs its
    results hold."""
    recorded = {
        _name(lib.run_dir(root, study.arm(r["arm"]), r["seed"], scale))
        for r in lib.read_results(directory)
        if r["arm"] in study.arm_names
    }
    return prune(directory, os.path.join(root, "runs", scale), recorded)
