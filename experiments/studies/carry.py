"""Unfinished study runs carried to the next machine through the repository.

A study run can outlast the machine it started on (a 160-epoch Fashion-MNIST run takes about
3 h of a 2-core CPU; workdirs live outside git). ``pack`` writes what the run needs to resume,
its workdir with only the newest checkpoint, into ``<study results>/unfinished/<run>.tar.gz``
(about 2 MB for the Fashion-MNIST ViT), to be committed; ``unpack`` puts it back under the
runs directory of a new machine, where the runner resumes it from that checkpoint as it would
after a kill: the metrics past the checkpoint are rewritten and the provenance says
"+resumed" if the tree or machine changed. ``prune`` drops archives whose run has finished or
is recorded.

    python -m experiments.studies.run fashion_plateau_length --pack   # after stopping the runner

The runner unpacks before it trains and prunes after. Runs of ``rope_lie.main`` only: an
ensemble's stacked checkpoints are not carried.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from collections.abc import Collection

from experiments.studies import lib

UNFINISHED = "unfinished"  # the folder, beside a study's results.csv, of the carried runs
SUFFIX = ".tar.gz"
CHECKPOINTS = "checkpoints"  # rope_lie's checkpoint folder in a workdir, one folder per step


def newest_step(workdir: str) -> int | None:
    """The newest checkpoint step in `workdir` (None without one). Orbax renames a step's
    folder into place once it is written, so a folder named by its step is complete."""
    folder = os.path.join(workdir, CHECKPOINTS)
    if not os.path.isdir(folder):
        return None
    steps = [int(n) for n in os.listdir(folder) if n.isdigit()]
    return max(steps, default=None)


def archive_path(directory: str, workdir: str) -> str:
    return os.path.join(directory, UNFINISHED, os.path.basename(workdir.rstrip("/")) + SUFFIX)


def pack(workdir: str, directory: str) -> tuple[str, int]:
    """Writes `workdir`, its checkpoints but the newest left out, to the archive
    ``archive_path(directory, workdir)`` (atomically); returns the archive and the step."""
    step = newest_step(workdir)
    if step is None:
        raise ValueError(f"{workdir}: no checkpoint to carry (expected {CHECKPOINTS}/<step>)")
    name = os.path.basename(workdir.rstrip("/"))
    keep = os.path.join(name, CHECKPOINTS, str(step))
    older = os.path.join(name, CHECKPOINTS) + os.sep

    def only_newest(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        inside = info.name.startswith(older) and not (
            info.name == keep or info.name.startswith(keep + os.sep)
        )
        return None if inside else info

    path = archive_path(directory, workdir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), suffix=".tmp", delete=False) as f:
        tmp = f.name
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(workdir, arcname=name, filter=only_newest)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path, step


def archived_step(path: str) -> int:
    """The checkpoint step an archive carries."""
    with tarfile.open(path) as tar:
        steps = {
            int(parts[2])
            for parts in (m.name.split("/") for m in tar.getmembers())
            if len(parts) >= 3 and parts[1] == CHECKPOINTS and parts[2].isdigit()
        }
    if len(steps) != 1:
        raise ValueError(f"{path}: carries checkpoint steps {sorted(steps)}; expected one")
    return steps.pop()


def _archives(directory: str) -> list[str]:
    folder = os.path.join(directory, UNFINISHED)
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(SUFFIX))


def unpack(directory: str, runs_dir: str, log=print) -> list[str]:
    """Puts each archive of `directory` under `runs_dir` where the run there is missing or
    behind it (a finished run, or one at the same or a later step, is kept); returns the
    workdirs written."""
    written = []
    for path in _archives(directory):
        workdir = os.path.join(runs_dir, os.path.basename(path)[: -len(SUFFIX)])
        step = archived_step(path)
        here = newest_step(workdir) if os.path.isdir(workdir) else None
        if lib.is_finished(workdir) or (here is not None and here >= step):
            continue
        os.makedirs(runs_dir, exist_ok=True)
        staging = tempfile.mkdtemp(dir=runs_dir, prefix=".unpack-")
        try:
            with tarfile.open(path) as tar:
                tar.extractall(staging, filter="data")
            if os.path.isdir(workdir):
                shutil.rmtree(workdir)
            os.replace(os.path.join(staging, os.path.basename(workdir)), workdir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log(f"carried in: {os.path.basename(workdir)} at step {step} (from {path})")
        written.append(workdir)
    return written


def prune(directory: str, runs_dir: str, recorded: Collection[str] = ()) -> list[str]:
    """Removes the archives of `directory` whose run under `runs_dir` has finished or whose
    workdir name is in `recorded` (runs the results hold, copied from another study's, say);
    returns them."""
    removed = []
    for path in _archives(directory):
        name = os.path.basename(path)[: -len(SUFFIX)]
        if name in recorded or lib.is_finished(os.path.join(runs_dir, name)):
            os.remove(path)
            removed.append(path)
    return removed
