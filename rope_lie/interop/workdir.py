"""A converted model on disk: an Orbax checkpoint and a config, as a training run leaves them.

``save`` writes, into a new directory ``DIR``:

- ``DIR/checkpoints/0/``: the checkpoint layout of ``rope_lie/checkpoint.py`` (step 0, item
  ``state`` = ``{"params": <the ViT's parameters as a pure dict>, "step": 0}``, item ``meta``
  = where the weights came from and ``config.model``), which ``config.init_from=DIR`` reads
  (``rope_lie/finetune.py``);
- ``DIR/config.json``: the converted ``model`` (``ViT`` keyword arguments), ``dataset`` (a
  TFDS name, the training ``image_size`` and the source model's input normalisation
  ``mean``/``std``) and ``interop`` (source, name, checkpoint, notes);
- ``DIR/config.py``: a recipe for ``rope_lie.main`` that builds the whole training config from
  it (``config_lib.base_config()``, the dataset's defaults with those fields, the model):

      python -m rope_lie.main --config=DIR/config.py --config.init_from=DIR --workdir=NEW

``load(DIR)`` (the same function as ``rope_lie.load``, which also loads training workdirs)
returns the NNX model with the converted weights and the config. The model takes
images NHWC (``(B, H, W, C)``), float32, normalised as the source model expects:
``(x / 255 - config.dataset.mean) / config.dataset.std`` per channel, and returns logits
``(B, V)``; any resolution divisible by the patch size works (positions are recomputed, an APE
table is resized).
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
from rope_lie import loading, run_config
from rope_lie.models import ViT, vit
from rope_lie.run_config import CONFIG_JSON, CONFIG_PY

_RECIPE = '''"""{title}

Written by ``python -m rope_lie.convert`` (rope_lie/interop). Its parameters are the checkpoint
beside this file; fine-tune from them with

    python -m rope_lie.main --config={path} --config.init_from={workdir} --workdir=NEW

(set ``--config.dataset.name=...``, ``--config.model.num_classes=...`` and
``--config.init_head=new`` for another dataset). The config itself is ``config.json``.
"""

from rope_lie.interop import workdir


def get_config(arg=None):
    return workdir.recipe_config(__file__, arg)
'''


def _pure_params(model: ViT) -> dict[str, Any]:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def abstract_model(model_cfg: Mapping[str, Any]) -> ViT:
    """The ViT of ``model_cfg`` without arrays (``nnx.eval_shape``): its settings checked."""
    cfg = dict(model_cfg)
    return nnx.eval_shape(lambda: vit.from_config(cfg, rngs=nnx.Rngs(0)))


def check_params(model_cfg: Mapping[str, Any], params: Mapping[str, Any]) -> None:
    """Raise naming every parameter the model lacks, has in excess, or holds in another shape."""
    wanted = {
        ckpt.path_name(p): tuple(v.shape)
        for p, v in jax.tree_util.tree_leaves_with_path(_pure_params(abstract_model(model_cfg)))
    }
    given = {
        ckpt.path_name(p): tuple(np.shape(v))
        for p, v in jax.tree_util.tree_leaves_with_path(params)
    }
    missing, extra = sorted(set(wanted) - set(given)), sorted(set(given) - set(wanted))
    shapes = [
        f"{k}: {given[k]} != {wanted[k]}"
        for k in sorted(set(wanted) & set(given))
        if given[k] != wanted[k]
    ]
    if missing or extra or shapes:
        raise ValueError(
            f"converted parameters do not fit the model: missing {missing}, unexpected {extra}, "
            f"shapes (converted != model) {shapes}"
        )


def build(model_cfg: Mapping[str, Any], params: Mapping[str, Any]) -> ViT:
    """The ViT of ``model_cfg`` holding ``params`` (``rope_lie.loading.build``)."""
    return loading.build(model_cfg, params)


def converted_config(
    model_cfg: Mapping[str, Any],
    *,
    dataset: str,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    interop: Mapping[str, Any],
) -> mc.ConfigDict:
    """What ``config.json`` holds: the model, its dataset and input normalisation, its source.

    Built without the data pipeline (no TensorFlow: a converter imports PyTorch, and the two
    in one process need PyTorch first, ``_torch_first.py``).
    """
    config = mc.ConfigDict()
    config.model = mc.ConfigDict(dict(model_cfg))  # ViT keyword arguments
    config.dataset = mc.ConfigDict()
    config.dataset.name = dataset  # TFDS name for fine-tuning or evaluation runs
    shape = tuple(model_cfg["image_shape"])
    config.dataset.image_size = int(shape[-1])  # training px (the pipeline's are square)
    if len(set(shape)) > 1:  # a fine-tune from here trains on another grid: said, in the notes
        note = (
            f"image_shape={shape} is not square: a fine-tune from this directory trains at "
            f"dataset.image_size={shape[-1]} px square; set --config.dataset.image_size to choose"
        )
        interop = {**interop, "notes": [*interop.get("notes", []), note]}
    config.dataset.mean = tuple(mean)  # input normalisation: (x / 255 - mean) / std
    config.dataset.std = tuple(std)
    config.interop = mc.ConfigDict(dict(interop))  # where the weights came from
    return config


def training_config(converted: mc.ConfigDict) -> mc.ConfigDict:
    """The full training config of a converted model (``config.py``): base defaults, the
    dataset's defaults with the converted fields, the model, one evaluation."""
    from rope_lie import config_lib

    config = config_lib.base_config()
    ds = converted.dataset
    config.dataset = config_lib.dataset_config(ds.name, data_dir=None, mean=ds.mean, std=ds.std)
    config.dataset.image_size = ds.image_size  # px: the converted model's training resolution
    config.model = mc.ConfigDict(converted.model.to_dict())
    config.evals = {"val": config_lib.eval_entry()}
    config.interop = mc.ConfigDict(converted.interop.to_dict())  # informative
    return config


