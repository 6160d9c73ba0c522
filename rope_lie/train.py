"""Training and evaluation loop: ``train_and_evaluate(config, workdir) -> final metrics``.

One jitted train step with explicit in/out shardings and donation of the state, around
``nnx.split``/``nnx.merge``: the train state is a plain pytree
``{"params": pure dict, "opt_state": optax state, "step": int32}``; the model's graph is rebuilt
from ``graphdef`` inside the step. Its only non-parameter state is the dropout RNG stream, which
is reseeded every step with ``fold_in(dropout_key, step)`` — nothing random is carried between
steps, so nothing random needs restoring.

Resume order (a rerun with the same workdir continues exactly, ``kill -9`` included):

1. mesh, model graph, optimizer and the abstract state (``jax.eval_shape``) from the config;
2. the latest complete checkpoint is restored straight into the state shardings (one whose
   files no longer read is named and set aside, and the one before it is taken), and the model
   its ``meta`` records is checked against ``config.model`` (``run_config.check_model``);
   without one the state is initialised by a jit with ``out_shardings`` (never whole on one
   device);
3. the train iterator starts at the restored step (its batch k is the same whatever the start);
4. step k uses dropout key ``fold_in(dropout_key, k)``;
5. ``metrics.jsonl`` lines after the restored step are dropped; the best eval metrics so far
   come from the checkpoint's JSON ``meta``.

The steps themselves (train, check, log, evaluate, checkpoint; stopping on a non-finite loss,
SIGTERM, Ctrl-C or preemption) run in ``rope_lie/loop.py``. Rerunning a finished run only
re-evaluates its final state and rewrites ``final.json``; where ``metrics.jsonl`` has no record
of the last step (the run was killed in its final evaluations), it writes the one the
uninterrupted run writes (``loop.evaluate_end``).

Every run writes its resolved config to ``config.json`` and ``config.py`` in the workdir
(``rope_lie/run_config.py``); ``rope_lie.load(workdir)`` rebuilds the trained model from them
(``rope_lie/loading.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from rope_lie import checkpoint as ckpt
from rope_lie import (
    config_check,
    errors,
    evaluate,
    finetune,
    job,
    loop,
    metrics,
    optim,
    sharding,
)
from rope_lie.encodings import _sharding
from rope_lie.job import say
from rope_lie.models import ViT, attention, tokens, vit

if TYPE_CHECKING:  # configs are read by attribute: the step needs no ml_collections
    import ml_collections as mc

# fold_in data of the patch-dropout key, derived from a step's dropout key (the model's RNG
# streams take fold_in(key, i) with i their small leaf index: no collision).
PATCH_DROPOUT_STREAM = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    """What the steps close over: the model graph, its abstract params, optimizer, shardings."""

    graphdef: Any
    abstract_params: nnx.State
    tx: optax.GradientTransformation
    schedule: optax.Schedule | None  # step -> learning rate; None: not logged (benchmarks)
    mesh: jax.sharding.Mesh
    state_shardings: Any
    other_sharding: Any
    patch: tuple[int, ...]


def build_model(model_cfg: mc.ConfigDict, key: jax.Array) -> ViT:
    """The ViT of ``config.model`` (``vit.from_config``), its streams' keys from `key`."""
    rngs = nnx.Rngs(params=key, dropout=jax.random.fold_in(key, 1))
    return vit.from_config(model_cfg.to_dict(), rngs=rngs)


def merge_model(setup: Setup, params: dict, other: nnx.State) -> ViT:
    """The module from pure-dict params (inside jit)."""
    state = jax.tree.map(lambda v: v, setup.abstract_params)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(setup.graphdef, state, other)


def _fresh_state(tx: optax.GradientTransformation, params: dict) -> dict:
    """The train state at step 0: parameters, the optimizer's initial state, the step."""
    return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}


def model_state(model: ViT, tx: optax.GradientTransformation) -> tuple[dict, nnx.State]:
    """A built model's train state at step 0 (``make_setup``'s layout) and its other state."""
    _, params, other = nnx.split(model, nnx.Param, ...)
    return _fresh_state(tx, nnx.to_pure_dict(params)), other


