"""The step loop of one training run (``rope_lie/train.py`` sets it up and resumes it).

The loop is given what it runs (``Run``): the jitted train step, a function that reads the
batches from a step on, a function that evaluates, the checkpoint manager and the metrics
writer, and the few numbers it needs (steps, log, evaluation and checkpoint intervals); it
reads no config.

Each step runs in this order: train, check, log, evaluate, checkpoint (the last step is
checkpointed before its evaluations, its log line's training scalars in the checkpoint's meta,
so a run killed while evaluating resumes evaluating and writes the step's ``metrics.jsonl``
record as the uninterrupted run does: ``evaluate_end``). A
non-finite loss or gradient norm stops the run (``FloatingPointError`` naming the step) before
that state can be checkpointed; the last good checkpoint stays the latest. On SIGTERM or a
first Ctrl-C (single process) or a preemption sync point (multi-host jobs) the step is
checkpointed and the run returns early (``rope_lie.main`` exits with status 0, or 130 after
Ctrl-C); rerun it to finish.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh
from tqdm import tqdm

from rope_lie import checkpoint as ckpt
from rope_lie import evaluate, job, metrics, sharding
from rope_lie.job import say

TRAIN_KEYS = (
    "image",
    "label",
    "soft_label",
    *evaluate.TOKEN_KEYS,
    "segment",
    "slot_grid",
    *evaluate.PLACE_KEYS,
)


@dataclasses.dataclass(kw_only=True)
class Run:
    """The pieces of one training run that the loop threads through.

    Attributes:
      workdir: where the run writes (``final.json`` of a non-finite stop).
      train_step: (state, batch, other, dropout_key) -> (state, metrics), jitted, the state
        donated (``train.make_train_step``).
      train_batches: start step -> this process's batches from that step on.
      evaluate: (params, step, best, final) -> name -> results of the evaluations (before the
        last step, those without ``final_only``), per-example "correct" included; updates
        ``best`` (``evaluate.evaluate_all``).
      mesh: the devices the batches are placed on.
      schedule: step -> learning rate, for the log.
      other: the model's non-parameter state (its RNG streams).
      dropout_key: step k's dropout key is ``fold_in(dropout_key, k)``.
      manager: the Orbax checkpoint manager.
      writer: the metrics writer.
      best: name -> best evaluation so far, saved with each checkpoint.
      total, steps_per_epoch, eval_every, log_every, save_every: steps.
      batch_size: examples per global batch, for the throughput.
      optim_cfg: ``config.optim`` (its lr and warmup_steps name the likely cause of a NaN).
      progress: show a progress bar.
      data_shards: the shards each global batch is made of (``run_inputs.data_shards``),
        saved with each checkpoint: a resume that makes its batches otherwise is refused.
      model: ``config.model`` as JSON (``run_config.model_record``), saved with each
        checkpoint: a resume or a load under a model that computes otherwise is refused.
    """

    workdir: str
    train_step: Callable
    train_batches: Callable[[int], Iterator[Mapping[str, Any]]]
    evaluate: Callable[[Any, int, dict, bool], dict[str, dict[str, Any]]]
    mesh: Mesh
    schedule: optax.Schedule
    other: nnx.State
    dropout_key: jax.Array
    manager: Any
    writer: metrics.MetricsWriter
    best: dict
    total: int
    steps_per_epoch: int
    eval_every: int
    log_every: int
    save_every: int
    batch_size: int
    optim_cfg: Mapping[str, Any]
    model: Mapping[str, Any]
    progress: bool = False
    data_shards: int = 1
    correct: dict = dataclasses.field(default_factory=dict)  # last evals' per-example results
    stopped_by: str | None = None  # "SIGTERM", "SIGINT" or "preemption" when stopped early


# The last step's checkpoint meta key of the training scalars of its metrics.jsonl record.
RECORD = "record"


def _meta(run: Run, step: int, record: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A checkpoint's JSON: its step, the best evaluations so far, how its batches were made,
    the model's config; with `record` (the last step's), the training scalars of the step's
    metrics.jsonl record. ``best`` is a copy: Orbax serialises the meta in the background,
    while the evaluations update ``run.best``."""
    meta = {
        "step": step,
        "best": copy.deepcopy(run.best),
        "data_shards": run.data_shards,
        "model": run.model,
    }
    return meta if record is None else {**meta, RECORD: dict(record)}


def check_step(step: int, m: dict, manager, workdir: str, optim_cfg: Any = None) -> None:
    """Stop on a non-finite loss or gradient norm, leaving the last good checkpoint in place and
    writing the step and its metrics to ``final.json`` ("stopped": "non-finite")."""
    if bool(m["finite"]):
        return
    optim_cfg = optim_cfg or {}
    config_lr, warmup = optim_cfg.get("lr", "?"), optim_cfg.get("warmup_steps", "?")
    manager.wait_until_finished()
    bad = {k: float(v) for k, v in m.items() if k != "finite" and jnp.ndim(v) == 0}
    latest = manager.latest_step()
    metrics.write_stopped(workdir, step, bad, latest)
    resume = (
        f"the latest checkpoint is step {latest} (a rerun resumes there)"
        if latest is not None
        else "no checkpoint was saved before it (a rerun starts from step 0)"
    )
    raise FloatingPointError(
        f"Non-finite loss ({float(m['loss'])}) or gradient norm ({float(m['grad_norm'])}) at "
        f"step {step}; stopping. Likely cause: a learning rate too high for this model "
        f"(optim.lr={config_lr}, optim.warmup_steps={warmup}): lower optim.lr or warm up "
        f"longer. This state is not saved; {resume}."
    )


