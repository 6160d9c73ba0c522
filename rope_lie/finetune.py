"""Starting a run from another run's weights (``config.init_from``): parameters only.

The LieRE paper's second ImageNet recipe fine-tunes its 224 px model at 256 px; a model that
changes resolution keeps every weight but its absolute table. ``adapt_params`` takes the source
run's parameters into the new model's:

- arrays whose shapes agree are taken as they are (patch embedding, blocks, rotary generators,
  ALiBi slopes, norms; rotary and bias parameters do not depend on the grid);
- the APE grid table ``additive_params/grid_GD`` is resized to the new grid with the APE's own
  resize (``ape.table``: bicubic in 2D, as DeiT/timm fine-tuning at a higher resolution);
- the classifier ``head`` must agree unless ``config.init_head == "new"``, which keeps the new
  model's freshly initialised head (for another class count): never silently;
- anything else that differs is an error naming the parameter and both shapes.

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
    step, state = ckpt.load_state(path, step)
    return step, state["params"]


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
      init_head: "keep" (the head must match) or "new" (keep target's head if shapes differ).

    Returns:
      a pure dict with target's structure and shapes.
    """
    if init_head not in INIT_HEADS:
        raise ValueError(f"init_head={init_head!r}; expected one of {INIT_HEADS}")
    src = {ckpt.path_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(source)}
    tgt_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    missing = sorted(set(src) - {ckpt.path_name(p) for p, _ in tgt_leaves})
    if missing:
        raise ValueError(f"init_from: the new model has no parameters {missing}")
    out = []
    for path, new in tgt_leaves:
        key = ckpt.path_name(path)
        if key not in src:
            raise ValueError(f"init_from: the source run has no parameter {key}")
        old = np.asarray(src[key])
        if old.shape == tuple(new.shape):
            out.append(old.astype(new.dtype))
        elif key == "additive_params/grid_GD":
            out.append(_resize_ape(old, tuple(new.shape[:-1])).astype(new.dtype))
        elif key.startswith("head/") and init_head == "new":
            out.append(np.asarray(new))
        else:
            hint = " (set init_head='new' for a new classifier)" if "head" in key else ""
            raise ValueError(
                f"init_from: parameter {key} has shape {old.shape} in the source run and "
                f"{tuple(new.shape)} in the new model{hint}"
            )
    return jax.tree_util.tree_unflatten(treedef, out)


def _resize_ape(grid_GD: np.ndarray, new_grid: tuple[int, ...]) -> np.ndarray:
    from rope_lie.encodings import ape

    params = {"grid_GD": grid_GD}
    emb_TD = ape.table(params, grid_shape=new_grid, width=grid_GD.shape[-1], num_prefix=0)
    return np.asarray(emb_TD).reshape(*new_grid, grid_GD.shape[-1])
