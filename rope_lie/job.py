"""What a training job needs around the loop: processes, signals, and the data it reads.

- ``maybe_initialize_distributed``: ``jax.distributed`` for multi-process jobs (config.distributed);
- ``check_workdir``: a workdir that cannot be written fails before anything is read or trained;
- ``StopOnSigterm``: a scheduler's SIGTERM becomes "checkpoint this step and return";
- ``prepare_data`` / ``data_summary`` / ``prepare_eval_data``: every dataset generated or checked
  before the first step (process 0 first in a multi-process job);
- ``data_train_batches``: this process's share of every global batch (``config.data_shards``);
- ``describe_run``: the run's first two lines (model, data, steps, mesh, processes).
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from typing import Any

import jax
import ml_collections as mc
import numpy as np
from absl import logging
from tqdm import tqdm


def maybe_initialize_distributed(config: mc.ConfigDict) -> None:
    """``jax.distributed.initialize`` for multi-process jobs, once, before any other JAX call.

    Runs when ``config.distributed.coordinator_address`` or ``config.multihost`` is set, or
    ``JAX_COORDINATOR_ADDRESS`` is in the environment. Unset ``config.distributed`` fields are
    left to ``jax.distributed.initialize`` to detect (TPU pods, SLURM, ...). CPU processes
    exchange data with gloo collectives (several processes on one machine, or CPU clusters).
    """
    dist = config.get("distributed") or {}
    address = dist.get("coordinator_address", "")
    if not (address or config.get("multihost") or "JAX_COORDINATOR_ADDRESS" in os.environ):
        return
    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only
    num, pid = dist.get("num_processes", 0), dist.get("process_id", -1)
    jax.distributed.initialize(
        coordinator_address=address or None,
        num_processes=num if num > 0 else None,
        process_id=pid if pid >= 0 else None,
    )
    say(f"jax.distributed: process {jax.process_index()} of {jax.process_count()}")


def check_workdir(workdir: str) -> None:
    """Create `workdir` if needed and write a file in it (and in its ``checkpoints/`` when that
    exists), or raise the OSError naming the path that cannot be written."""
    for path in (workdir, os.path.join(workdir, "checkpoints")):
        if path != workdir and not os.path.isdir(path):
            continue
        try:
            os.makedirs(path, exist_ok=True)
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as e:
            raise type(e)(
                f"workdir {workdir!r}: cannot write in {path!r} ({e.strerror or e}); expected a "
                "directory this job can create files in (checkpoints, metrics, final.json)"
            ) from e


def say(message: str) -> None:
    """Log, and print on process 0 (absl logs at WARNING by default in main)."""
    logging.info(message)
    if jax.process_index() == 0:
        tqdm.write(message)


class StopOnSigterm:
    """While active, SIGTERM (what a pod's or cluster's scheduler sends before preempting)
    sets ``requested`` instead of killing the process: the loop checkpoints the step it is on
    and returns, and a rerun resumes exactly. Installed in single-process runs from the main
    thread only; multi-process jobs get the same from JAX's preemption sync point (the
    checkpoint manager's policy), which keeps every process stopping at the same step.

    In a multi-process job JAX's preemption notifier (C++, installed by
    ``jax.distributed.initialize``) takes SIGTERM; a Python handler here would stop one process
    alone and leave the others waiting in the next collective. Checked by hand, not in the test
    suite: 2 processes x 2 CPU devices (digits:smoke, pico ViT), SIGTERM to process 1 only after
    its step-4 checkpoint: both processes stopped at step 7, saved it jointly and exited with
    status 0. Such a job took 75-100 s to reach step 4 on the 2-core test machine (another
    training job beside it, compilation cache warm), too much for the suite's 8-minute budget;
    tests/test_train.py tests the single-process path and tests/test_multiprocess.py the
    2-process checkpoints."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> StopOnSigterm:
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        del signum, frame
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def data_train_batches(config: mc.ConfigDict, start_step: int):
    """This process's slice of the global batches from `start_step` on (exact resume).

    The global batch is made of ``config.data_shards`` shards (0: one per process), each
    read and shuffled on its own (``tfds.split_for_jax_process`` slices); a process reads
    ``data_shards / process_count`` of them and concatenates. With ``data_shards`` fixed, the
    batches do not depend on how many processes run the job, so a checkpoint resumes on another
    topology with the same data, and a 1-process run reproduces a multi-process one.
    """
    from rope_lie.data import pipeline  # TensorFlow is imported only when data is read

    processes, index = jax.process_count(), jax.process_index()
    shards = config.get("data_shards", 0) or processes
    if shards < processes or shards % processes:
        raise ValueError(
            f"data_shards={shards} must be a multiple of the {processes} processes of the job"
        )
    per_process = shards // processes
    iterators = [
        pipeline.make_train_iterator(
            config.dataset,
            batch_size=config.batch_size,
            seed=config.seed,
            start_step=start_step,
            process_index=shard,
            process_count=shards,
        )
        for shard in range(index * per_process, (index + 1) * per_process)
    ]
    if len(iterators) == 1:
        return iterators[0]
    return (
        {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
        for batches in zip(*iterators, strict=True)
    )


def prepare_data(config: mc.ConfigDict) -> int:
    """Generate (local builders) or check every dataset of the run; returns the train size.

    In a multi-process job process 0 does it first and the others wait at a barrier of the
    coordination service (not a device collective, whose rendezvous times out after 30 s
    while a dataset is being generated), then only read what it wrote.
    """

    def prepare() -> int:
        num_train = data_summary(config)["num_train_examples"]
        prepare_eval_data(config)
        return num_train

    if jax.process_count() == 1:
        return prepare()
    if jax.process_index() == 0:
        prepare()
    from jax._src import distributed  # the coordination service's client (jax.distributed)

    distributed.global_state.client.wait_at_barrier("rope_lie_datasets", 3_600_000)
    return prepare()


def data_summary(config: mc.ConfigDict) -> dict[str, Any]:
    """Train split size, classes and example shape; checks them against config.model."""
    from rope_lie.data import pipeline

    summary = pipeline.dataset_summary(config.dataset)
    *spatial, channels = summary["example_shape"]
    expected = (tuple(spatial), channels, summary["num_classes"])
    model = config.model
    actual = (tuple(model.image_shape), model.channels, model.num_classes)
    if expected != actual:
        raise ValueError(
            f"config.model (image_shape, channels, num_classes)={actual} does not match "
            f"dataset {config.dataset.name!r} (image_size={config.dataset.image_size}): {expected}"
        )
    return summary


def prepare_eval_data(config: mc.ConfigDict) -> None:
    """Every dataset of ``config.evals`` prepared (ours generated, catalogue ones checked)."""
    from rope_lie.data import catalog

    names = {entry.name or config.dataset.name for entry in config.evals.values()}
    for name in sorted(names):
        catalog.prepare(name, config.dataset.data_dir)


def describe_run(config: mc.ConfigDict, abstract_state, mesh, total: int, num_train: int) -> str:
    """What is trained, on which data and mesh, for how long: the run's first two lines."""
    m = config.model
    num_params = sum(x.size for x in jax.tree.leaves(abstract_state["params"]))
    pe = m.get("pe", "nope") + (f" {dict(m.pe_hparams)}" if m.get("pe_hparams") else "")
    if m.get("additive", "none") != "none":
        pe += f" + {m.additive}"
    devices = mesh.devices.flatten()
    kinds = "/".join(sorted({d.platform for d in devices}))
    processes = jax.process_count()
    axes = " x ".join(f"{k}={v}" for k, v in mesh.shape.items())
    return (
        f"Training ViT {m.variant} ({num_params:,} parameters; pe={pe}, "
        f"{m.get('position_convention', 'integer')} positions) on {config.dataset.name} "
        f"({num_train:,} training examples)\n"
        f"{total} steps of {config.batch_size} examples "
        f"({total * config.batch_size / num_train:.1f} epochs) on a {axes} mesh of "
        f"{len(devices)} {kinds} device{'s' * (len(devices) > 1)} in {processes} "
        f"process{'es' * (processes > 1)}"
    )
