r"""Seed ensembles: the S seeds of one arm trained in one program, each written as its own run.

    python -m rope_lie.ensemble --config=configs/fashion_mnist.py:pe=ape,input=memory \
        --seeds=0,1,2 --workdirs=runs/s0,runs/s1,runs/s2 --ensemble_dir=runs/ens

A tiny ViT on an accelerator is bound by per-step overhead (kernel launches, Python), so one
process per seed leaves the device idle. Here the seeds of one arm share each launch, and each
member's results are written where and as ``python -m rope_lie.main`` writes a run's, so the
study tools (``experiments/studies/lib.py``'s ``collect``, ``rope_lie.load``) read them
unchanged.

Design:

- **Members**: configs that differ only in ``seed`` and ``data_seed`` (``check_members``
  names the first other field that differs), ``input="memory"`` only. Each member's config is
  checked and prepared by the single run's own ``train._prepare`` in its workdir.
- **State**: the members' train states ``{"params", "opt_state", "step"}`` stacked leaf by
  leaf (a leading seed axis S on every leaf), with the members' shardings behind that axis.
  Member k starts from ``init(init_key_k)`` and is stepped with ``dropout_key_k``, where
  ``(init_key_k, dropout_key_k) = split(key(seed_k))`` exactly as ``train._train`` derives
  them; the model's RNG-stream state (``other``) is stacked too.
- **Step**: ``jax.jit(jax.vmap(train.make_train_step(setup)), donate_argnums=0)``: the run's
  own jitted step, vmapped; ``train.py`` is unchanged.
- **Input**: the training examples held on the device once; the host computes the members'
  example indices (``in_memory.batch_indices`` of each data seed) ``DEVICE_CHUNK`` steps at
  a time, and one jitted call per step of ``in_memory.batch_maker``, the single run's batch,
  vmapped, gathers, crops, flips and normalises them with the keys
  ``fold_in(in_memory.augment_key(data_seed_k), step)`` (``device_batches``): member k's
  batch t is run k's batch t.
- **Loop** (``_run_steps``, the order of ``loop.run_steps``): train, check, log, evaluate,
  checkpoint. Each member's ``metrics.jsonl`` gets the single run's record fields
  (``loop._log_record``; ``throughput`` is the member's: batch size x ensemble steps/s). A
  non-finite loss or gradient norm of any member stops the ensemble (``FloatingPointError``
  naming the seed; that member's ``final.json`` says "stopped" and names the ensemble's last
  good checkpoint): one program cannot drop a member.
- **Evaluations**: per member, on its slice of the parameters, through the single run's
  ``loop.evals`` and ``train._make_run`` (its evaluation seed ``config.seed`` and its own
  ``best``), so ``final.json`` and ``eval_examples.npz`` have the single run's fields; the
  members share one compiled evaluation step.
- **Checkpoints**: the stacked state in ``ensemble_dir/checkpoints`` (``rope_lie.checkpoint``,
  every ``config.checkpoint.every_steps``), meta ``{"step", "best": [per member], "seeds",
  "model"}``, at the last step with ``"records"``: per member, the training scalars of its last
  ``metrics.jsonl`` record. A rerun with the same arguments resumes from the latest (each
  member's ``metrics.jsonl`` cut after it); a different seed set is refused, naming both. A
  rerun at the last step re-evaluates the members and writes each one's last record where its
  ``metrics.jsonl`` has none (the ensemble was killed in its final evaluations), as the
  uninterrupted ensemble writes it (``loop.evaluate_end``). At the last step each member's
  own state is saved in ``workdir/checkpoints/<total>/`` (meta ``{"step", "best", "model",
  "record"}``, as a single run's), so ``rope_lie.load(workdir)`` and a rerun of
  ``rope_lie.main`` on the workdir (which only re-evaluates a finished state) work. Each
  workdir also gets the resolved ``config.json``/``config.py`` and ``ensemble.json``
  (``{"seeds", "dir"}``).

A member equals its single run only to float32 rounding (the vmapped program is not the
single step's: 2e-6 in the parameters after 3 steps), so over a long schedule the two drift
apart: a seed trained in an ensemble is not bit-reproducible by ``rope_lie.main``, and it
resumes only as the same ensemble (same seeds, same ensemble_dir).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections as mc
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from rope_lie import checkpoint as ckpt
from rope_lie import config_check, errors, in_memory, job, loop, metrics, sharding, train
from rope_lie.config_lib import data_seed
from rope_lie.job import say

MEMBER_FIELDS = ("seed", "data_seed")  # the fields in which an ensemble's members may differ
DEVICE_CHUNK = 64  # steps of example indices computed on the host and sent at once
ENSEMBLE_JSON = "ensemble.json"  # in each member's workdir: the ensemble it was trained in
_MISSING = object()


# --------------------------------------------------------------------------- members


def member_config(
    config: mc.ConfigDict, seed: int, data_seed_: int | None | object = _MISSING
) -> mc.ConfigDict:
    """`config` with ``seed`` set (and ``data_seed``, when given; else kept: None follows the
    seed)."""
    out = mc.ConfigDict(config.to_dict())
    out.seed = seed
    if data_seed_ is not _MISSING:
        out.data_seed = data_seed_
    return out


def run_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """(init_key, dropout_key) of a run with this seed, as ``rope_lie.train._train`` splits them."""
    init_key, dropout_key = jax.random.split(jax.random.key(seed))
    return init_key, dropout_key


def _flat(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def check_members(configs: Sequence[mc.ConfigDict], workdirs: Sequence[str]) -> None:
    """Raise ValueError unless `configs` are the seeds of one arm: the same config but for
    ``seed`` and ``data_seed``, distinct seeds, one workdir each, ``input="memory"``."""
    if not configs:
        raise ValueError("an ensemble needs at least one member (--seeds)")
    if len(workdirs) != len(configs):
        raise ValueError(f"{len(configs)} seeds but {len(workdirs)} workdirs; expected one each")
    if len(set(map(os.path.abspath, workdirs))) != len(workdirs):
        raise ValueError(f"workdirs {list(workdirs)} repeat a directory; expected one per seed")
    seeds = [c.seed for c in configs]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds {seeds} repeat a seed; an ensemble's members are distinct seeds")
    first = dict(_flat(configs[0].to_dict()))
    for c in configs[1:]:
        other = dict(_flat(c.to_dict()))
        for key in sorted(first.keys() | other.keys()):
            a, b = first.get(key, _MISSING), other.get(key, _MISSING)
            if key not in MEMBER_FIELDS and a != b:
                show = lambda v: "absent" if v is _MISSING else repr(v)
                raise ValueError(
                    f"config.{key} differs between the members of seed {seeds[0]} ({show(a)}) "
                    f"and seed {c.seed} ({show(b)}); an ensemble trains the seeds of one arm: "
                    f"its members may differ only in {' and '.join(MEMBER_FIELDS)}"
                )
    source = configs[0].get("input", "tfds")
    if source != "memory":
        raise ValueError(
            f"input={source!r}: an ensemble reads its batches on the device from the in-memory "
            "input; set input='memory' (configs/fashion_mnist.py:...,input=memory)"
        )
    if configs[0].get("init_from"):
        raise ValueError("init_from: an ensemble starts from its seeds' own initialisations")
    if jax.process_count() != 1:
        raise ValueError(f"{jax.process_count()} processes: an ensemble runs in one process")


# --------------------------------------------------------------------------- stacking


def stack(trees: Sequence[Any]) -> Any:
    """Pytrees of one structure -> one pytree whose leaves have a leading axis of len(trees)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack(tree: Any, k: int) -> Any:
    """Member k of a stacked pytree."""
    return jax.tree.map(lambda x: x[k], tree)


