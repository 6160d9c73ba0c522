"""A run's config on disk: written beside what the run produces, read back as a recipe.

Every training run writes, before its first step (``train.train_and_evaluate``):

- ``WORKDIR/config.json``: the resolved config (recipe, its arguments and every command-line
  override applied), ``ConfigDict.to_json``;
- ``WORKDIR/config.py``: a recipe that returns that config, so the run can be repeated or
  resumed from the workdir alone::

      python -m rope_lie.main --config=WORKDIR/config.py --workdir=WORKDIR

``read(workdir)`` returns the ``config.json`` of a training workdir or of a directory written
by ``python -m rope_lie.convert``, with the dataset fields added since it was written
(``ADDED_DATASET_FIELDS``) at the value its tree used; ``rope_lie/loading.py`` builds the
trained model from it.

``check_resume(workdir, config)``: a workdir that holds a checkpoint resumes only under the
config that wrote it, but for ``MAY_CHANGE`` (what is evaluated and logged, how often it is
saved, where the data lie, the mesh, and the run's length: the cosine schedule of the steps
still to run then follows the new length).

``check_model(saved, model_cfg, where)``: each checkpoint's ``meta`` records ``config.model``
(``model_record``); a resume (``rope_lie/train.py``, ``rope_lie/ensemble.py``) or a load
(``rope_lie/loading.py``) under a model that differs from it by the same rules is refused,
so that an edited ``config.json`` cannot change what a checkpoint computes unnoticed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import ml_collections as mc

from rope_lie import config_lib

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
    """Leaves by dotted path; an empty dict is a leaf ({}), so that it differs from a filled one."""
    if isinstance(tree, dict) and tree:
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


# Fields whose presence is the setting: options dicts (a family's init arguments, the position
# hook's) and sections only some runs have. A key in one config only is a difference there; in
# the schema's fixed sections it is a field a newer or older rope_lie added or removed.
_OPTIONAL = ("naflex", "model.position_augment", "model.pe_hparams", "model.position_hparams")


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()


def _is_option(key: str) -> bool:
    return any(key == o or key.startswith(o + ".") for o in _OPTIONAL)


def _may_change(key: str) -> bool:
    return any(key == m or key.startswith(m + ".") for m in MAY_CHANGE)


def _model_defaults() -> dict[str, Any]:
    """``model.<field>`` -> the ViT argument's default, as JSON holds it (the fields a newer
    rope_lie adds to ``config.model`` come with one)."""
    import inspect

    from rope_lie.models import vit  # Flax: the train extra, as ml_collections

    params = inspect.signature(vit.ViT.__init__).parameters.values()
    found = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    return _flat(json.loads(json.dumps({"model": found}, default=str)))


def _same_default(value: Any, default: Any) -> bool:
    """Whether `value` is `default`, None and {} being one (an empty options dict is none)."""
    return value == default or (value in (None, {}) and default in (None, {}))


def _differences(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved value, value here) for every field that differs and may not change. A field
    only one side has differs when it is an option (``_OPTIONAL``) that is on (not None or {}:
    an option off is one absent, as written before it existed), or, in the run's config only,
    when it is a default field (``config_lib.base_config``) set away from its default; other
    one-sided fields are schema changes between rope_lie versions and are not compared.
    The defaults of ``config.model``'s fields are the ViT's arguments'."""
    defaults = {
        **_flat(json.loads(config_lib.base_config().to_json_best_effort())),
        **_model_defaults(),
    }
    differ = []
    for key in sorted(set(saved) | set(now)):
        if _may_change(key):
            continue
        if key in saved and key in now:
            off = _is_option(key) and saved[key] in (None, {}) and now[key] in (None, {})
            if saved[key] != now[key] and not off:  # None and {}: an option off either way
                differ.append((key, saved[key], now[key]))
        elif _is_option(key):
            if (saved[key] if key in saved else now[key]) not in (None, {}):  # off = absent
                differ.append((key, saved.get(key, _ABSENT), now.get(key, _ABSENT)))
        elif key in now and key in defaults and not _same_default(now[key], defaults[key]):
            differ.append((key, _ABSENT, now[key]))  # a field the run predates, set here
    # a value changed is named first, then a one-sided option's innermost field
    return sorted(differ, key=lambda d: (_ABSENT in d[1:], -d[0].count(".")))