def make_setup(
    model: ViT,
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    *,
    schedule: optax.Schedule | None = None,
    fsdp_min_size: int = 2**14,
) -> tuple[Setup, Any]:
    """The Setup of a model (abstract, from ``nnx.eval_shape``, or built) and its optimizer.

    Shardings are decided from the abstract shapes (``sharding.state_shardings``).

    Args:
      model: the ViT; only its graph and shapes are kept.
      tx: the optimizer.
      mesh: the device mesh.
      schedule: step -> learning rate, for the log; None: none is logged.
      fsdp_min_size: arrays with fewer elements stay replicated under FSDP
        (``sharding.state_shardings``; ``config.fsdp_min_size``).

    Returns:
      (setup, the abstract train state ``{"params", "opt_state", "step"}``).
    """
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    abstract_state = jax.eval_shape(
        lambda p: _fresh_state(tx, p), nnx.to_pure_dict(abstract_params)
    )
    state_shardings = sharding.state_shardings(abstract_state, mesh, fsdp_min_size)
    setup = Setup(
        graphdef=graphdef,
        abstract_params=abstract_params,
        tx=tx,
        schedule=schedule,
        mesh=mesh,
        state_shardings=state_shardings,
        other_sharding=jax.tree.map(lambda _: sharding.replicated(mesh), other),
        patch=tuple(model.patch),
    )
    return setup, abstract_state


def create_setup_and_state(
    config: mc.ConfigDict, mesh, total_steps: int, *, abstract_model: ViT | None = None
):
    """(Setup, abstract state, init, init_other) of a run's config.

    `init(key) -> (state, other)` builds both directly sharded; `init_other(key) -> other` only
    the model's non-parameter state (its RNG streams), for resuming from a checkpoint.

    Args:
      config: the run config (its model, optim and fsdp_min_size).
      mesh: the device mesh.
      total_steps: the length of the learning-rate schedule.
      abstract_model: ``nnx.eval_shape`` of ``build_model(config.model, ...)`` when the caller
        has it; None: built here.
    """
    if abstract_model is None:
        abstract_model = nnx.eval_shape(lambda: build_model(config.model, jax.random.key(0)))
    params = nnx.state(abstract_model, nnx.Param)
    tx, schedule = optim.make_optimizer(config.optim, params, total_steps)
    setup, abstract_state = make_setup(
        abstract_model, tx, mesh, schedule=schedule, fsdp_min_size=config.fsdp_min_size
    )

    def init_fn(key):
        return model_state(build_model(config.model, key), tx)

    shardings = (setup.state_shardings, setup.other_sharding)
    platform = mesh.devices.flat[0].platform
    init = _run_once(jax.jit(init_fn, out_shardings=shardings), platform)
    init_other = _run_once(
        jax.jit(lambda key: init_fn(key)[1], out_shardings=shardings[1]), platform
    )
    return setup, abstract_state, init, init_other


def _run_once(jitted, platform: str):
    """`jitted`, compiled on first call; without XLA backend optimisation where the program
    runs on CPU (`platform`: the mesh's, which need not be the default backend's).

    Initialisation runs once per run: on CPU its threefry-heavy program compiles much faster at
    optimisation level 0 and runs in milliseconds either way (benchmarks README, section 14).
    """
    options = {"xla_backend_optimization_level": 0} if platform == "cpu" else {}

    def call(*args):
        return jitted.lower(*args).compile(compiler_options=options)(*args)

    return call


def fresh_rng_state(other: nnx.State, key: jax.Array) -> nnx.State:
    """The model's RNG streams reset to keys derived from `key` (new Variables, no mutation).

    Built inside the differentiated function, so NNX may advance the streams' counters there.
    """
    leaves, treedef = jax.tree.flatten(other)
    is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    fresh = [
        jax.random.fold_in(key, i) if is_key(x) else jnp.zeros_like(x) for i, x in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, fresh)


