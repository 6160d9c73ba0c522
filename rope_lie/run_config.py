"""A run's config on disk: written beside what the run produces, read back as a recipe.

Every training run writes, before its first step (``train.train_and_evaluate``):

- ``WORKDIR/config.json``: the resolved config (recipe, its arguments and every command-line
  override applied), ``ConfigDict.to_json``;
- ``WORKDIR/config.py``: a recipe that returns that config, so the run can be repeated or
  resumed from the workdir alone::

      python -m rope_lie.main --config=WORKDIR/config.py --workdir=WORKDIR

``read(workdir)`` returns the ``config.json`` of a training workdir or of a directory written
by ``python -m rope_lie.convert``; ``rope_lie/loading.py`` builds the trained model from it.
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
