"""A run's config on disk, and the trained model back from a workdir: ``load(workdir)``.

Every training run writes, before its first step (``train.train_and_evaluate``):

- ``WORKDIR/config.json``: the resolved config (recipe, its arguments and every command-line
  override applied), ``ConfigDict.to_json``;
- ``WORKDIR/config.py``: a recipe that returns that config, so the run can be repeated or
  resumed from the workdir alone::

      python -m rope_lie.main --config=WORKDIR/config.py --workdir=WORKDIR

``load(workdir) -> (model, config)`` rebuilds the ViT of ``config.model`` and fills it with the
parameters of the latest checkpoint. It reads training workdirs and the directories written by
``python -m rope_lie.convert`` alike (both hold ``config.json`` with ``model`` and ``dataset``).
Inference::

    import rope_lie
    model, config = rope_lie.load("workdirs/quickstart")
    logits_BV = model((images_BHWC / 255 - config.dataset.mean) / config.dataset.std)  # numpy 0-255

``images_BHWC`` are pixel values in [0, 255], (B, H, W, C) (or (B, T, H, W, C) for volumes), at
the training size or any size divisible by the patch; the model runs in evaluation mode
(``train=False``: no dropout) unless called with ``train=True``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ml_collections as mc

if TYPE_CHECKING:
    from rope_lie.models import ViT

CONFIG_JSON = "config.json"
CONFIG_PY = "config.py"

_RECIPE = '''"""The resolved config of the run in this directory (its config.json), as a recipe.

Written by rope_lie at the start of the run. Repeat or resume the run with

    python -m rope_lie.main --config={path} --workdir={workdir}

and override fields as usual (--config.total_steps=...).
"""

from rope_lie import run_config


def get_config(arg=None):
    return run_config.recipe_config(__file__, arg)
'''


def write(workdir: str, config: mc.ConfigDict) -> None:
    """Write ``config.json`` and ``config.py`` into `workdir` (process 0 only)."""
    import jax

    if jax.process_index() != 0:
        return
    workdir = os.path.abspath(os.path.expanduser(workdir))
    path_json = os.path.join(workdir, CONFIG_JSON)
    with open(path_json + ".tmp", "w") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    os.replace(path_json + ".tmp", path_json)
    recipe = _RECIPE.format(path=os.path.join(workdir, CONFIG_PY), workdir=workdir)
    with open(os.path.join(workdir, CONFIG_PY), "w") as f:
        f.write(recipe)


def _as_tuples(value: Any) -> Any:
    """JSON lists back to the tuples the config holds (image_shape, mean, std)."""
    if isinstance(value, list):
        return tuple(_as_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_tuples(v) for k, v in value.items()}
    return value


def read(workdir: str) -> mc.ConfigDict:
    """The ``config.json`` of a workdir (a training run's or a converted model's)."""
    path = os.path.join(os.path.abspath(os.path.expanduser(workdir)), CONFIG_JSON)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist: {workdir!r} is not a directory written by rope_lie.main "
            "or rope_lie.convert"
        )
    with open(path) as f:
        return mc.ConfigDict(_as_tuples(json.load(f)))


def recipe_config(recipe_path: str, arg: str | None = None) -> mc.ConfigDict:
    """``get_config`` of a workdir's ``config.py``: the ``config.json`` beside it."""
    if arg:
        raise ValueError(
            f"{recipe_path} takes no argument (got {arg!r}); override fields with "
            "--config.<key>=<value>"
        )
    return read(os.path.dirname(os.path.abspath(recipe_path)))


def build(model_cfg: Mapping[str, Any], params: Mapping[str, Any]) -> ViT:
    """The ViT of ``model_cfg`` holding ``params`` (a pure dict of arrays).

    Raises:
      ValueError: naming every parameter the model lacks, has in excess, or holds in another
        shape.
    """
    import jax
    import numpy as np
    from flax import nnx

    from rope_lie import checkpoint as ckpt
    from rope_lie.models import ViT

    cfg = dict(model_cfg)
    model = ViT(**cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    wanted = {ckpt.path_name(p): tuple(v.shape) for p, v in leaves}
    given = {ckpt.path_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(params)}
    missing, extra = sorted(set(wanted) - set(given)), sorted(set(given) - set(wanted))
    shapes = [f"{k}: {np.shape(given[k])} != {wanted[k]}" for k in sorted(set(wanted) & set(given))
              if tuple(np.shape(given[k])) != wanted[k]]  # fmt: skip
    if missing or extra or shapes:
        raise ValueError(
            f"the parameters do not fit config.model: missing {missing}, unexpected {extra}, "
            f"shapes (given != model) {shapes}"
        )
    values = [np.asarray(given[ckpt.path_name(p)], np.float32) for p, _ in leaves]
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, values))
    nnx.update(model, state)
    return model


def load(workdir: str, step: int | None = None) -> tuple[ViT, mc.ConfigDict]:
    """The trained model of a workdir (NNX, weights of its latest checkpoint) and its config.

    Args:
      workdir: a training run's workdir (``python -m rope_lie.main``) or a converted model's
        directory (``python -m rope_lie.convert``).
      step: the checkpoint step to load; None = the latest.

    Returns:
      (model, config): ``model(images)`` takes (B, H, W, C) float32 images normalised as
      ``(x / 255 - config.dataset.mean) / config.dataset.std`` and returns logits (B, V);
      ``config`` is the workdir's ``config.json``.
    """
    from rope_lie import finetune

    config = read(workdir)
    if "model" not in config:
        raise ValueError(f"{workdir}/{CONFIG_JSON} has no 'model' section")
    root = os.path.join(os.path.abspath(os.path.expanduser(workdir)), "checkpoints")
    _, params = finetune.load_params(root if step is None else os.path.join(root, str(step)))
    return build(config.model.to_dict(), params), config
