"""Starting a run from another run's weights (``config.init_from``): parameters only.

The LieRE paper's second ImageNet recipe fine-tunes its 224 px model at 256 px; a model that
changes resolution keeps every weight but its absolute table. ``adapt_params`` takes the source
run's parameters into the new model's:

- arrays whose shapes agree are taken as they are (patch embedding, blocks, rotary generators,
  ALiBi slopes, norms; rotary and bias parameters do not depend on the grid);
- the APE grid table ``additive_params/grid_GD`` is resized to the new grid with the APE's own
  resize (``ape.table``: bicubic in 2D, as DeiT/timm fine-tuning at a higher resolution);
- the classifier ``head`` must agree unless ``config.init_head == "new"``, which keeps the new
  model's freshly initialised head (another task, whatever its class count): never silently;
- a parameter one model has and the other lacks, or of another shape, is an error naming it
  and both shapes. Only parameters are compared: settings that hold none (a parameter-free
  family such as RoPE-Axial or ALiBi swapped for another, the pooling, the position
  convention) may differ, and the new config's hold (``train`` prints each model field that
  differs from the one the source's checkpoint recorded).

The positions the rotary parameters act on follow the new model's config. Under the
``"sequential"`` convention (LieRE's) and ``"autoscale"`` (VisionLlama's), positions are
spaced by the model's training grid, which is the new run's: a LieRE model trained on 14x14
tokens and fine-tuned on 16x16 spaces its positions 1/16 apart, not the 1/14 of the source
model evaluated at 16x16. Integer and centred conventions give the same positions either way.

The optimiser state and the step are not taken: the run starts at step 0 with a fresh
optimiser. Once the run has its own checkpoint, resuming uses that and ignores ``init_from``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from rope_lie import checkpoint as ckpt

INIT_HEADS = ("keep", "new")


def load_params(path: str) -> tuple[int, dict[str, Any]]:
    """(step, parameters as numpy arrays) of a run's latest checkpoint or of one step.

    Args:
      path: a workdir (its ``checkpoints/``), a checkpoints directory, or one step's
        directory inside it (``.../checkpoints/500``).
    """
    path, step = checkpoint_step(path)
    step, state = ckpt.load_state(path, step)
    return step, state["params"]


def checkpoint_step(path: str) -> tuple[str, int | None]:
    """(checkpoints directory, step or None for the latest) that `path` names, as
    ``load_params`` reads it; FileNotFoundError naming what is missing."""
    path = os.path.abspath(os.path.expanduser(path))
    step = None
    if os.path.basename(path).isdigit():
        path, step = os.path.dirname(path), int(os.path.basename(path))
    elif os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{path!r}: no such checkpoint directory (expected a workdir with checkpoints/, a "
            "checkpoints directory, or one step's directory inside it)"
        )
    steps = sorted(int(n) for n in os.listdir(path) if n.isdigit())
    if step is not None and step not in steps:
        raise FileNotFoundError(
            f"{path!r} has no checkpoint of step {step}; its steps are {steps} (an ensemble "
            "member keeps its final one only; the others are in its ensemble_dir)"
        )
    return path, step


def adapt_params(
    source: Mapping[str, Any],
    target: Mapping[str, Any],
    *,
    init_head: str = "keep",
) -> dict[str, Any]:
    """The new model's parameters from the source run's (see the module docstring).

    Args:
      source: the source run's parameters (a pure dict of arrays).
      target: the new model's freshly initialised parameters (same structure).
      init_head: "keep" (the head must match) or "new" (target's head, whatever its shape).

    Returns:
      a pure dict with target's structure and shapes.
    """
    src = {ckpt.path_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(source)}
    tgt_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    plan = check_params(source, target, init_head=init_head)
    out = []
    for (path, new), how in zip(tgt_leaves, plan.values(), strict=True):
        old = np.asarray(src[ckpt.path_name(path)]) if how != NEW else None
        if how == TAKE:
            out.append(old.astype(new.dtype))
        elif how == RESIZE:
            out.append(_resize_ape(old, tuple(new.shape[:-1])).astype(new.dtype))
        else:
            out.append(np.asarray(new))
    return jax.tree_util.tree_unflatten(treedef, out)


TAKE, RESIZE, NEW = "take", "resize", "new"  # check_params: what a target parameter gets


def check_params(
    source: Mapping[str, Any], target: Mapping[str, Any], *, init_head: str = "keep"
) -> dict[str, str]:
    """What ``adapt_params`` does with each of target's parameters, by name: ``TAKE`` the
    source's, ``RESIZE`` the source's APE table, or keep the ``NEW`` one (the head, with
    ``init_head="new"``). Reads shapes only, so `target` may be abstract (``jax.eval_shape``).

    Raises:
      ValueError: naming a parameter one model lacks, or one of another shape.
    """
    if init_head not in INIT_HEADS:
        raise ValueError(f"init_head={init_head!r}; expected one of {INIT_HEADS}")
    src = {ckpt.path_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(source)}
    tgt = {ckpt.path_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(target)}
    missing = sorted(set(src) - set(tgt))
    if missing:
        raise ValueError(f"init_from: the new model has no parameters {missing}")
    plan = {}
    for key, new in tgt.items():
        if key.startswith("head/") and init_head == "new":
            plan[key] = NEW
            continue
        if key not in src:
            raise ValueError(f"init_from: the source run has no parameter {key}")
        old_shape = tuple(np.shape(src[key]))
        if old_shape == tuple(new.shape):
            plan[key] = TAKE
        elif key == "additive_params/grid_GD":
            plan[key] = RESIZE
        else:
            hint = " (set init_head='new' for a new classifier)" if "head" in key else ""
            raise ValueError(
                f"init_from: parameter {key} has shape {old_shape} in the source run and "
                f"{tuple(new.shape)} in the new model{hint}"
            )
    return plan


def _resize_ape(grid_GD: np.ndarray, new_grid: tuple[int, ...]) -> np.ndarray:
    from rope_lie.encodings import ape

    params = {"grid_GD": grid_GD}
    emb_TD = ape.table(params, grid_shape=new_grid, width=grid_GD.shape[-1], num_prefix=0)
    return np.asarray(emb_TD).reshape(*new_grid, grid_GD.shape[-1])
