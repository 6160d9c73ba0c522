"""Evaluation: loss and accuracy over a whole split, at any resolution, optionally shuffled.

Position-encoder states (LieRE's rotations, Cayley-STRING's P, ALiBi's bias) depend only on the
parameters and the token grid, so ``evaluate`` computes them once per resolution and passes them
to every batch (``make_eval_step(..., precompute_fn=...)``): an eval batch then costs what it
costs with a cheap encoder.

Shuffled-patch evaluation (LieRE, Sec. 5.5) permutes the image's patches *before*
patchification, with one random permutation per example, so it works with any model whose
tokens are the patches: a model that ignores positions scores the same shuffled or not.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from tqdm import tqdm

from rope_lie import sharding
from rope_lie.models import tokens

TOKEN_KEYS = ("patches", "index", "grid", "token_mask")  # a NaFlex batch (data/naflex.py)
# A packed NaFlex batch (run_inputs.pack_batch): rows of several images; image n of the batch is
# slot image_slot[n] of row image_row[n].
PACKED_KEYS = ("patches", "index", "segment", "slot_grid")
PLACE_KEYS = ("image_row", "image_slot")


def batch_tokens(batch: Mapping[str, Any]) -> tokens.Tokens:
    """The ``tokens.Tokens`` of a NaFlex batch's arrays."""
    return tokens.Tokens(*(batch[k] for k in TOKEN_KEYS))


def batch_packed(batch: Mapping[str, Any]) -> tokens.Packed:
    """The ``tokens.Packed`` of a packed NaFlex batch's arrays."""
    return tokens.Packed(*(batch[k] for k in PACKED_KEYS))


