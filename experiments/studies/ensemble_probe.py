r"""Train S seeds of one config in one program: the real train step, vmapped over a seed axis.

    python -m experiments.studies.ensemble_probe \
        --config 'configs/fashion_mnist.py:pe=liere,block=8,input=memory,resolution_evals=false' \
        --seeds 0,1,2,3,4 --steps 300

A tiny ViT on an accelerator is bound by per-step overhead (kernel launches, Python), so one
process per seed leaves it idle. Here the seeds of one arm share each kernel launch: the
ensemble state is a run's train state with a leading seed axis S on every leaf,
``jax.vmap(train.make_train_step(setup))`` steps all of them at once on stacked (S, B, ...)
batches and per-seed dropout keys. Seed k's trajectory is the single run's of seed k
(tests/test_ensemble_probe.py): the same initial state and dropout key (``run_keys``, as
``rope_lie.train._train`` derives them) and the same batches (``rope_lie/in_memory.py``'s
stream of ``data_seed``, else ``seed``).

Printed (and written as JSON with ``--out``), after compiling and ``--warmup`` steps: seed-steps
per second of the S seeds' single-run steps one after another (the baseline, the plain jitted
step) and of the ensemble step, both on a small pool of real batches prepared before timing
and with the loop's host sync (step t-1's metrics read after step t is dispatched,
``rope_lie/loop.py``); and how many S-seed batches per second the input makes alone: the
loop's host input (``in_memory.data_train_batches``, a few dispatches per member and step,
stacked) and the same batches made on the device in one dispatch (``device_batches``).
``--stream`` also times the steps with batches read from each input as they are needed.

Needs no TensorFlow: jax, flax, optax, orbax, chex, numpy, ml_collections, and tqdm (imported
by ``rope_lie/loop.py``, which ``rope_lie.train`` imports); the config's ``input`` must be
``memory``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections as mc
import numpy as np
from jax.sharding import PartitionSpec as P

from rope_lie import in_memory, loop, sharding, train
from rope_lie.config_lib import data_seed

POOL = 4  # distinct batches per seed cycled through by the timed steps


def load_config(spec: str) -> mc.ConfigDict:
    """A recipe's config from ``path/to/recipe.py[:argument]``, as ``rope_lie.main`` reads it."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("recipe", path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"--config={spec!r}: no recipe file {path!r}")
    recipe = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(recipe)
    return recipe.get_config(arg or None)


def seed_config(config: mc.ConfigDict, seed: int) -> mc.ConfigDict:
    """`config` with ``seed`` set (its ``data_seed`` kept: None follows the seed)."""
    out = mc.ConfigDict(config.to_dict())
    out.seed = seed
    return out


def run_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """(init_key, dropout_key) of a run with this seed, as ``rope_lie.train._train`` splits them."""
    init_key, dropout_key = jax.random.split(jax.random.key(seed))
    return init_key, dropout_key


def stack(trees: Sequence[Any]) -> Any:
    """Pytrees of one structure -> one pytree whose leaves have a leading axis of len(trees)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack(tree: Any, k: int) -> Any:
    """Member k of a stacked pytree."""
    return jax.tree.map(lambda x: x[k], tree)


def make_ensemble_step(setup: train.Setup) -> Callable:
    """Jitted (state_S, batch_S, other_S, dropout_key_S) -> (state_S, metrics_S): the run's
    train step (``train.make_train_step``) vmapped over a leading seed axis of every argument;
    the stacked state is donated."""
    return jax.jit(jax.vmap(train.make_train_step(setup)), donate_argnums=(0,))


def init_members(init: Callable, seeds: Sequence[int]) -> list[tuple[Any, Any, jax.Array]]:
    """Per seed, (state, other, dropout_key) at step 0, from ``create_setup_and_state``'s
    `init` and the seed's run keys."""
    members = []
    for seed in seeds:
        init_key, dropout_key = run_keys(seed)
        state, other = init(init_key)
        members.append((state, other, dropout_key))
    return members


def train_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """The keys of an input batch that the train step reads (``loop.TRAIN_KEYS``)."""
    return {k: batch[k] for k in loop.TRAIN_KEYS if k in batch}


def member_batches(config: mc.ConfigDict, mesh, start: int = 0) -> Iterator[dict[str, Any]]:
    """The train batches of one run (its config's data seed) from step `start` on, placed on
    the mesh as the loop places them (``sharding.shard_batch``)."""
    for batch in in_memory.data_train_batches(config, None, start):
        yield sharding.shard_batch(train_batch(batch), mesh)


