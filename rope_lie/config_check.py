"""Checks of a run's config before anything runs: every field with a range says what it expects.

``validate(config)`` raises ``ValueError`` naming the first bad field, its value and the valid
range, e.g. ``optim.lr=nan: expected a finite number >= 0``. ``train.train_and_evaluate`` calls
it first, so a bad value fails in a second instead of at step 2 (a NaN learning rate) or after
an epoch (``total_steps=0``). Fields a config does not have are skipped (user configs may be
smaller than the recipes'); the model's own arguments are checked where the model is built
(``rope_lie/models/vit.py``, the encoders).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ml_collections as mc

_MISSING = object()


def _get(config: mc.ConfigDict, key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not hasattr(node, "get") or part not in node:
            return _MISSING
        node = node[part]
    return node


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# field -> (test, what is expected). Tests see the value only.
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {}


def _check(expected: str, test: Callable[[Any], bool], *keys: str) -> None:
    for key in keys:
        _CHECKS[key] = (test, expected)


_check(
    "an integer >= 1",
    lambda v: _is_int(v) and v >= 1,
    "batch_size",
    "eval_batch_size",
    "log_every_steps",
    "checkpoint.every_steps",
    "checkpoint.keep",
    "mesh.fsdp",
)
_check(
    "an integer >= 0",
    lambda v: _is_int(v) and v >= 0,
    "eval_every_steps",
    "optim.warmup_steps",
    "data_shards",
    "fsdp_min_size",
    "seed",
    "distributed.num_processes",
)
# None: the data order follows `seed` (config_lib.data_seed)
_check("None or an integer >= 0", lambda v: v is None or (_is_int(v) and v >= 0), "data_seed")
_check(
    "a finite number > 0",
    lambda v: _is_number(v) and math.isfinite(v) and v > 0,
    "optim.eps",
    "model.norm_eps",
)
# lr = 0 keeps the parameters as they are (a fine-tune's start evaluated at a new size, say)
_check("a finite number >= 0", lambda v: _is_number(v) and math.isfinite(v) and v >= 0, "optim.lr")
_check(
    "a finite number >= 0",
    lambda v: _is_number(v) and math.isfinite(v) and v >= 0,
    "num_epochs",
    "eval_every_epochs",
    "optim.weight_decay",
    "optim.grad_clip",
)
_check(
    "a number in [0, 1)",
    lambda v: _is_number(v) and 0 <= v < 1,
    "optim.b1",
    "optim.b2",
    "model.dropout",
)
_check("a number in [0, 1]", lambda v: _is_number(v) and 0 <= v <= 1, "optim.end_lr_ratio")
_check(
    "-1 (the remaining devices) or an integer >= 1",
    lambda v: _is_int(v) and (v == -1 or v >= 1),
    "mesh.data",
)
_check("True or False", lambda v: isinstance(v, bool), "naflex.pack")
_check(
    "an integer >= 0",
    lambda v: _is_int(v) and v >= 0,
    "naflex.pack_images",
    "naflex.pack_row_multiple",
)
_check("'adam' or 'adamw'", lambda v: v in ("adam", "adamw"), "optim.name")
_check("'keep' or 'new'", lambda v: v in ("keep", "new"), "init_head")


def validate(config: mc.ConfigDict) -> None:
    """Raise ``ValueError`` naming the first field of `config` outside its valid range.

    Args:
      config: a run config (``config_lib.base_config()`` fields plus the recipe's).
    """
    for key, (test, expected) in _CHECKS.items():
        value = _get(config, key)
        if value is not _MISSING and not test(value):
            raise ValueError(f"{key}={value!r}: expected {expected}")
    total = _get(config, "total_steps")
    if total is not _MISSING and not (_is_int(total) and total >= 0):
        raise ValueError(
            f"total_steps={total!r}: expected an integer >= 1, or 0 to train num_epochs epochs"
        )
    epochs = _get(config, "num_epochs")
    if total == 0 and epochs is not _MISSING and not epochs > 0:
        raise ValueError(
            f"total_steps=0 and num_epochs={epochs!r}: no steps to train; set total_steps >= 1 "
            "or num_epochs > 0"
        )
    shards, batch = _get(config, "data_shards"), _get(config, "batch_size")
    if _is_int(shards) and shards >= 1 and _is_int(batch) and batch % shards:
        raise ValueError(
            f"data_shards={shards} and batch_size={batch}: each batch is made of data_shards "
            "equal shards; set a batch_size that data_shards divides"
        )
    warmup = _get(config, "optim.warmup_steps")
    if _is_int(total) and total >= 1 and _is_int(warmup) and warmup >= total:
        raise ValueError(
            f"optim.warmup_steps={warmup} and total_steps={total}: the warmup must end before "
            "the run does; set warmup_steps < total_steps"
        )
    patch_dropout = _get(config, "model.patch_dropout")
    if _get(config, "naflex.pack") is True and patch_dropout not in (0, 0.0, _MISSING):
        raise ValueError(
            f"naflex.pack=True and model.patch_dropout={config.model.patch_dropout}: patch "
            "dropout is not available on packed batches; set one of them off"
        )
    augment = _get(config, "model.position_augment")
    drops_patches = patch_dropout not in (0, 0.0, _MISSING)
    token_batches = _get(config, "naflex") not in (None, _MISSING) or drops_patches
    if augment not in (None, _MISSING) and dict(augment) and token_batches:
        raise ValueError(
            f"model.position_augment={dict(augment)} with naflex or model.patch_dropout: the "
            "model augments the positions of image batches only, and these train on token "
            "batches; set position_augment=None or train on images"
        )
    if _get(config, "eval_every_steps") not in (0, _MISSING) and _get(
        config, "eval_every_epochs"
    ) not in (0, 0.0, _MISSING):
        raise ValueError(
            f"eval_every_steps={config.eval_every_steps} and eval_every_epochs="
            f"{config.eval_every_epochs}: set one of them, not both"
        )