def stacked_shardings(shardings: Any) -> Any:
    """A member's NamedShardings -> the stacked tree's: the seed axis whole, the rest as the
    member's."""
    return jax.tree.map(lambda s: NamedSharding(s.mesh, P(None, *s.spec)), shardings)


def stacked_sharding(mesh) -> NamedSharding:
    """A stacked (S, B, ...) batch's: the seed axis whole, the examples split as a run's."""
    return stacked_shardings(sharding.batch_sharding(mesh))


def make_ensemble_step(setup: train.Setup) -> Callable:
    """Jitted (state_S, batch_S, other_S, dropout_key_S) -> (state_S, metrics_S): the run's
    train step (``train.make_train_step``) vmapped over a leading seed axis of every argument;
    the stacked state is donated."""
    return jax.jit(jax.vmap(train.make_train_step(setup)), donate_argnums=(0,))


# --------------------------------------------------------------------------- device input


def num_train(config: mc.ConfigDict) -> int:
    """The run's number of training examples. Not cheap: ``in_memory.train_arrays`` copies the
    training set onto its canvas at every call (5 ms for Fashion-MNIST on this CPU), so it is
    read once per member, not once per member and step."""
    return len(in_memory.train_arrays(config.dataset)[1])


def member_indices(
    configs: Sequence[mc.ConfigDict],
    start: int,
    count: int,
    nums: Sequence[int] | None = None,
) -> np.ndarray:
    """int32 (count, S, B): the example indices of steps start..start+count-1 of every member
    (``in_memory.batch_indices`` of its data seed), computed seed by seed so that each epoch's
    permutation is drawn once per chunk. `nums`: the members' training-set sizes (None: read
    here, once per member)."""
    nums = [num_train(c) for c in configs] if nums is None else nums
    per_seed = [
        [
            in_memory.batch_indices(data_seed(c), t, c.batch_size, num)
            for t in range(start, start + count)
        ]
        for c, num in zip(configs, nums, strict=True)
    ]
    return np.asarray(per_seed, np.int32).transpose(1, 0, 2)