def stacked_sharding(mesh) -> jax.sharding.NamedSharding:
    """A stacked (S, B, ...) batch's: the seed axis whole, the examples split as a run's."""
    return jax.sharding.NamedSharding(mesh, P(None, *sharding.batch_sharding(mesh).spec))


def ensemble_batches(configs: Sequence[mc.ConfigDict], mesh, start: int = 0) -> Iterator[dict]:
    """Stacked (S, B, ...) batches: member k's batch t is run k's batch t."""
    streams = [in_memory.data_train_batches(c, None, start) for c in configs]
    while True:
        batch = stack([train_batch(next(s)) for s in streams])
        yield jax.device_put(batch, stacked_sharding(mesh))


def member_indices(
    configs: Sequence[mc.ConfigDict],
    start: int,
    count: int,
    nums: Sequence[int] | None = None,
) -> np.ndarray:
    """int32 (count, S, B): the example indices of steps start..start+count-1 of every member
    (``in_memory.batch_indices`` of its data seed), computed seed by seed so that each epoch's
    permutation is drawn once per chunk (``in_memory.epoch_order`` caches two). `nums`: the
    members' training-set sizes (None: read here, once per member)."""
    nums = [_num_train(c) for c in configs] if nums is None else nums
    per_seed = [
        [
            in_memory.batch_indices(data_seed(c), t, c.batch_size, num)
            for t in range(start, start + count)
        ]
        for c, num in zip(configs, nums, strict=True)
    ]
    return np.asarray(per_seed, np.int32).transpose(1, 0, 2)


def _num_train(config: mc.ConfigDict) -> int:
    """The run's number of training examples. Not cheap: ``in_memory.train_arrays`` copies the
    training set onto its canvas at every call (5 ms for Fashion-MNIST on this CPU), so it is
    read once per member, not once per member and step (which cost 1.4-1.7 s every 64 steps
    of five seeds' device input)."""
    return len(in_memory.train_arrays(config.dataset)[1])


def make_device_input(configs: Sequence[mc.ConfigDict], mesh) -> Callable:
    """Jitted (index_SB, step) -> the stacked batch of `step`, made on the device.

    The members' training examples are held on the device once; member k's batch is the same
    gather, crop, flip and normalisation as ``in_memory.data_train_batches`` (augmentation key
    fold_in(key(data_seed), step)), vmapped over the members: one dispatch per step, not a few
    per member. The members must share the dataset and augmentation (seeds of one arm).
    """
    ds = configs[0].dataset
    if any(c.dataset.to_dict() != ds.to_dict() for c in configs):
        raise ValueError("the members' config.dataset differ; an ensemble is one arm's seeds")
    images, labels = in_memory.train_arrays(ds)
    keys_S = jnp.stack([jax.random.key(data_seed(c)) for c in configs])
    padding = ds.augment.crop_padding if ds.augment.crop == "pad" else 0

    def member(images_NHWC, labels_N, key, index_B, step):
        out = in_memory.augment_batch(
            images_NHWC[index_B],
            jax.random.fold_in(key, step),
            padding=padding,
            flip=bool(ds.augment.flip),
            size=ds.image_size,
        )
        return {"image": in_memory.normalise(out, ds), "label": labels_N[index_B]}

    # the examples are arguments, not constants folded into the program
    members = jax.jit(
        jax.vmap(member, in_axes=(None, None, 0, 0, None)), out_shardings=stacked_sharding(mesh)
    )
    return functools.partial(members, jnp.asarray(images), jnp.asarray(labels), keys_S)


def device_batches(configs: Sequence[mc.ConfigDict], mesh, start: int = 0, chunk: int = 64):
    """Stacked batches from step `start` on, made by ``make_device_input`` from indices
    computed `chunk` steps at a time and sent to the device once per chunk."""
    make = make_device_input(configs, mesh)
    nums = [_num_train(c) for c in configs]
    for first in itertools.count(start, chunk):
        index_CSB = jnp.asarray(member_indices(configs, first, chunk, nums))
        for i in range(chunk):
            yield make(index_CSB[i], first + i)


def build(config: mc.ConfigDict, seeds: Sequence[int], mesh) -> dict:
    """The single-run step, the ensemble step and the members' step-0 states of `config`, with
    the run's learning-rate schedule (``train.schedule_steps``)."""
    total, _, _ = train.schedule_steps(config, in_memory.prepare_data(config))
    setup, _, init, _ = train.create_setup_and_state(config, mesh, total)
    return {
        "total": total,
        "setup": setup,
        "step": train.make_train_step(setup),
        "ensemble_step": make_ensemble_step(setup),
        "members": init_members(init, seeds),
        "configs": [seed_config(config, s) for s in seeds],
    }