def make_train_step(setup: Setup):
    """Jitted (state, batch, other, dropout_key) -> (state, metrics); the state is donated."""

    def loss_fn(params, batch, other, key):
        # Under Explicit mesh axes fsdp-split parameters are gathered for the forward pass (a
        # no-op under the loop's Auto axes, where XLA places the gathers).
        params = jax.tree.map(_sharding.replicated, params)
        model = merge_model(setup, params, fresh_rng_state(other, key))
        if "image" in batch and model.patch_dropout == 0:
            logits_BV = model(batch["image"], train=True)
        elif "segment" in batch:  # a packed NaFlex batch: each image's logits from its slot
            logits_BUV = model.classify_tokens(evaluate.batch_packed(batch), train=True)
            logits_BV = logits_BUV[batch["image_row"], batch["image_slot"]]
        else:  # NaFlex tokens, or patch dropout on the image's tokens
            batch_tokens = (
                evaluate.batch_tokens(batch)
                if "image" not in batch
                else model.image_tokens(batch["image"])
            )
            patch_key = jax.random.fold_in(key, PATCH_DROPOUT_STREAM)
            logits_BV = model.classify_tokens(batch_tokens, train=True, patch_key=patch_key)
        labels = batch["soft_label"] if "soft_label" in batch else batch["label"]
        loss = jnp.mean(evaluate.cross_entropy(logits_BV, labels))
        accuracy = jnp.mean(jnp.argmax(logits_BV, -1) == batch["label"])
        return loss, accuracy

    def train_step(state, batch, other, dropout_key):
        key = jax.random.fold_in(dropout_key, state["step"])
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, accuracy), grads = grad_fn(state["params"], batch, other, key)
        updates, opt_state = setup.tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        grad_norm = optax.tree.norm(grads)
        new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        return new_state, {
            "loss": loss,
            "accuracy": accuracy,
            "grad_norm": grad_norm,
            "finite": finite,
        }

    replicated = sharding.replicated(setup.mesh)
    return jax.jit(
        train_step,
        in_shardings=(
            setup.state_shardings,
            sharding.batch_sharding(setup.mesh),
            setup.other_sharding,
            replicated,
        ),
        out_shardings=(setup.state_shardings, replicated),
        donate_argnums=(0,),
    )


def make_eval_fn(setup: Setup, other: nnx.State, platform: str | None = None) -> evaluate.EvalStep:
    """Eval step whose encoder states are precomputed once per resolution (``pe_cache``).

    The attention backend of evaluation is chosen here, once, outside ``jit``
    (``attention.set_inference_backends``): on one CPU device the formula ``"xla"`` attends an
    image batch in chunks (``"xla_cpu"``); a NaFlex token batch keeps the model's backend.

    Args:
      setup: from ``create_setup_and_state``.
      other: the model's non-parameter state.
      platform: where the step runs; None: ``jax.default_backend()`` (an export target, say).
    """
    platform = jax.default_backend() if platform is None else platform
    inference = nnx.merge(setup.graphdef, setup.abstract_params, other)
    attention.set_inference_backends(inference, platform, setup.mesh.size)
    image_setup = dataclasses.replace(setup, graphdef=nnx.graphdef(inference))

    def apply_fn(params, images, cache):
        if isinstance(images, tokens.Tokens):  # a NaFlex batch
            return merge_model(setup, params, other).classify_tokens(images)
        return merge_model(image_setup, params, other)(images, train=False, pe_cache=cache)

    def precompute_fn(params, spatial_shape, extrapolation=None):
        model = merge_model(setup, params, other)
        return model.precompute_pe(model.grid_of(spatial_shape), extrapolation)

    return evaluate.make_eval_step(apply_fn, precompute_fn)


