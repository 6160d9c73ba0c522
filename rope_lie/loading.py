"""A trained model back from a workdir: ``load(workdir) -> (model, config)``.

``load`` rebuilds the ViT of the workdir's ``config.model`` (``config.json``, written by
``rope_lie/run_config.py``) and fills it with the parameters of a checkpoint; a checkpoint
that records another model in its ``meta`` (``config.json`` edited since) is refused
(``run_config.check_model``). It reads training
workdirs and the directories written by ``python -m rope_lie.convert`` alike (both hold
``config.json`` with ``model`` and ``dataset``). Inference::

    import rope_lie
    model, config = rope_lie.load("workdirs/quickstart")
    logits_BV = model((images_BHWC / 255 - config.dataset.mean) / config.dataset.std)  # numpy 0-255

``images_BHWC`` are pixel values in [0, 255], (B, H, W, C) (or (B, T, H, W, C) for volumes), at
the training size or any size divisible by the patch; the model runs in evaluation mode
(``train=False``: no dropout) unless called with ``train=True``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections as mc
import numpy as np
from flax import nnx

from rope_lie import checkpoint as ckpt
from rope_lie import finetune, run_config
from rope_lie.models import ViT, vit
from rope_lie.models.attention import check_backends


def build(model_cfg: Mapping[str, Any], params: Mapping[str, Any]) -> ViT:
    """The ViT of ``model_cfg`` holding ``params`` (a pure dict of arrays).

    Raises:
      ValueError: naming every parameter the model lacks, has in excess, or holds in another
        shape.
    """
    model = vit.from_config(dict(model_cfg), rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    wanted = {ckpt.path_name(p): tuple(v.shape) for p, v in leaves}
    given = {ckpt.path_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(params)}
    missing, extra = sorted(set(wanted) - set(given)), sorted(set(given) - set(wanted))
    shapes = [
        f"{k}: {np.shape(given[k])} != {wanted[k]}"
        for k in sorted(set(wanted) & set(given))
        if tuple(np.shape(given[k])) != wanted[k]
    ]
    if missing or extra or shapes:
        raise ValueError(
            f"the parameters do not fit config.model: missing {missing}, unexpected {extra}, "
            f"shapes (given != model) {shapes}"
        )
    values = [np.asarray(given[ckpt.path_name(p)], np.float32) for p, _ in leaves]
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, values))
    nnx.update(model, state)
    return model


def load(
    workdir: str, step: int | None = None, *, attention: str | None = None
) -> tuple[ViT, mc.ConfigDict]:
    """The trained model of a workdir (NNX, weights of its latest checkpoint) and its config.

    Args:
      workdir: a training run's workdir (``python -m rope_lie.main``) or a converted model's
        directory (``python -m rope_lie.convert``).
      step: the checkpoint step to load; None = the latest.
      attention: None keeps the run's ``model.attention`` (refused here where this platform
        cannot run it); a backend name replaces it (the backends compute the same attention).

    Returns:
      (model, config): ``model(images)`` takes (B, H, W, C) float32 images normalised as
      ``(x / 255 - config.dataset.mean) / config.dataset.std`` and returns logits (B, V);
      ``config`` is the workdir's ``config.json``.
    """
    config = run_config.read(workdir)
    if "model" not in config:
        raise ValueError(f"{workdir}/{run_config.CONFIG_JSON} has no 'model' section")
    root = os.path.join(os.path.abspath(os.path.expanduser(workdir)), "checkpoints")
    step, params = finetune.load_params(root if step is None else os.path.join(root, str(step)))
    model_cfg = config.model.to_dict()
    if attention is not None:
        model_cfg["attention"] = attention
    saved = ckpt.load_meta(root, step).get("model")
    run_config.check_model(saved, model_cfg, f"The checkpoint at step {step} in {root}")
    model = build(model_cfg, params)
    try:
        check_backends(model, jax.default_backend())
    except ValueError as e:
        raise ValueError(f"{e}; rope_lie.load(..., attention='xla') loads it for here") from None
    return model, config
