"""A run's config on disk: written beside what the run produces, read back as a recipe.

Every training run writes, before its first step (``train.train_and_evaluate``):

- ``WORKDIR/config.json``: the resolved config (recipe, its arguments and every command-line
  override applied), ``ConfigDict.to_json``;
- ``WORKDIR/config.py``: a recipe that returns that config, so the run can be repeated or
  resumed from the workdir alone::

      python -m rope_lie.main --config=WORKDIR/config.py --workdir=WORKDIR

``read(workdir)`` returns the ``config.json`` of a training workdir or of a directory written
by ``python -m rope_lie.convert``; ``rope_lie/loading.py`` builds the trained model from it.

``check_resume(workdir, config)``: a workdir that holds a checkpoint resumes only under the
config that wrote it, but for ``MAY_CHANGE`` (what is evaluated and logged, how often it is
saved, where the data lie, the mesh, and the run's length: the cosine schedule of the steps
still to run then follows the new length).
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections as mc

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


# Fields a resumed run may change: they do not change what a training step computes. Not
# ``data_shards``: it composes each batch, so a run resumes on another topology by keeping it.
MAY_CHANGE = (
    "evals",
    "eval_batch_size",
    "eval_every_steps",
    "eval_every_epochs",
    "log_every_steps",
    "checkpoint",
    "tensorboard",
    "progress",
    "mesh",
    "distributed",
    "multihost",
    "fsdp_min_size",
    "total_steps",
    "num_epochs",
    "dataset.data_dir",
    "dataset.eval_split",
    "dataset.eval_crop_fraction",
    "model.attention",  # the backends compute the same attention
    "model.fold_mix",  # P folded or applied per token: the same logits
)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def check_resume(workdir: str, config: mc.ConfigDict, checkpoints: str | None = None) -> None:
    """Raise ``ValueError`` when `workdir` holds a checkpoint written under another config: a
    field outside ``MAY_CHANGE`` that both configs have and that differs (fields the saved one
    lacks, from an older rope_lie, are not compared). A workdir without a checkpoint passes.

    ``checkpoints``: where the run's checkpoints are, when not in ``workdir/checkpoints`` (an
    ensemble member's: the ensemble's stacked ones, ``rope_lie/ensemble.py``)."""
    workdir = os.path.abspath(os.path.expanduser(workdir))
    checkpoints = checkpoints or os.path.join(workdir, "checkpoints")
    path = os.path.join(workdir, CONFIG_JSON)
    if not os.path.isdir(checkpoints) or not os.path.isfile(path):
        return
    if not any(name.isdigit() for name in os.listdir(checkpoints)):
        return
    with open(path) as f:
        saved = _flat(json.load(f))
    now = _flat(json.loads(config.to_json_best_effort()))
    differ = [
        key
        for key in sorted(set(saved) & set(now))
        if saved[key] != now[key]
        and not any(key == m or key.startswith(m + ".") for m in MAY_CHANGE)
    ]
    if differ:
        key = differ[0]
        more = f" (and {len(differ) - 1} more: {', '.join(differ[1:4])})" if differ[1:] else ""
        raise ValueError(
            f"{workdir} holds a checkpoint of another config: {key}={saved[key]!r} there, "
            f"{now[key]!r} here{more}. Resume it with its own config "
            f"(--config={os.path.join(workdir, CONFIG_PY)}), or train in another workdir"
        )


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