def make_device_input(configs: Sequence[mc.ConfigDict], mesh) -> Callable:
    """Jitted (index_SB, step) -> the stacked batch of `step`, made on the device.

    The members' training examples are held on the device once; member k's batch is a single
    run's (``in_memory.batch_maker``, augmentation key fold_in(augment_key(data_seed), step)),
    vmapped over the members: one dispatch per step, not one per member. The members must share
    the dataset and augmentation (seeds of one arm).
    """
    ds = configs[0].dataset
    if any(c.dataset.to_dict() != ds.to_dict() for c in configs):
        raise ValueError("the members' config.dataset differ; an ensemble is one arm's seeds")
    images, labels = in_memory.train_arrays(ds)
    keys_S = jnp.stack([in_memory.augment_key(data_seed(c)) for c in configs])
    member = in_memory.batch_maker(ds)
    # the examples are arguments, not constants folded into the program
    members = jax.jit(
        jax.vmap(member, in_axes=(None, None, 0, 0, None)), out_shardings=stacked_sharding(mesh)
    )
    return functools.partial(members, jnp.asarray(images), jnp.asarray(labels), keys_S)


def device_batches(
    configs: Sequence[mc.ConfigDict],
    mesh,
    start: int = 0,
    chunk: int = DEVICE_CHUNK,
    make: Callable | None = None,
) -> Iterator[dict[str, jax.Array]]:
    """Stacked batches from step `start` on, made by ``make_device_input`` from indices
    computed `chunk` steps at a time and sent to the device once per chunk. `make`: that
    function of these configs, to share one compiled program between streams (None: a new one,
    compiled on its first batch)."""
    make = make_device_input(configs, mesh) if make is None else make
    nums = [num_train(c) for c in configs]
    for first in itertools.count(start, chunk):
        index_CSB = jnp.asarray(member_indices(configs, first, chunk, nums))
        for i in range(chunk):
            yield make(index_CSB[i], first + i)


# --------------------------------------------------------------------------- training


@dataclasses.dataclass(kw_only=True)
class _Ensemble:
    """What the ensemble's loop threads through: per member, its seed, its ``loop.Run`` (its
    workdir, writer, evaluations, best, schedule) and its own checkpoint manager; shared, the
    vmapped step, the stacked RNG state and dropout keys, the batches and the stacked
    checkpoints' manager."""

    seeds: list[int]
    runs: list[loop.Run]
    member_managers: list[Any]
    member_shardings: Any
    step: Callable
    batches: Callable[[int], Iterator[dict[str, jax.Array]]]
    other: Any
    dropout_keys: jax.Array
    manager: Any
    directory: str
    total: int
    eval_every: int
    log_every: int
    save_every: int
    progress: bool
    stopped_by: str | None = None

    def meta(self, step: int, records: Sequence[Mapping[str, Any]] | None = None) -> dict:
        """A stacked checkpoint's JSON: its step, each member's best evaluations (copies: saved
        in the background), the seeds, the members' (one) model config; with `records` (the last
        step's), per member the training scalars of its metrics.jsonl record of the step."""
        best = [copy.deepcopy(r.best) for r in self.runs]
        meta = {"step": step, "best": best, "seeds": self.seeds, "model": self.runs[0].model}
        return meta if records is None else {**meta, "records": [dict(r) for r in records]}


