"""The data of a training run, from its config: prepared before step 1, then read per process.

- ``prepare_data`` / ``data_summary`` / ``prepare_eval_data``: every dataset generated or checked
  before the first step (process 0 first in a multi-process job, the others at a barrier);
- ``data_train_batches``: this process's share of every global batch (``config.data_shards``).

Importing this module imports TensorFlow (through ``rope_lie.data``): the training job imports it
when it starts reading data, not at import time.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections as mc
import numpy as np

from rope_lie.data import catalog, naflex, pipeline
from rope_lie.in_memory import data_seed  # one rule for both input paths
from rope_lie.models import variants


def model_patch(config: mc.ConfigDict) -> tuple[int, ...]:
    """The patch size of ``config.model`` (its variant's, or ``patch_size``)."""
    model = config.model
    rank = len(model.image_shape)
    return variants.model_dims(model.variant, model.get("dims"), model.get("patch_size"), rank)[1]


def naflex_finish(config: mc.ConfigDict, side: int | None = None):
    """``naflex.example_fn`` of a run with ``config.naflex``: training budgets (``side`` None)
    or one evaluation budget of side**2 tokens, padded to at least that."""
    cfg, patch = config.naflex, model_patch(config)
    naflex.check_config(cfg, patch, len(config.model.image_shape))
    if side is None and cfg.get("native"):
        aug = config.dataset.augment
        if aug.crop != "none" or aug.flip or aug.randaugment.num_layers:
            raise ValueError(
                f"naflex.native reads each image at its stored extent; augment.crop={aug.crop!r},"
                f" flip={aug.flip} and randaugment.num_layers={aug.randaugment.num_layers} move "
                "the content off it: expected crop='none', flip=False, num_layers=0"
            )
        return naflex.example_fn(patch[0], cfg.max_tokens, native=True)
    if side is None:
        return naflex.example_fn(
            patch[0], cfg.max_tokens, min_side=cfg.min_side, max_side=cfg.max_side
        )
    budget = naflex.side_budget(side)
    return naflex.example_fn(patch[0], budget, budget=budget)


def data_train_batches(config: mc.ConfigDict, start_step: int):
    """This process's slice of the global batches from `start_step` on (exact resume).

    The global batch is made of ``config.data_shards`` shards (0: one per process), each
    read and shuffled on its own (``tfds.split_for_jax_process`` slices); a process reads
    ``data_shards / process_count`` of them and concatenates. With ``data_shards`` fixed, the
    batches do not depend on how many processes run the job, so a checkpoint resumes on another
    topology with the same data, and a 1-process run reproduces a multi-process one.
    """
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
            seed=data_seed(config),
            start_step=start_step,
            process_index=shard,
            process_count=shards,
            finish=naflex_finish(config) if config.get("naflex") else None,
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
    summary = pipeline.dataset_summary(config.dataset)
    *spatial, channels = summary["example_shape"]
    expected = (tuple(spatial), channels, summary["num_classes"])
    model = config.model
    actual = (tuple(model.image_shape), model.channels, model.num_classes)
    if config.get("naflex") and config.naflex.get("native"):
        # Images of many sizes on one canvas; the model's image_shape is its reference size
        # (the fixed-size evaluations, APE's table).
        expected, actual = expected[1:], actual[1:]
    if expected != actual:
        raise ValueError(
            f"config.model (image_shape, channels, num_classes)={actual} does not match "
            f"dataset {config.dataset.name!r} (image_size={config.dataset.image_size}): {expected}"
        )
    return summary


def prepare_eval_data(config: mc.ConfigDict) -> None:
    """Every dataset of ``config.evals`` prepared (ours generated, catalogue ones checked)."""
    names = {entry.name or config.dataset.name for entry in config.evals.values()}
    for name in sorted(names):
        catalog.prepare(name, config.dataset.data_dir)