def schedule_steps(config: mc.ConfigDict, num_train_examples: int) -> tuple[int, int, int]:
    """(total_steps, steps_per_epoch, eval_every) from the config and the train split size.

    The fields' own ranges are ``config_check.validate``'s; checked here is only what needs the
    split's size: that ``num_epochs`` of it make at least one step.
    """
    steps_per_epoch = max(1, num_train_examples // config.batch_size)
    total = config.total_steps or int(round(config.num_epochs * steps_per_epoch))
    if total < 1:
        raise ValueError(
            f"total_steps={config.total_steps}, num_epochs={config.num_epochs}: no steps "
            f"({steps_per_epoch} steps per epoch); set total_steps >= 1"
        )
    every = config.eval_every_steps
    if not every and config.eval_every_epochs > 0:  # a fraction of a step is every step
        every = max(1, int(round(config.eval_every_epochs * steps_per_epoch)))
    return total, steps_per_epoch, every or total


def train_and_evaluate(config: mc.ConfigDict, workdir: str) -> dict[str, Any]:
    """Train (or resume) as `config` says, evaluate, and write workdir/final.json.

    Returns:
      {"step": last step, "evals": {name: {accuracy, loss, num_examples, resolution,
      best_accuracy, best_step}}}.
    """
    with errors.user_errors():
        config_check.validate(config)
        from rope_lie import run_config  # ml_collections (the train extra)

        run_config.check_resume(workdir, config)
    job.maybe_initialize_distributed(config)
    with errors.user_errors():
        mesh = sharding.make_mesh(config.mesh)
    with jax.set_mesh(mesh):
        return _train(config, workdir, mesh)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Prepared:
    """What ``_prepare`` checked and built before the first step."""

    setup: Setup
    abstract_state: Any
    init: Any
    init_other: Any
    manager: Any
    restored: Any
    num_train: int
    total: int
    steps_per_epoch: int
    eval_every: int
    source: tuple[int, dict] | None = None  # init_from's (step, parameters), checked


def _prepare(config: mc.ConfigDict, workdir: str, mesh) -> _Prepared:
    """Everything the user chose, checked before the first step: errors here are theirs
    (``errors.user_errors``; ``rope_lie.main`` prints them as one line)."""
    with errors.user_errors():
        # The model first, built abstractly once: a bad model fails before the workdir is
        # created, and its sizes (patch, head_dim) are read from it from here on.
        model = nnx.eval_shape(lambda: build_model(config.model, jax.random.key(0)))
        evaluate.check_extrapolation(model, config.get("evals", {}))  # tools at evaluation
        # An attention this platform (or the dtype, or head_dim) rules out: fail now.
        packed = bool(config.get("naflex") and config.naflex.get("pack"))
        attention.check_backends(model, jax.default_backend(), packed=packed)
        job.check_workdir(workdir)  # an unwritable workdir fails now, not at the first save
        sharding.check_batch_size(config.batch_size, mesh)  # eval batches padded to the mesh
        run_inputs = input_module(config)

        # Every dataset now: a missing eval dataset fails before training, not after it.
        num_train = run_inputs.prepare_data(config)
        total, steps_per_epoch, eval_every = schedule_steps(config, num_train)
        if config.total_steps == 0:
            say(f"total_steps=0: training num_epochs={config.num_epochs} epochs = {total} steps")
        setup, abstract_state, init, init_other = create_setup_and_state(
            config, mesh, total, abstract_model=model
        )
        manager = ckpt.make_manager(os.path.join(workdir, "checkpoints"), **config.checkpoint)
        abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract_state,
            setup.state_shardings,
        )
        restored = ckpt.restore_latest(manager, abstract)
        if restored is not None:  # before config.json is rewritten: a refused run changes nothing
            from rope_lie import run_config  # ml_collections (the train extra)

            where = f"The checkpoint at step {restored[0]} in {manager.directory}"
            run_config.check_model(restored[2].get("model"), config.model, where)
            _check_data_shards(restored[2], config, workdir)
        source = None
        if restored is None and config.get("init_from"):  # checked before the workdir is written
            source = _init_source(config, abstract_state["params"])
    return _Prepared(
        setup=setup,
        abstract_state=abstract_state,
        init=init,
        init_other=init_other,
        manager=manager,
        restored=restored,
        num_train=num_train,
        total=total,
        steps_per_epoch=steps_per_epoch,
        eval_every=eval_every,
        source=source,
    )


def input_module(config: mc.ConfigDict):
    """The module that reads the run's data: ``rope_lie.run_inputs`` (tf.data and TFDS; imported
    only now, as it imports TensorFlow) or ``rope_lie.in_memory`` (``config.input="memory"``).
    Both have ``prepare_data(config)``, ``data_train_batches(config, patch, start_step)`` and
    ``eval_batches(config, entry, mesh, patch)``."""
    from rope_lie import in_memory

    if in_memory.uses_memory(config):
        return in_memory
    from rope_lie import run_inputs

    return run_inputs


def _make_run(
    config, workdir, p: _Prepared, other, dropout_key, writer, best, eval_step=None
) -> loop.Run:
    """The loop's pieces: the steps, the batches and evaluations of the config, the numbers.
    `eval_step`: ``make_eval_fn(p.setup, other)``'s, to share one between runs of one model (a
    seed ensemble's members, ``rope_lie/ensemble.py``); None: made here."""
    from rope_lie import run_config  # ml_collections (the train extra): not needed by the steps

    run_inputs = input_module(config)
    setup, mesh, patch = p.setup, p.setup.mesh, p.setup.patch
    eval_step = make_eval_fn(setup, other) if eval_step is None else eval_step

    def evaluations(params, step, best, final):
        return evaluate.evaluate_all(
            config.evals,
            lambda entry: run_inputs.eval_batches(config, entry, mesh, patch),
            eval_step,
            params,
            mesh,
            patch=patch,
            step=step,
            best=best,
            seed=config.seed,
            progress=config.get("progress", False),
            final=final,
        )

    return loop.Run(
        workdir=workdir,
        train_step=make_train_step(setup),
        train_batches=lambda start: run_inputs.data_train_batches(config, patch, start),
        evaluate=evaluations,
        mesh=mesh,
        schedule=setup.schedule,
        other=other,
        dropout_key=dropout_key,
        manager=p.manager,
        writer=writer,
        best=best,
        total=p.total,
        steps_per_epoch=p.steps_per_epoch,
        eval_every=p.eval_every,
        log_every=config.log_every_steps,
        save_every=config.checkpoint.every_steps,
        batch_size=config.batch_size,
        optim_cfg=config.get("optim") or {},
        model=run_config.model_record(config.model),
        progress=config.progress,
        data_shards=sharding.data_shards(config),
    )