def train_ensemble(
    configs: Sequence[mc.ConfigDict], workdirs: Sequence[str], ensemble_dir: str
) -> list[dict[str, Any]]:
    """Train (or resume) the members `configs` (seeds of one arm) together, each written to
    its workdir as ``rope_lie.main`` writes a run; the stacked checkpoints go to
    ``ensemble_dir/checkpoints``.

    Returns:
      per member, what ``train.train_and_evaluate`` returns: its final.json content, or
      {"step", "preempted": True, "signal"} when stopped early.
    """
    configs, workdirs = list(configs), [os.fspath(w) for w in workdirs]
    with errors.user_errors():
        check_members(configs, workdirs)
        from rope_lie import run_config  # ml_collections (the train extra)

        stacked = os.path.join(os.fspath(ensemble_dir), "checkpoints")
        for c, w in zip(configs, workdirs, strict=True):
            config_check.validate(c)
            run_config.check_resume(w, c)  # a member's own finished run of another config
            run_config.check_resume(w, c, checkpoints=stacked)  # the ensemble resumed
        mesh = sharding.make_mesh(configs[0].mesh)
    with jax.set_mesh(mesh):
        return _train(configs, workdirs, os.fspath(ensemble_dir), mesh)


def _restore(
    manager, abstract: Any, seeds: list[int], model_cfg: mc.ConfigDict
) -> tuple[int, Any, dict] | None:
    """The latest stacked checkpoint, after checking that it holds these seeds (its meta read
    first, so that another seed set is named rather than failing on the shapes) and a model
    that computes as `model_cfg` does (``run_config.check_model``)."""
    latest = manager.latest_step()
    if latest is not None:
        args = ocp.args.Composite(**{ckpt.META: ocp.args.JsonRestore()})
        try:
            meta = dict(manager.restore(latest, args=args)[ckpt.META])
        except Exception as e:  # an unreadable step: restore_latest sets it aside, falls back
            if ckpt.unreadable_reason(e) is None:
                raise
        else:
            _check_seeds(manager, latest, meta, seeds)
    restored = ckpt.restore_latest(manager, abstract)
    if restored is not None:
        from rope_lie import run_config  # ml_collections (the train extra)

        _check_seeds(manager, restored[0], restored[2], seeds)
        where = f"The stacked checkpoint at step {restored[0]} in {manager.directory}"
        run_config.check_model(restored[2].get("model"), model_cfg, where)
    return restored


def _check_seeds(manager, step: int, meta: dict, seeds: list[int]) -> None:
    saved = meta.get("seeds")
    if saved != seeds:
        raise ValueError(
            f"{manager.directory} holds the ensemble of seeds {saved} (step {step}), not "
            f"of seeds {seeds}; a stacked checkpoint resumes only as the same ensemble: "
            "use another ensemble_dir for these seeds"
        )