def cross_entropy(logits_BV: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example softmax cross-entropy (B,) with integer labels (B,) or soft labels (B, V)."""
    logits_BV = logits_BV.astype(jnp.float32)
    if labels.ndim == logits_BV.ndim:
        return optax.softmax_cross_entropy(logits_BV, labels.astype(jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(logits_BV, labels)


def shuffle_patches(
    images: np.ndarray, patch: Sequence[int], rng: np.random.Generator
) -> np.ndarray:
    """Permute the non-overlapping patches of each image (2D) or volume (3D) at random.

    Args:
      images: (B, *spatial, C), spatial divisible by `patch`.
      patch: patch (or tubelet) size per spatial axis.
      rng: source of one permutation per example, from T uniform draws each (T patches; a
        stream skips n examples with ``rng.bit_generator.advance(n * T)``).

    Returns:
      array of the same shape and dtype whose patches are those of `images`, reordered.
    """
    batch, *spatial, _ = images.shape
    if len(spatial) != len(patch) or any(s % p for s, p in zip(spatial, patch, strict=True)):
        raise ValueError(f"images spatial shape {tuple(spatial)} not divisible by patch {patch}")
    blocks = tokens.patch_blocks(images, patch)  # (B, *grid, *patch, C)
    patches = blocks.reshape(batch, -1, *blocks.shape[1 + len(patch) :])  # (B, T, *patch, C)
    perm_BT = np.argsort(rng.random(patches.shape[:2]), axis=1)
    patches = np.take_along_axis(
        patches, perm_BT.reshape(perm_BT.shape + (1,) * (patches.ndim - 2)), axis=1
    )
    return tokens.unpatch_blocks(patches.reshape(blocks.shape), patch)


class EvalStep(NamedTuple):
    """The jitted pieces of evaluation (from ``make_eval_step``).

    step: (params, batch, cache) -> {loss_sum, correct, count} over the unmasked examples, plus
      the per-example "correct_B" and "mask_B" (B,).
    precompute: (params, spatial_shape) -> cache, the encoder states at that resolution
      (``spatial_shape`` static); None when the model takes no cache (``cache`` is then None).
      When ``precompute_fn`` takes an ``extrapolation`` keyword, ``precompute(params,
      spatial_shape, extrapolation=tool)`` gives the states under that tool (static too).
    """

    step: Callable
    precompute: Callable | None


def make_eval_step(
    apply_fn: Callable[[Any, jax.Array, Any], jax.Array],
    precompute_fn: Callable[[Any, tuple[int, ...]], Any] | None = None,
) -> EvalStep:
    """Jitted evaluation of one batch, and of the encoder states it may reuse.

    Args:
      apply_fn: (params, images, cache) -> logits_BV in eval mode (no dropout); cache is
        ``precompute_fn``'s output for the images' spatial shape, or None without one. A
        NaFlex batch (no "image") passes ``batch_tokens(batch)`` as the images, and no cache.
      precompute_fn: (params, spatial_shape) -> cache, e.g. ``ViT.precompute_pe`` of the
        grid; None to compute everything per batch. With an ``extrapolation`` keyword
        argument (a tool name or None, ``ViT.precompute_pe``), the evaluation entries'
        ``extrapolation`` tools reach it.
    """

    @jax.jit
    def eval_step(params, batch, cache):
        inputs = batch["image"] if "image" in batch else batch_tokens(batch)
        logits_BV = apply_fn(params, inputs, cache)
        mask_B = batch.get("mask", jnp.ones(logits_BV.shape[:1], bool)).astype(jnp.float32)
        loss_B = cross_entropy(logits_BV, batch["label"])
        correct_B = (jnp.argmax(logits_BV, axis=-1) == batch["label"]).astype(jnp.float32)
        return {
            "loss_sum": jnp.sum(loss_B * mask_B),
            "correct": jnp.sum(correct_B * mask_B),
            "count": jnp.sum(mask_B),
            "correct_B": correct_B.astype(bool),
            "mask_B": mask_B.astype(bool),
        }

    precompute = None
    if precompute_fn is not None:
        tools = "extrapolation" in inspect.signature(precompute_fn).parameters
        static = dict(static_argnames=("extrapolation",)) if tools else {}
        precompute = jax.jit(precompute_fn, static_argnums=1, **static)
    return EvalStep(eval_step, precompute)


def evaluate(
    eval_step: Callable,
    params: Any,
    batches: Iterable[Mapping[str, np.ndarray]],
    mesh: Mesh,
    *,
    shuffle_patch: Sequence[int] | None = None,
    seed: int = 0,
    extrapolation: str | None = None,
) -> dict[str, float]:
    """Accuracy, mean loss and example count over every batch of an eval iterator.

    Args:
      eval_step: from `make_eval_step`; its encoder states are computed once per resolution.
      params: the model parameters (already sharded).
      batches: numpy dicts with "image", "label" and optionally "mask" (padding = 0).
      mesh: the device mesh; batches are split over all its devices.
      shuffle_patch: when set, shuffle patches of this size (one permutation per example,
        reproducible from `seed`, the same on any number of processes: a batch's
        ``first_example`` says where this process's part of the split starts).
      seed: seed of the shuffling.
      extrapolation: None, or the tool the encoder states are computed with
        (``ViT.precompute_pe``'s ``extrapolation``; fixed-size images only).

    Returns:
      {"accuracy", "loss", "num_examples", "resolution", "correct"}: resolution is the spatial
      shape "HxW"; correct is a bool numpy array, one entry per example in the order read (the
      bootstrap CIs and paired tests of experiments/studies need it).
    """
    totals = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
    correct = []
    resolution = ""
    rng = np.random.default_rng(seed)
    caches = {}  # spatial shape -> encoder states, computed once for these params
    first = None  # where this process's part of the split starts; the shuffling skips to it
    for batch in batches:
        first = int(batch.get("first_example", 0)) if first is None else first
        batch = {k: batch[k] for k in ("image", "label", "mask", *TOKEN_KEYS) if k in batch}
        if "image" not in batch:  # NaFlex tokens: positions per example, no shared cache
            if shuffle_patch is not None:
                raise ValueError("shuffle_patches needs fixed-size images, not NaFlex tokens")
            if extrapolation is not None:
                raise ValueError(
                    f"extrapolation={extrapolation!r} needs fixed-size images, not NaFlex tokens"
                )
            resolution = f"tokens{batch['patches'].shape[1]}"
            sums = eval_step.step(params, sharding.shard_batch(batch, mesh), None)
            correct.append(_add_sums(totals, sums, mesh))
            continue
        spatial = tuple(int(d) for d in batch["image"].shape[1:-1])
        resolution = "x".join(str(d) for d in spatial)
        if extrapolation is not None and eval_step.precompute is None:
            raise ValueError(f"extrapolation={extrapolation!r} needs an eval step with precompute")
        if eval_step.precompute is not None and spatial not in caches:
            if extrapolation is None:
                caches[spatial] = eval_step.precompute(params, spatial)
            else:
                caches[spatial] = eval_step.precompute(params, spatial, extrapolation=extrapolation)
        if shuffle_patch is not None:
            if first:  # skip the draws of the split's examples before this process's part
                grid = tokens.token_grid(spatial, shuffle_patch, "images spatial shape")
                rng.bit_generator.advance(first * math.prod(grid))
                first = 0
            batch["image"] = shuffle_patches(batch["image"], shuffle_patch, rng)
        sums = eval_step.step(params, sharding.shard_batch(batch, mesh), caches.get(spatial))
        correct.append(_add_sums(totals, sums, mesh))
    count = totals["count"]
    if count == 0:
        raise ValueError("Evaluation saw no examples (empty split or every example masked).")
    return {
        "accuracy": totals["correct"] / count,
        "loss": totals["loss_sum"] / count,
        "num_examples": int(count),
        "resolution": resolution,
        # process p read the split's p-th contiguous part: its batches, then p + 1's
        "correct": np.concatenate([c[p] for p in range(jax.process_count()) for c in correct]),
    }


def _add_sums(totals: dict[str, float], sums: dict[str, Any], mesh: Mesh) -> list[np.ndarray]:
    """Adds one batch's sums to ``totals``; returns its unmasked examples' correctness, one
    array per process (every process gets every process's entries): process p's local
    examples in the order it read them, whatever the mesh's order of the devices."""
    per_example = [sums.pop("correct_B"), sums.pop("mask_B")]
    if jax.process_count() > 1:
        spec = sharding.batch_sharding(mesh).spec
        local = multihost_utils.global_array_to_host_local_array(per_example, mesh, [spec] * 2)
        per_example = multihost_utils.process_allgather(local, tiled=False)  # (P, local B)
    sums, (correct, mask) = jax.device_get((sums, per_example))
    for key in totals:
        totals[key] += float(sums[key])
    correct_PB = np.asarray(correct).reshape(jax.process_count(), -1)
    mask_PB = np.asarray(mask).reshape(jax.process_count(), -1)
    return [c[m] for c, m in zip(correct_PB, mask_PB, strict=True)]


def check_extrapolation(model: Any, evals: Mapping[str, Any]) -> None:
    """Every ``evals`` entry's ``extrapolation`` tool works for this model (before training).

    Each is traced (``jax.eval_shape``, no arrays) at twice the training grid, where every tool
    acts, so an unknown tool, one the family or convention does not support, or a spectrum NTK
    and YaRN refuse fails now, with the entry's name.

    Args:
      model: the ``ViT`` (an abstract one from ``nnx.eval_shape`` will do).
      evals: ``config.evals``.
    """
    grid = tuple(2 * n for n in model.train_grid)
    graphdef, state = nnx.split(model)

    def states(abstract_state, tool):
        return nnx.merge(graphdef, abstract_state).precompute_pe(grid, tool)

    for name, entry in evals.items():
        tool = entry.get("extrapolation")
        if tool is None:
            continue
        if entry.get("naflex_side") is not None:
            raise ValueError(
                f"evals.{name}.extrapolation={tool!r}: extrapolation tools need fixed-size "
                "images, not NaFlex tokens"
            )
        try:
            jax.eval_shape(functools.partial(states, tool=tool), state)
        except ValueError as e:
            raise ValueError(f"evals.{name}.extrapolation={tool!r}: {e}") from None


def evaluate_all(
    evals: Mapping[str, Any],
    batches: Callable[[Any], Iterable[Mapping[str, np.ndarray]]],
    eval_step: EvalStep,
    params: Any,
    mesh: Mesh,
    *,
    patch: Sequence[int],
    step: int,
    best: dict[str, dict[str, Any]],
    seed: int,
    progress: bool = False,
    final: bool = True,
) -> dict[str, dict[str, Any]]:
    """Evaluate every entry of `evals` (``config.evals``) at train step `step`.

    Args:
      evals: name -> entry (its dataset name, split, image_size, shuffle_patches, ...).
      batches: entry -> this process's eval batches of it (``run_inputs.eval_batches``).
      eval_step: from `make_eval_step`.
      params: the model parameters (sharded).
      mesh: the device mesh.
      patch: the model's patch size, for entries with `shuffle_patches`.
      step: the train step, recorded with a new best.
      best: name -> {"accuracy", "step"} of the best evaluation so far; updated in place.
      seed: seed of the patch shuffling.
      progress: show each evaluation's own progress bar (process 0).
      final: whether this is the run's last evaluation; before it, entries with
        ``final_only`` are skipped.

    Returns:
      name -> `evaluate` results (per-example "correct" included) plus "best_accuracy" and
      "best_step".
    """
    results = {}
    for name, entry in evals.items():
        if not final and entry.get("final_only", False):
            continue
        entry_batches = tqdm(
            batches(entry),
            desc=f"eval {name}",
            unit="batch",
            leave=False,
            disable=not progress or jax.process_index() != 0,
            dynamic_ncols=True,
            mininterval=1.0,
        )
        try:
            res = evaluate(
                eval_step,
                params,
                entry_batches,
                mesh,
                shuffle_patch=patch if entry.shuffle_patches else None,
                seed=seed,
                extrapolation=entry.get("extrapolation"),
            )
        except ValueError as e:  # which evaluation, and of what
            what = " ".join(str(p) for p in (entry.get("name"), entry.get("split")) if p)
            raise ValueError(f"evals.{name} ({what or 'the dataset eval_split'}): {e}") from e
        if name not in best or res["accuracy"] > best[name]["accuracy"]:
            best[name] = {"accuracy": res["accuracy"], "step": step}
        res.update(best_accuracy=best[name]["accuracy"], best_step=best[name]["step"])
        results[name] = res
    return results