def _train(config: mc.ConfigDict, workdir: str, mesh) -> dict[str, Any]:
    p = _prepare(config, workdir, mesh)
    from rope_lie import run_config  # ml_collections (the train extra): not needed by the steps

    run_config.write(workdir, config)  # the resolved config, beside what it produces
    init_key, dropout_key = jax.random.split(jax.random.key(config.seed))
    record = {}  # the last step's training scalars, where the run restarts there
    if p.restored is None:
        (state, other), start, best = p.init(init_key), 0, {}
        if config.get("init_from"):
            state = _init_from(config, p.setup, state, p.source, workdir)
    else:
        start, state, meta = p.restored
        other, best = p.init_other(init_key), meta.get("best", {})
        record = meta.get(loop.RECORD, {})
        if start >= p.total:
            say(f"{workdir}: already at step {start}; evaluating its final state")
        else:
            say(f"Resuming from step {start} of {p.total} in {workdir}")
    say(job.describe_run(config, p.abstract_state, mesh, p.total, p.num_train))
    writer = metrics.MetricsWriter(workdir, start_step=start, tensorboard=config.tensorboard)
    run = _make_run(config, workdir, p, other, dropout_key, writer, best)
    try:
        state, step, results = loop.run_steps(run, state, start)
        if results is None and step >= p.total:  # resumed at the end: evaluate it again
            results = loop.evaluate_end(run, state, step, record)
    finally:
        p.manager.wait_until_finished()
        p.manager.close()
        writer.close()
    if step < p.total:  # stopped early: the checkpoint is saved, final.json comes with the rerun
        return {"step": step, "preempted": True, "signal": run.stopped_by}
    metrics.write_examples(workdir, run.correct)
    return metrics.write_final(workdir, step, results)


def _check_data_shards(meta: dict, config: mc.ConfigDict, workdir: str) -> None:
    """A checkpoint resumes only where the batches are made of as many shards as before
    (``data_shards=0``: one per process, so another process count makes other batches).
    Checkpoints written before the count was saved are not checked."""
    saved, now = meta.get("data_shards"), sharding.data_shards(config)
    if saved is not None and saved != now:
        with errors.user_errors():
            raise ValueError(
                f"{workdir}'s checkpoint was trained on batches of {saved} data shards, this job "
                f"makes {now} (data_shards={config.get('data_shards', 0)} on "
                f"{jax.process_count()} processes): set --config.data_shards={saved} to resume "
                "it here on the same batches"
            )


def _init_source(config: mc.ConfigDict, abstract_params: Any) -> tuple[int, dict]:
    """(step, parameters) of ``config.init_from``, checked against the new model's abstract
    parameters (``finetune.check_params``): a missing checkpoint or a parameter that does not
    fit is the user's error, before anything is written."""
    try:
        step, source = finetune.load_params(config.init_from)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"init_from={config.init_from!r}: {e}") from None
    finetune.check_params(source, abstract_params, init_head=config.get("init_head", "keep"))
    from rope_lie import run_config  # ml_collections (the train extra)

    saved = ckpt.load_meta(finetune.checkpoint_step(config.init_from)[0], step).get("model")
    for line in run_config.model_changes(saved, config.model):
        say(f"init_from: the source's model had {line}")
    return step, source


INIT_FROM_JSON = "init_from.json"  # in a fine-tune's workdir: its source run and step


def _init_from(config: mc.ConfigDict, setup: Setup, state: dict, source, workdir: str) -> dict:
    """The fresh state with the parameters of ``config.init_from`` (rope_lie/finetune.py):
    `source`, ``_init_source``'s (step, parameters); ``INIT_FROM_JSON`` in `workdir` records
    the source's path and step (the source run may train on)."""
    step, params = source
    params = finetune.adapt_params(
        params, jax.device_get(state["params"]), init_head=config.get("init_head", "keep")
    )
    if jax.process_index() == 0:
        path = os.path.join(workdir, INIT_FROM_JSON)
        with open(path + ".tmp", "w") as f:
            source_path = os.path.abspath(os.path.expanduser(config.init_from))
            json.dump({"init_from": source_path, "step": step}, f)
        os.replace(path + ".tmp", path)
    say(f"Parameters from {config.init_from} (step {step}); optimiser and step start afresh")
    return {**state, "params": jax.device_put(params, setup.state_shardings["params"])}