def check_resume(workdir: str, config: mc.ConfigDict, checkpoints: str | None = None) -> None:
    """Raise ``ValueError`` when `workdir` holds a checkpoint written under another config: a
    field outside ``MAY_CHANGE`` that differs, including an option one config has and the
    other lacks (``model.pe_hparams`` keys, ``model.position_augment``, ``naflex``). Fields a
    newer rope_lie added pass at their defaults, and fields it removed are not compared, so a
    run resumes on a newer tree. A workdir without a checkpoint passes.

    ``checkpoints``: where the run's checkpoints are, when not in ``workdir/checkpoints`` (an
    ensemble member's: the ensemble's stacked ones, ``rope_lie/ensemble.py``)."""
    workdir = os.path.abspath(os.path.expanduser(workdir))
    checkpoints = checkpoints or os.path.join(workdir, "checkpoints")
    path = os.path.join(workdir, CONFIG_JSON)
    if not os.path.isdir(checkpoints) or not os.path.isfile(path):
        return
    if not any(name.isdigit() for name in os.listdir(checkpoints)):
        return
    saved = _flat(_load_json(path))
    differ = _differences(saved, _flat(json.loads(config.to_json_best_effort())))
    if differ:
        key, there, here = differ[0]
        names = ", ".join(k for k, _, _ in differ[1:4])
        more = f" (and {len(differ) - 1} more: {names})" if differ[1:] else ""
        raise ValueError(
            f"{workdir} holds a checkpoint of another config: {key}={there!r} there, "
            f"{here!r} here{more}. Resume it with its own config "
            f"(--config={os.path.join(workdir, CONFIG_PY)}), or train in another workdir"
        )