# --------------------------------------------------------------------------- timing


def _timed_steps(step_fn: Callable, n: int, warmup: int) -> float:
    """Seconds for `n` calls of step_fn(i) -> metrics after `warmup` untimed ones, reading call
    i-1's metrics after call i is dispatched (``loop.run_steps``'s host sync)."""
    pending = None
    for i in range(warmup + n):
        if i == warmup:
            jax.block_until_ready(pending)
            tick = time.perf_counter()
        m = step_fn(i)
        if pending is not None:
            jax.device_get(pending)
        pending = m
    jax.device_get(pending)
    return time.perf_counter() - tick


def time_single(built: dict, batches: Callable, n: int, warmup: int) -> float:
    """Seed-steps per second of the members' plain steps, one seed after another per step.

    `batches(k, i)` is member k's batch of call i."""
    step = built["step"]
    states = [jax.tree.map(jnp.copy, state) for state, _, _ in built["members"]]

    def one(i):
        out = []
        for k, (_, other, dropout_key) in enumerate(built["members"]):
            states[k], m = step(states[k], batches(k, i), other, dropout_key)
            out.append(m)
        return out

    seconds = _timed_steps(one, n, warmup)
    return len(states) * n / seconds


def time_ensemble(built: dict, batches: Callable, n: int, warmup: int) -> float:
    """Seed-steps per second of the vmapped ensemble step; `batches(i)` is call i's stack."""
    members = built["members"]
    state = stack([s for s, _, _ in members])
    other, dropout_key = stack([o for _, o, _ in members]), jnp.stack([d for _, _, d in members])

    def one(i):
        nonlocal state
        state, m = built["ensemble_step"](state, batches(i), other, dropout_key)
        return m

    seconds = _timed_steps(one, n, warmup)
    return len(members) * n / seconds


def time_input(stream: Iterator, n: int) -> float:
    """Stacked S-seed batches per second that `stream` makes (input work alone, no step)."""
    jax.block_until_ready(next(stream))
    tick = time.perf_counter()
    last = None
    for batch in itertools.islice(stream, n):
        last = batch
    jax.block_until_ready(last)
    return n / (time.perf_counter() - tick)


def probe(config: mc.ConfigDict, seeds: Sequence[int], steps: int, warmup: int, stream: bool):
    """The rows of the table: name -> seed-steps (or S-seed batches) per second."""
    if not in_memory.uses_memory(config):
        raise ValueError(f"input={config.get('input')!r}; the probe reads input='memory'")
    mesh = sharding.make_mesh(config.mesh)
    with jax.set_mesh(mesh):
        built = build(config, seeds, mesh)
        configs = built["configs"]
        pool = [list(itertools.islice(member_batches(c, mesh), POOL)) for c in configs]
        pool_S = [stack([pool[k][i] for k in range(len(seeds))]) for i in range(POOL)]
        rows = {
            "single (seeds in turn)": time_single(
                built, lambda k, i: pool[k][i % POOL], steps, warmup
            ),
            "ensemble (vmapped)": time_ensemble(built, lambda i: pool_S[i % POOL], steps, warmup),
        }
        if stream:
            singles = [member_batches(c, mesh) for c in configs]
            host, device = ensemble_batches(configs, mesh), device_batches(configs, mesh)
            rows["single, host input"] = time_single(
                built, lambda k, i: next(singles[k]), steps, warmup
            )
            rows["ensemble, host input"] = time_ensemble(built, lambda i: next(host), steps, warmup)
            rows["ensemble, device input"] = time_ensemble(
                built, lambda i: next(device), steps, warmup
            )
        n = max(20, steps // 4)
        rows["host input alone (batches/s)"] = time_input(ensemble_batches(configs, mesh), n)
        rows["device input alone (batches/s)"] = time_input(device_batches(configs, mesh), n)
    return rows


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="recipe.py:argument (input=memory)")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated run seeds")
    parser.add_argument("--steps", type=int, default=300, help="timed steps")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps after compiling")
    parser.add_argument("--stream", action="store_true", help="also time with streamed input")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    config = load_config(args.config)
    rows = probe(config, seeds, args.steps, args.warmup, args.stream)
    single = rows["single (seeds in turn)"]
    device = jax.devices()[0].device_kind
    print(f"{args.config}  S={len(seeds)}  {args.steps} steps  on {device}")
    for name, value in rows.items():
        ratio = f"{value / single:5.2f}x" if "batches" not in name else ""
        print(f"  {name:34s} {value:10.1f} /s  {ratio}")
    result = {"config": args.config, "seeds": seeds, "steps": args.steps, "device": device}
    result["rows"] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