def save(directory: str, config: mc.ConfigDict, params: Mapping[str, Any]) -> str:
    """Write a converted model (see the module docstring) into a new or empty ``directory``."""
    directory = os.path.abspath(os.path.expanduser(directory))
    if os.path.isdir(directory) and os.listdir(directory):
        raise FileExistsError(f"workdir={directory!r} is not empty; convert into a new directory")
    check_params(config.model.to_dict(), params)  # names and shapes (an abstract model)
    os.makedirs(directory, exist_ok=True)
    manager = ckpt.make_manager(
        os.path.join(directory, "checkpoints"), every_steps=1, keep=1, async_save=False
    )
    state = {"params": jax.tree.map(lambda v: np.asarray(v, np.float32), params), "step": 0}
    meta = {
        "step": 0,
        "interop": config.interop.to_dict(),
        "model": run_config.model_record(config.model),
    }
    ckpt.save(manager, 0, state, meta, force=True)
    manager.wait_until_finished()
    manager.close()
    with open(os.path.join(directory, CONFIG_JSON), "w") as f:
        f.write(config.to_json(indent=2))
    title = f"Converted {config.interop.source} model {config.interop.name}."
    recipe = _RECIPE.format(title=title, path=os.path.join(directory, CONFIG_PY), workdir=directory)
    with open(os.path.join(directory, CONFIG_PY), "w") as f:
        f.write(recipe)
    return directory


def read_config(directory: str) -> mc.ConfigDict:
    """The ``config.json`` of a converted model's directory (``rope_lie.run_config.read``)."""
    return run_config.read(directory)


def recipe_config(recipe_path: str, arg: str | None = None) -> mc.ConfigDict:
    """``get_config`` of a converted model's ``config.py``: ``training_config`` of its
    ``config.json``."""
    if arg:
        raise ValueError(
            f"{recipe_path} takes no argument (got {arg!r}); override fields with "
            "--config.<key>=<value>"
        )
    return training_config(read_config(os.path.dirname(os.path.abspath(recipe_path))))


# A converted model's directory loads like a training run's workdir: one call for both.
load = loading.load