def model_record(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``config.model`` as JSON (tuples as lists): what each checkpoint's ``meta`` records of
    the model that wrote it, under ``"model"``."""
    return json.loads(mc.ConfigDict(model_cfg).to_json_best_effort())


def check_model(saved: Mapping[str, Any] | None, model_cfg: Mapping[str, Any], where: str) -> None:
    """Raise ``ValueError`` when `model_cfg` is not the model a checkpoint recorded (`saved`,
    its meta's ``"model"``) in a field that changes what the model computes: one outside
    ``MAY_CHANGE`` that differs, or an option only one side has on (``check_resume``'s
    rules). The error names the fields, the checkpoint's value and this one. A checkpoint
    without the record (``saved`` None, written before it was kept) is not checked.

    `where`: the checkpoint, as the error names it.
    """
    differ = _model_differences(saved, model_cfg)
    if differ:
        shown = "; ".join(f"{k}={there!r} there, {here!r} here" for k, there, here in differ[:4])
        more = f" (and {len(differ) - 4} more)" if differ[4:] else ""
        raise ValueError(
            f"{where} was trained with another model than this config.model: {shown}{more}. "
            "Set these fields back to the checkpoint's values (its workdir's config.json was "
            "edited after it was written?), or train in another workdir"
        )


def model_changes(saved: Mapping[str, Any] | None, model_cfg: Mapping[str, Any]) -> list[str]:
    """The fields in which `model_cfg` is not the model a checkpoint recorded (`saved`, its
    meta's ``"model"``; [] without one), by ``check_model``'s rules, as "field=<there> (here
    <value>)": what a fine-tune (``init_from``) changes of its source's model."""
    return [
        f"{k}={there!r} (here {here!r})" for k, there, here in _model_differences(saved, model_cfg)
    ]


def _model_differences(
    saved: Mapping[str, Any] | None, model_cfg: Mapping[str, Any]
) -> list[tuple[str, Any, Any]]:
    """``_differences`` of a checkpoint's recorded model and `model_cfg` ([] without a record)."""
    if saved is None:
        return []
    return _differences(_flat({"model": dict(saved)}), _flat({"model": model_record(model_cfg)}))


def _as_tuples(value: Any) -> Any:
    """JSON lists back to the tuples the config holds (image_shape, mean, std)."""
    if isinstance(value, list):
        return tuple(_as_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_tuples(v) for k, v in value.items()}
    return value


def read(workdir: str) -> mc.ConfigDict:
    """The ``config.json`` of a workdir (a training run's or a converted model's), with the
    dataset fields added since it was written (``ADDED_DATASET_FIELDS``)."""
    path = os.path.join(os.path.abspath(os.path.expanduser(workdir)), CONFIG_JSON)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist: {workdir!r} is not a directory written by rope_lie.main "
            "or rope_lie.convert"
        )
    return mc.ConfigDict(_as_tuples(with_added_dataset_fields(_load_json(path), path)))


# Dataset fields added after workdirs began keeping config.json, with the value that gives
# what the trees before the field did.
ADDED_DATASET_FIELDS = {
    # crop="inception"'s smallest crop area: augment.inception_crop's area_range=(0.08, 1.0)
    # before it was a field; unread under crop="none" or "pad"
    "augment.crop_area_min": 0.08,
}


def _lacks(section: dict[str, Any], key: str) -> bool:
    """Whether `section` has the node that holds dotted `key` but not `key` itself."""
    *parents, leaf = key.split(".")
    for part in parents:
        section = section.get(part)
        if not isinstance(section, dict):
            return False
    return leaf not in section


def _set(section: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """A copy of `section` with dotted `key` set to `value` (its parent nodes exist)."""
    head, _, rest = key.partition(".")
    return {**section, head: _set(section[head], rest, value) if rest else value}


def with_added_dataset_fields(config: dict[str, Any], path: str) -> dict[str, Any]:
    """`config` (a ``config.json``'s contents, read from `path`) with each field of
    ``ADDED_DATASET_FIELDS`` that its dataset section lacks set to
    ``rope_lie.data.default_config(name)``'s value, which is the value the tree that wrote it
    used. A field whose node the section lacks too (a converted model's short dataset section)
    is not added.

    Raises:
      ValueError: when the dataset's default for a missing field is not the value the older
        trees used (the run would go on with another input pipeline).
    """
    dataset = config.get("dataset")
    if not isinstance(dataset, dict):
        return config
    missing = [key for key in ADDED_DATASET_FIELDS if _lacks(dataset, key)]
    if not missing:
        return config
    from rope_lie.data.defaults import default_config  # no TensorFlow

    defaults = _flat(json.loads(default_config(dataset["name"]).to_json_best_effort()))
    for key in missing:
        old, default = ADDED_DATASET_FIELDS[key], defaults[key]
        if default != old:
            raise ValueError(
                f"{path} lacks dataset.{key}: it was written before the field existed, when "
                f"the input pipeline used {old!r}; the default for {dataset['name']!r} is "
                f"{default!r}, which would make other batches. Set dataset.{key} to {old!r} "
                "in it"
            )
        dataset = _set(dataset, key, default)
    return {**config, "dataset": dataset}


def _load_json(path: str) -> Any:
    """A config.json's contents; a damaged one is a ValueError naming the file."""
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); restore it from a copy") from None


def recipe_config(recipe_path: str, arg: str | None = None) -> mc.ConfigDict:
    """``get_config`` of a workdir's ``config.py``: the ``config.json`` beside it."""
    if arg:
        raise ValueError(
            f"{recipe_path} takes no argument (got {arg!r}); override fields with "
            "--config.<key>=<value>"
        )
    return read(os.path.dirname(os.path.abspath(recipe_path)))