def _train(configs, workdirs, ensemble_dir, mesh) -> list[dict[str, Any]]:
    seeds = [c.seed for c in configs]
    prepared = [train._prepare(c, w, mesh) for c, w in zip(configs, workdirs, strict=True)]
    p0 = prepared[0]
    with errors.user_errors():
        for p, w in zip(prepared, workdirs, strict=True):
            stray = [s for s in p.manager.all_steps() if s != p.total]
            if stray:
                raise ValueError(
                    f"workdir {w!r} has checkpoints at steps {stray}: a single run's; an "
                    "ensemble member's workdir holds only its final state. Finish it with "
                    "rope_lie.main, or give the ensemble another workdir"
                )
        job.check_workdir(ensemble_dir)
        manager = ckpt.make_manager(
            os.path.join(ensemble_dir, "checkpoints"), **configs[0].checkpoint
        )
        shardings = stacked_shardings(p0.setup.state_shardings)
        abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct((len(seeds), *a.shape), a.dtype, sharding=s),
            p0.abstract_state,
            shardings,
        )
        restored = _restore(manager, abstract, seeds, configs[0].model)
    from rope_lie import run_config  # ml_collections (the train extra): not needed by the steps

    for c, w in zip(configs, workdirs, strict=True):
        run_config.write(w, c)
        with open(os.path.join(w, ENSEMBLE_JSON), "w") as f:
            json.dump({"seeds": seeds, "dir": os.path.abspath(ensemble_dir)}, f)
    keys = [run_keys(s) for s in seeds]
    if restored is None:
        members = [p0.init(init_key) for init_key, _ in keys]  # one compile for every member
        state = jax.device_put(stack([s for s, _ in members]), shardings)
        others = [o for _, o in members]
        start, best = 0, [{} for _ in seeds]
        records = [{} for _ in seeds]  # the last step's training scalars, where restarted there
    else:
        start, state, meta = restored
        others = [p0.init_other(init_key) for init_key, _ in keys]
        best = list(meta["best"])
        records = list(meta.get("records") or [{} for _ in seeds])
        if start >= p0.total:
            say(f"{ensemble_dir}: already at step {start}; evaluating its members' final states")
        else:
            say(f"Resuming the ensemble of seeds {seeds} from step {start} of {p0.total}")
    say(job.describe_run(configs[0], p0.abstract_state, mesh, p0.total, p0.num_train))
    say(f"Ensemble of {len(seeds)} seeds {seeds}, checkpoints in {ensemble_dir}")
    writers = [
        metrics.MetricsWriter(w, start_step=start, tensorboard=c.tensorboard)
        for c, w in zip(configs, workdirs, strict=True)
    ]
    # one evaluation step for every member (compiled once per resolution): it evaluates with
    # train=False, so it does not read the members' RNG streams (`other`)
    eval_step = train.make_eval_fn(p0.setup, others[0])
    runs = [
        train._make_run(c, w, p, o, dropout_key, writer, b, eval_step)
        for c, w, p, o, (_, dropout_key), writer, b in zip(
            configs, workdirs, prepared, others, keys, writers, best, strict=True
        )
    ]
    make = make_device_input(configs, mesh)
    ens = _Ensemble(
        seeds=seeds,
        runs=runs,
        member_managers=[p.manager for p in prepared],
        member_shardings=p0.setup.state_shardings,
        step=make_ensemble_step(p0.setup),
        batches=lambda first: device_batches(configs, mesh, first, make=make),
        other=stack(others),
        dropout_keys=jnp.stack([d for _, d in keys]),
        manager=manager,
        directory=ensemble_dir,
        total=p0.total,
        eval_every=p0.eval_every,
        log_every=configs[0].log_every_steps,
        save_every=configs[0].checkpoint.every_steps,
        progress=configs[0].progress,
    )
    try:
        state, step, results = _run_steps(ens, state, start)
        if results is None and step >= ens.total:  # resumed at the end: evaluate the members
            _save_members(ens, state, step, records)
            results = [_evaluate_end(ens, state, step, k, records[k]) for k in range(len(seeds))]
    finally:
        for m in [manager, *ens.member_managers]:
            m.wait_until_finished()
            m.close()
        for writer in writers:
            writer.close()
    if step < ens.total:  # stopped early: the checkpoint is saved, the rerun finishes
        return [{"step": step, "preempted": True, "signal": ens.stopped_by} for _ in seeds]
    finals = []
    for run, res in zip(ens.runs, results, strict=True):
        metrics.write_examples(run.workdir, run.correct)
        finals.append(metrics.write_final(run.workdir, step, res))
    return finals


def _member_state(ens: _Ensemble, state: Any, k: int) -> Any:
    """Member k's train state, placed as a single run's."""
    return jax.device_put(unstack(state, k), ens.member_shardings)


def _save_members(
    ens: _Ensemble, state: Any, step: int, records: Sequence[Mapping[str, Any]]
) -> None:
    """Each member's final state in its workdir's checkpoints (meta as a single run's last:
    its step, best and the training scalars of its last record, `records[k]`), unless it is
    there already (a rerun of a finished ensemble)."""
    for k, (run, manager) in enumerate(zip(ens.runs, ens.member_managers, strict=True)):
        manager.wait_until_finished()
        if manager.latest_step() != step:
            member = _member_state(ens, state, k)
            meta = {
                "step": step,
                "best": copy.deepcopy(run.best),
                "model": run.model,
                loop.RECORD: dict(records[k]),
            }
            ckpt.save(manager, step, member, meta, force=True)