def evals(run: Run, state: Any, step: int, final: bool = True) -> dict[str, dict[str, Any]]:
    """Scalar results of the evaluations (before the last step, those without ``final_only``);
    the per-example ones are kept in run.correct."""
    results = run.evaluate(state["params"], step, run.best, final)
    run.correct = {name: res.pop("correct") for name, res in results.items()}
    job.release_free_heap()  # the evaluation's freed buffers go back to the OS
    return results


def eval_scalars(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The metrics.jsonl fields of evaluations: ``<eval>/<result>`` -> value."""
    return {f"{name}/{key}": value for name, res in results.items() for key, value in res.items()}


def evaluate_end(
    run: Run, state: Any, step: int, record: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """The evaluations of a run restored at its last step (a finished run rerun, or one killed
    in its final evaluations), and the step's metrics.jsonl record where the file has none:
    `record` (the training scalars saved with the step's checkpoint) and these evaluations,
    the record an uninterrupted run writes."""
    results = evals(run, state, step)
    if not run.writer.has(step):
        run.writer.write(step, {**record, **eval_scalars(results)})
    return results


def _log_record(run: Run, step: int, window: list[dict], timed: int, seconds: float) -> dict:
    """Train scalars averaged over the steps since the last log line; throughput over the
    `timed` steps of the last `seconds`."""
    mean = lambda k: sum(float(m[k]) for m in window) / len(window)
    return {
        "loss": mean("loss"),
        "train_accuracy": mean("accuracy"),
        "grad_norm": mean("grad_norm"),
        "lr": float(run.schedule(step - 1)),
        "throughput": timed * run.batch_size / max(seconds, 1e-9),
        "epoch": step / run.steps_per_epoch,
    }


def _checked(run: Run, step: int, m: dict) -> dict:
    """Step ``step``'s metrics on the host, after stopping the run if they are not finite."""
    m = jax.device_get(m)
    check_step(step, m, run.manager, run.workdir, run.optim_cfg)
    return m


def run_steps(run: Run, state: Any, start: int) -> tuple[Any, int, dict | None]:
    """Steps start+1..total: train, check, log, evaluate, checkpoint (in that order)."""
    results, window = None, []
    pbar = tqdm(
        total=run.total,
        initial=start,
        unit="step",
        disable=not run.progress or jax.process_index() != 0,
        dynamic_ncols=True,
        mininterval=1.0,
    )
    batches = run.train_batches(start)

    def next_batch():
        batch = next(batches)
        return sharding.shard_batch({k: batch[k] for k in TRAIN_KEYS if k in batch}, run.mesh)

    tick, timed, step = time.perf_counter(), 0, start
    batch = next_batch() if start < run.total else None
    pending = None  # the previous step's metrics, still on the device
    every_save = run.save_every
    with job.StopOnSigterm() as sigterm:  # a scheduler's notice: save at the next step, stop
        for step in range(start + 1, run.total + 1):
            state, m = run.train_step(state, batch, run.other, run.dropout_key)
            # While step t runs (dispatch is asynchronous): read and place the next batch, then
            # check step t-1's metrics, as nanodo does: host and device work overlap.
            batch = next_batch() if step < run.total else None
            if pending is not None:
                window.append(_checked(run, *pending))
            stop = sigterm.requested  # read once: the save and the stop agree
            preempted = run.manager.reached_preemption(step)
            log = step % run.log_every == 0 or step == run.total
            evaluate_now = step % run.eval_every == 0 or step == run.total
            # Step t's own metrics are waited for only where something depends on them: a log
            # line, an evaluation, or a checkpoint (never save a state whose step went NaN).
            if log or evaluate_now or stop or preempted or step % every_save == 0:
                window.append(_checked(run, step, m))
                pending = None
            else:
                pending = (step, m)
            pbar.update(1)
            timed += 1
            record = {}
            if log:
                record = _log_record(run, step, window, timed, time.perf_counter() - tick)
                pbar.set_postfix(loss=f"{record['loss']:.4f}", ex_s=f"{record['throughput']:.0f}")
                window = []
            last = step == run.total
            if last:  # saved before the final evaluations: an interruption there loses no steps
                ckpt.save(run.manager, step, state, _meta(run, step, record), force=True)
            if evaluate_now:
                pbar.set_description("evaluating")
                results = evals(run, state, step, final=last)
                pbar.set_description("")
                record.update(eval_scalars(results))
            if record:
                run.writer.write(step, record)
            if not last:
                ckpt.save(run.manager, step, state, _meta(run, step), force=stop)
            if stop or preempted:
                run.stopped_by = sigterm.signal_name or "preemption"
                what = "Interrupted (Ctrl-C)" if run.stopped_by == "SIGINT" else "Preemption"
                say(f"{what} at step {step}: checkpoint saved, stopping (rerun to resume).")
                break
            if record or step == start + 1:  # throughput excludes compiling, evaluating, saving
                tick, timed = time.perf_counter(), 0
    pbar.close()
    return state, step, results
