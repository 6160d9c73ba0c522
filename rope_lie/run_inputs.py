"""The inputs of a training run, planned from its config: prepared before step 1, then read.

The training job's side of the data (``rope_lie/data`` reads datasets from a dataset config
alone): which datasets a run's config names, how its batches are split over processes and
devices, and the NaFlex token budgets of its model's patch, which the caller passes in (the
model's sizes are worked out once, from the model).

- ``prepare_data`` / ``data_summary`` / ``prepare_eval_data``: every dataset generated or checked
  before the first step (process 0 first in a multi-process job, the others at a barrier);
- ``data_train_batches``: this process's share of every global batch (``config.data_shards``),
  packed several images a row with ``config.naflex.pack`` (``pack_batch``);
- ``eval_batches``: this process's batches of one evaluation (``config.evals``).

Importing this module imports TensorFlow (through ``rope_lie.data``): the training job imports it
when it starts reading data, not at import time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import ml_collections as mc
import numpy as np
from jax.sharding import Mesh

from rope_lie import sharding
from rope_lie.config_lib import data_seed  # one rule for both input paths
from rope_lie.data import catalog, naflex, pipeline
from rope_lie.models import tokens


def naflex_finish(config: mc.ConfigDict, patch: Sequence[int], side: int | None = None):
    """``naflex.example_fn`` of a run with ``config.naflex``: training budgets (``side`` None)
    or one evaluation budget of side**2 tokens, padded to at least that.

    Args:
      config: the run config (naflex, dataset.augment, model.image_shape).
      patch: the model's patch size.
      side: None for training, or an evaluation's grid side.
    """
    cfg = config.naflex
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


def pack_settings(config: mc.ConfigDict) -> dict[str, int]:
    """``pack_batch``'s settings from ``config.naflex``: the row length (``max_tokens``), the
    most images a row (``pack_images``; 0: ``max_tokens // min_side**2``, at least 1) and the
    row multiple (``pack_row_multiple``; 0: ``batch_size // 32``, at least 1; made a multiple
    of the devices' count so that rows divide over them)."""
    cfg = config.naflex
    images = cfg.get("pack_images", 0) or max(1, cfg.max_tokens // cfg.min_side**2)
    multiple = cfg.get("pack_row_multiple", 0) or max(1, config.batch_size // 32)
    multiple = math.lcm(multiple, jax.local_device_count())
    return {"max_tokens": cfg.max_tokens, "max_images": images, "row_multiple": multiple}


def pack_batch(
    batch: Mapping[str, np.ndarray], *, max_tokens: int, max_images: int, row_multiple: int
) -> dict[str, np.ndarray]:
    """A padded NaFlex batch (one image per row) packed greedily, several images a row.

    Every image keeps its tokens (the real ones, ``token_mask``), coordinates and grid; the
    images go into rows of ``max_tokens`` slots by first-fit decreasing (``tokens.pack_rows``).
    The batch's images stay what they were, in their order (labels, soft labels, masks
    untouched), and say where they went, so the step takes image n's logits from its slot.

    Args:
      batch: {"patches", "index", "grid", "token_mask", "label", ...} (``naflex.tokens_of``'s
        examples, batched).
      max_tokens: the row length T.
      max_images: U, the most images a row.
      row_multiple: rows rounded up to a multiple of this.

    Returns:
      the batch with ``evaluate.PACKED_KEYS``: patches (rows, T, C), index (rows, T, 2),
      segment (rows, T) int32 (1 to U, 0 padding), slot_grid (rows, U, 2); and
      ``image_row``/``image_slot``
      (B,) int32 in place of grid and token_mask.
    """
    counts = np.asarray(batch["token_mask"]).sum(axis=1).astype(int)
    examples = [
        (batch["patches"][n, :count], batch["index"][n, :count], batch["grid"][n])
        for n, count in enumerate(counts)
    ]
    packed, place_N2 = tokens.pack_rows(examples, max_tokens, max_images, row_multiple=row_multiple)
    rest = {k: v for k, v in batch.items() if k not in ("patches", "index", "grid", "token_mask")}
    return {
        **rest,
        "patches": packed.patches_BTC,
        "index": packed.index_BTA,
        "segment": packed.segment_BT,
        "slot_grid": packed.grid_BUA,
        "image_row": place_N2[:, 0],
        "image_slot": place_N2[:, 1],
    }


def data_train_batches(config: mc.ConfigDict, patch: Sequence[int], start_step: int):
    """This process's slice of the global batches from `start_step` on (exact resume).

    The global batch is made of ``config.data_shards`` shards (0: one per process), each
    read and shuffled on its own (``tfds.split_for_jax_process`` slices); a process reads
    ``data_shards / process_count`` of them and concatenates. With ``data_shards`` fixed, the
    batches do not depend on how many processes run the job, so a checkpoint resumes on another
    topology with the same data, and a 1-process run reproduces a multi-process one.

    With ``config.naflex.pack`` each batch is packed (``pack_batch``): the same images, so
    resuming and the epochs are unchanged; its row count varies a little from step to step (a
    compiled step per distinct count, ``pack_row_multiple`` keeps them few). One process only:
    every process would need the same row count, and an image's row is a global index.
    """
    batches = _train_batches(config, patch, start_step)
    if not (config.get("naflex") and config.naflex.get("pack")):
        return batches
    if jax.process_count() > 1:
        raise ValueError(
            f"naflex.pack=True needs a one-process job; this one has {jax.process_count()} "
            "processes (turn packing off)"
        )
    settings = pack_settings(config)
    return (pack_batch(batch, **settings) for batch in batches)


def _train_batches(config: mc.ConfigDict, patch: Sequence[int], start_step: int):
    """``data_train_batches`` before packing."""
    processes, index = jax.process_count(), jax.process_index()
    shards = sharding.data_shards(config)
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
            finish=naflex_finish(config, patch) if config.get("naflex") else None,
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


def eval_batches(
    config: mc.ConfigDict, entry: Any, mesh: Mesh, patch: Sequence[int]
) -> Iterable[Mapping[str, np.ndarray]]:
    """This process's batches of one `config.evals` entry: its dataset name, size and split.

    Batches hold `config.eval_batch_size` rounded up to a multiple of the mesh's devices
    (`sharding.padded_batch_size`), so any eval batch size works on any mesh.
    """
    side = entry.get("naflex_side")
    return pipeline.make_eval_iterator(
        config.dataset,
        batch_size=sharding.padded_batch_size(config.eval_batch_size, mesh),
        split=entry.split,
        name=entry.name,
        image_size=entry.image_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        finish=None if side is None else naflex_finish(config, patch, side),
    )