def _member_params(ens: _Ensemble, state: Any, k: int) -> dict[str, Any]:
    """``{"params": member k's parameters}``, placed as a single run's."""
    params = jax.device_put(unstack(state["params"], k), ens.member_shardings["params"])
    return {"params": params}


def _evals(ens: _Ensemble, state: Any, step: int, k: int, final: bool = True) -> dict:
    """Member k's evaluations on its slice of the parameters: the single run's ``loop.evals``."""
    return loop.evals(ens.runs[k], _member_params(ens, state, k), step, final=final)


def _evaluate_end(ens: _Ensemble, state: Any, step: int, k: int, record: Mapping[str, Any]) -> dict:
    """Member k's evaluations at the last step, restarted there, and its record of the step
    where its metrics.jsonl has none: the single run's ``loop.evaluate_end``."""
    return loop.evaluate_end(ens.runs[k], _member_params(ens, state, k), step, record)


def _member(m: Mapping[str, Any], k: int) -> dict[str, Any]:
    return {name: value[k] for name, value in m.items()}


def _checked(ens: _Ensemble, step: int, m: dict) -> dict:
    """Step ``step``'s stacked metrics on the host, after stopping the ensemble if a member's are
    not finite (its final.json says so, naming the ensemble's latest checkpoint)."""
    m = jax.device_get(m)
    for k, run in enumerate(ens.runs):
        try:
            loop.check_step(step, _member(m, k), ens.manager, run.workdir, run.optim_cfg)
        except FloatingPointError as e:
            raise FloatingPointError(
                f"Ensemble member seed {ens.seeds[k]} ({run.workdir}): {e} The other seeds "
                f"{[s for s in ens.seeds if s != ens.seeds[k]]} stop with it (one program)."
            ) from e
    return m


def _run_steps(ens: _Ensemble, state: Any, start: int) -> tuple[Any, int, list | None]:
    """Steps start+1..total of every member: train, check, log, evaluate, checkpoint (the order
    of ``loop.run_steps``)."""
    results, window = None, []
    pbar = tqdm(
        total=ens.total,
        initial=start,
        unit="step",
        desc=f"{len(ens.seeds)} seeds",
        disable=not ens.progress,
        dynamic_ncols=True,
        mininterval=1.0,
    )
    batches = ens.batches(start)
    tick, timed, step = time.perf_counter(), 0, start
    batch = next(batches) if start < ens.total else None
    pending = None  # the previous step's metrics, still on the device
    with job.StopOnSigterm() as sigterm:
        for step in range(start + 1, ens.total + 1):
            state, m = ens.step(state, batch, ens.other, ens.dropout_keys)
            batch = next(batches) if step < ens.total else None
            if pending is not None:
                window.append(_checked(ens, *pending))
            stop = sigterm.requested  # read once: the save and the stop agree
            preempted = ens.manager.reached_preemption(step)
            log = step % ens.log_every == 0 or step == ens.total
            evaluate_now = step % ens.eval_every == 0 or step == ens.total
            if log or evaluate_now or stop or preempted or step % ens.save_every == 0:
                window.append(_checked(ens, step, m))
                pending = None
            else:
                pending = (step, m)
            pbar.update(1)
            timed += 1
            records = [{} for _ in ens.runs]
            if log:
                seconds = time.perf_counter() - tick
                records = [
                    loop._log_record(run, step, [_member(w, k) for w in window], timed, seconds)
                    for k, run in enumerate(ens.runs)
                ]
                losses = " ".join(f"{r['loss']:.4f}" for r in records)
                pbar.set_postfix(loss=losses, ex_s=f"{records[0]['throughput']:.0f}")
                window = []
            last = step == ens.total
            if last:  # saved before the final evaluations: an interruption there loses no steps
                ckpt.save(ens.manager, step, state, ens.meta(step, records), force=True)
                _save_members(ens, state, step, records)
            if evaluate_now:
                pbar.set_description("evaluating")
                results = [_evals(ens, state, step, k, final=last) for k in range(len(ens.runs))]
                pbar.set_description(f"{len(ens.seeds)} seeds")
                for record, res in zip(records, results, strict=True):
                    record.update(loop.eval_scalars(res))
            for run, record in zip(ens.runs, records, strict=True):
                if record:
                    run.writer.write(step, record)
            if not last:
                ckpt.save(ens.manager, step, state, ens.meta(step), force=stop)
            if stop or preempted:
                ens.stopped_by = sigterm.signal_name or "preemption"
                what = "Interrupted (Ctrl-C)" if ens.stopped_by == "SIGINT" else "Preemption"
                say(f"{what} at step {step}: checkpoint saved, stopping (rerun to resume).")
                break
            if log or evaluate_now or step == start + 1:  # throughput: steps alone
                tick, timed = time.perf_counter(), 0
    pbar.close()
    return state, step, results


