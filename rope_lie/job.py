"""What a training job needs around the loop: processes, signals, its first lines.

(The data a run reads is ``rope_lie/run_inputs.py``.)

- ``maybe_initialize_distributed``: ``jax.distributed`` for multi-process jobs (config.distributed);
- ``check_workdir``: a workdir that cannot be written fails before anything is read or trained;
- ``StopOnSigterm``: a scheduler's SIGTERM or a first Ctrl-C (SIGINT) becomes "checkpoint this
  step and return";
- ``describe_run``: the run's first two lines (model, data, steps, mesh, processes);
- ``release_free_heap``: hand the C heap's free pages back to the OS after an evaluation.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import tempfile
import threading
from typing import TYPE_CHECKING, Any

import jax
from absl import logging
from tqdm import tqdm

if TYPE_CHECKING:
    import ml_collections as mc


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
    and returns, and a rerun resumes exactly. A first SIGINT (Ctrl-C) does the same and sets
    ``signal_name`` to "SIGINT" (``rope_lie.main`` then exits with status 130 once the
    checkpoint is written); a second SIGINT raises ``KeyboardInterrupt`` at once. Installed in
    single-process runs from the main thread only; multi-process jobs get the same from JAX's
    preemption sync point (the checkpoint manager's policy), which keeps every process stopping
    at the same step.

    In a multi-process job JAX's preemption notifier (C++, installed by
    ``jax.distributed.initialize``) takes SIGTERM; a Python handler here would stop one process
    alone and leave the others waiting in the next collective. That path is checked by hand,
    not in the test suite (a 2-process job takes over a minute to reach a checkpoint on 2
    cores): run 2 processes x 2 CPU devices on ``digits:smoke`` and send SIGTERM to process 1
    only after its step-4 checkpoint; both processes stop at the same later step, save it
    jointly and exit with status 0. tests/test_train.py tests the single-process path and
    tests/test_multiprocess.py the 2-process checkpoints."""

    def __init__(self):
        self.requested = False
        self.signal_name: str | None = None  # the first signal received: "SIGTERM" or "SIGINT"
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSigterm:
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        del frame
        if signum == signal.SIGINT and self.signal_name == "SIGINT":
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, without saving
        if signum == signal.SIGINT:
            tqdm.write(
                "Ctrl-C: saving a checkpoint at the next step, then stopping "
                "(Ctrl-C again to stop at once, without saving)."
            )
        self.signal_name = self.signal_name or signal.Signals(signum).name
        self.requested = True

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            if previous is not None:  # None: a handler not installed from Python
                signal.signal(signum, previous)
        self._previous = {}


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


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None


def release_free_heap() -> bool:
    """Give the free pages of the C heap back to the OS (glibc ``malloc_trim(0)``).

    An evaluation allocates and frees large temporary buffers (activations of eval batches at
    several resolutions, input pipelines) and glibc keeps the freed pages in its arenas, which
    grow over repeated evaluations while the bytes in use stay flat. The loop calls this after
    each evaluation: it lowers the quickstart's resident memory during training
    (experiments/README.md, memory soak, has the figure). Returns whether memory was released; False
    where the C library is not glibc (its allocator is another; nothing to do here).
    """
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
