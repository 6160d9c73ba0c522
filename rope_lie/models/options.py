"""The ViT's keyword arguments checked before a model is built: choices, shapes, prefix tokens,
and the attention a platform allows (``check_model_attention``, called before the first step).

Every error names the value and what was expected.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from rope_lie import encodings
from rope_lie.encodings import positions
from rope_lie.models import backends, position_hook
from rope_lie.models.variants import model_dims

# "cls": the class token's output; "mean": the patch tokens' mean, no class token;
# "mean_with_cls": the patch tokens' mean beside a class token that is not pooled (timm's "avg"
# with class_token=True, the default of timm's DINOv3 models).
POOLS = ("cls", "mean", "mean_with_cls")
DTYPES = ("float32", "bfloat16", "float16")


def additive_names() -> list[str]:
    """The valid values of ``additive``."""
    return ["none", *sorted(encodings.ADDITIVE)]


def check_choice(value: Any, name: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name}={value!r}; expected one of {list(choices)}")


def check_image_shape(image_shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(image_shape)
    if len(shape) not in (1, 2, 3) or any(
        not isinstance(s, numbers.Integral) or s < 1 for s in shape
    ):
        raise ValueError(
            f"image_shape={image_shape} must be 2 (image) or 3 (volume) positive ints, or 1 "
            "(sequence)"
        )
    return tuple(int(s) for s in shape)


def check_options(pe: str, pool: str, additive: str, convention: str, dropout: float) -> None:
    position_hook.pe_module(pe)  # raises for an unknown pe, listing the valid ones
    check_choice(pool, "pool", POOLS)
    check_choice(additive, "additive", additive_names())
    check_choice(convention, "position_convention", positions.CONVENTIONS)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout} must be in [0, 1)")


def check_position_hparams(
    convention: str, hparams: Mapping[str, Any] | None, pe_hparams: Mapping[str, Any] | None
) -> tuple[tuple[str, Any], ...]:
    """``position_hparams`` as sorted (name, value) pairs, checked against the convention; the
    diagonal's delta and ``rope_axial``'s ``temporal_scale`` would both scale time: one only."""
    hparams = positions.check_hparams(convention, hparams)
    positions.grid_positions((1,) * 3, convention, **hparams)  # checks the values
    temporal_scale = dict(pe_hparams or {}).get("temporal_scale", 1.0)
    if convention == "diagonal" and temporal_scale != 1.0:
        raise ValueError(
            f"pe_hparams temporal_scale={temporal_scale!r} with position_convention='diagonal': "
            "the diagonal layout's delta is position_hparams temporal_spacing (it also moves the "
            "spatial positions); keep temporal_scale at 1"
        )
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in hparams.items()))


def check_registers(num_registers: Any) -> int:
    if isinstance(num_registers, bool) or not (
        isinstance(num_registers, numbers.Integral) and num_registers >= 0
    ):
        raise ValueError(f"num_registers={num_registers!r} must be a non-negative int")
    return int(num_registers)


def has_class_token(pool: str) -> bool:
    """Whether a model pooled this way has a class token (``"cls"``, ``"mean_with_cls"``)."""
    return pool in ("cls", "mean_with_cls")


def num_prefix_tokens(pool: str, num_registers: int) -> int:
    """Prefix tokens before the patches: the class token (``has_class_token``) and the
    registers."""
    return (1 if has_class_token(pool) else 0) + check_registers(num_registers)


def check_augment(augment: Mapping[str, float] | None) -> tuple[tuple[str, float], ...]:
    """``position_augment`` as sorted (name, value) pairs; () when off."""
    if augment is None:
        return ()
    unknown = set(augment) - {"shift", "jitter", "rescale", "randomize"}
    if unknown:
        raise ValueError(
            f"position_augment has unknown keys {sorted(unknown)}; expected shift, jitter, "
            "rescale (DINOv3's), randomize (RPE-2D's)"
        )
    positions.check_augment(**augment)
    return tuple(sorted((k, v) for k, v in augment.items() if v is not None))


def activation_dtype(dtype: Any) -> jnp.dtype:
    name = jnp.dtype(dtype).name
    check_choice(name, "dtype", DTYPES)
    return jnp.dtype(name)


def check_model_attention(model_cfg: Mapping[str, Any], platform: str | None = None) -> None:
    """Check ``model_cfg["attention"]`` against a platform, the dtype and head_dim.

    Call it outside ``jit``, before the first step: an unsupported choice fails with an error
    that names ``model.attention`` and what it needs (``backends.check_attention``).

    Args:
      model_cfg: ``config.model`` (the ``ViT`` keyword arguments).
      platform: where the steps run; None: ``jax.default_backend()``.
    """
    cfg = model_cfg.to_dict() if hasattr(model_cfg, "to_dict") else dict(model_cfg)
    name = cfg.get("attention", "xla")
    backends.check_attention_name(name)
    image_shape = check_image_shape(cfg.get("image_shape", (224, 224)))
    dims, _ = model_dims(
        cfg.get("variant", "Ti/16"), cfg.get("dims"), cfg.get("patch_size"), len(image_shape)
    )
    backends.check_attention(
        name,
        platform=jax.default_backend() if platform is None else platform,
        dtype=activation_dtype(cfg.get("dtype", "float32")),
        head_dim=dims["width"] // dims["num_heads"],
    )