# --------------------------------------------------------------------------- command line

_FLAGS: dict[str, Any] = {}


def _define_flags() -> dict[str, Any]:
    """The ensemble's flags beside ``rope_lie.main``'s (--config and its overrides), defined
    once, when the command line is run (importing this module defines none)."""
    if not _FLAGS:
        from absl import flags

        from rope_lie import main as cli

        _FLAGS["cli"] = cli
        _FLAGS["seeds"] = flags.DEFINE_list("seeds", None, "The members' config.seed: 0,1,2.")
        _FLAGS["data_seeds"] = flags.DEFINE_list(
            "data_seeds",
            None,
            "The members' config.data_seed, one per seed (default: the config's for every "
            "member; None follows each seed).",
        )
        _FLAGS["workdirs"] = flags.DEFINE_list(
            "workdirs", None, "One workdir per seed, written as rope_lie.main writes a run's."
        )
        _FLAGS["ensemble_dir"] = flags.DEFINE_string(
            "ensemble_dir", None, "Directory of the stacked checkpoints (resumed from)."
        )
    return _FLAGS


def _ints(name: str, values: Sequence[str]) -> list[int | None]:
    try:
        return [None if v == "None" else int(v) for v in values]
    except ValueError:
        raise ValueError(f"--{name}={','.join(values)}: expected integers") from None


def run(argv: list[str]) -> int:
    """The command line on `argv` (``sys.argv`` form); returns ``rope_lie.main``'s exit
    statuses (0 done or preempted and saved, 1 non-finite, 2 a user error, 130 Ctrl-C)."""
    f = _define_flags()
    cli = f["cli"]
    if any(a in cli._HELP for a in argv[1:]):
        from absl import flags

        names = ("config", "seeds", "data_seeds", "workdirs", "ensemble_dir")
        lines = [f"  --{n}: {flags.FLAGS[n].help}" for n in names]
        lines.append("  --config.<field>=<value>: override one field of every member's config")
        print(__doc__.strip().split("\n\nDesign:")[0] + "\n\nFlags:\n" + "\n".join(lines))
        return 0
    try:
        config, workdir = cli._parse(list(argv))
    except cli._UsageError as e:
        return cli._fail(str(e))
    if config is None:
        return cli._fail("--config is required")
    if workdir:
        return cli._fail(
            "--workdir is rope_lie.main's; an ensemble takes --workdirs (one per seed)"
        )
    missing = [n for n in ("seeds", "workdirs", "ensemble_dir") if not f[n].value]
    if missing:
        return cli._fail(f"--{', --'.join(missing)} required")
    try:
        seeds = _ints("seeds", f["seeds"].value)
        if None in seeds:
            raise ValueError(f"--seeds={','.join(f['seeds'].value)}: expected integers")
        data_seeds = _ints("data_seeds", f["data_seeds"].value) if f["data_seeds"].value else None
        if data_seeds is not None and len(data_seeds) != len(seeds):
            raise ValueError(f"{len(seeds)} seeds but {len(data_seeds)} data_seeds")
    except ValueError as e:
        return cli._fail(str(e))
    configs = [
        member_config(config, s) if data_seeds is None else member_config(config, s, d)
        for s, d in zip(seeds, data_seeds or seeds, strict=True)
    ]
    workdirs = list(f["workdirs"].value)
    from absl import flags, logging

    logging.use_absl_handler()
    if not flags.FLAGS["verbosity"].present:  # Orbax logs every save at INFO
        logging.set_verbosity(logging.WARNING)
    ensemble_dir = f["ensemble_dir"].value
    return cli.guarded(lambda: train_ensemble(configs, workdirs, ensemble_dir), workdirs)


def main() -> None:
    _define_flags()["cli"].main(run)  # rope_lie.main's exit (a closed pipe included)


if __name__ == "__main__":
    main()
