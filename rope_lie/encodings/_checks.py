"""Input validation shared by the encoders: errors name the bad value and what was expected."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np


def check_x(x_BTNH: jax.Array, family: str) -> None:
    """Queries/keys must be a floating (B, T, N, H) array."""
    if x_BTNH.ndim != 4:
        raise ValueError(
            f"{family}: x must have shape (B, T, N, H) (rank 4), got shape {tuple(x_BTNH.shape)}"
        )
    if not jnp.issubdtype(x_BTNH.dtype, jnp.floating):
        raise TypeError(f"{family}: x must be a floating array, got dtype {x_BTNH.dtype}")


MAX_AXES = 3  # position axes: a sequence, an image, a volume or video


def check_positions(pos, family: str, num_axes: int | None = None) -> jax.Array:
    """Positions must be a real (T, A) or (B, T, A) array, 1 <= A <= 3, A == num_axes (when
    given), and finite where they are concrete (under ``jit`` they are traced and not read).

    Returns:
      ``pos`` as a jax array.
    """
    pos = jnp.asarray(pos)
    if pos.ndim not in (2, 3):
        raise ValueError(
            f"{family}: positions must have shape (T, A) or (B, T, A), got shape {tuple(pos.shape)}"
        )
    if not (jnp.issubdtype(pos.dtype, jnp.integer) or jnp.issubdtype(pos.dtype, jnp.floating)):
        raise TypeError(
            f"{family}: positions must be real numbers (an integer or floating array), got dtype "
            f"{pos.dtype}"
        )
    if not 1 <= pos.shape[-1] <= MAX_AXES:
        raise ValueError(
            f"{family}: positions have A={pos.shape[-1]} axes (shape {tuple(pos.shape)}); "
            f"expected 1 to {MAX_AXES}"
        )
    if num_axes is not None and pos.shape[-1] != num_axes:
        raise ValueError(
            f"{family}: positions have A={pos.shape[-1]} axes but the parameters were "
            f"initialised for num_axes={num_axes}"
        )
    check_finite_positions(pos, family)
    return pos


def check_finite_positions(pos: jax.Array, family: str) -> None:
    """Concrete positions must be finite: the error names the first token that is not."""
    if isinstance(pos, jax.core.Tracer) or not jnp.issubdtype(pos.dtype, jnp.floating):
        return
    values = np.asarray(pos)
    bad = np.argwhere(~np.isfinite(values).all(axis=-1))
    if bad.size:
        names = ("t",) if values.ndim == 2 else ("b", "t")
        where = ", ".join(f"{n}={i}" for n, i in zip(names, bad[0], strict=True))
        raise ValueError(
            f"{family}: the position of token {where} is {values[tuple(bad[0])].tolist()}, not "
            f"finite ({len(bad)} token(s) have NaN or infinite positions)"
        )


def check_pos(pos: jax.Array, x_BTNH: jax.Array, family: str, num_axes: int | None = None) -> None:
    """Positions must be (T, A) or (B, T, A), matching x's T (and B), with A == num_axes."""
    pos = check_positions(pos, family, num_axes)
    if pos.shape[-2] != x_BTNH.shape[1]:
        raise ValueError(
            f"{family}: positions have T={pos.shape[-2]} tokens but x has T={x_BTNH.shape[1]} "
            f"(x shape {tuple(x_BTNH.shape)}, positions shape {tuple(pos.shape)})"
        )
    if pos.ndim == 3 and pos.shape[0] != x_BTNH.shape[0]:
        raise ValueError(
            f"{family}: per-example positions have B={pos.shape[0]} but x has B={x_BTNH.shape[0]}"
        )


def check_index(index_BTA, family: str) -> None:
    """Grid coordinates of tokens must be integers: rows of a table, not positions between."""
    if not jnp.issubdtype(jnp.asarray(index_BTA).dtype, jnp.integer):
        raise TypeError(
            f"{family}: the tokens' index must hold integer grid coordinates, got dtype "
            f"{jnp.asarray(index_BTA).dtype}"
        )


def check_heads(x_BTNH: jax.Array, num_heads: int, head_dim: int, family: str) -> None:
    """x's (N, H) must match the (num_heads, head_dim) the parameters were built for; parameters
    of one head (num_heads=1, shared) serve any N, as their state does."""
    shared = num_heads == 1
    if (x_BTNH.shape[2] != num_heads and not shared) or x_BTNH.shape[3] != head_dim:
        raise ValueError(
            f"{family}: x has (N, H)=({x_BTNH.shape[2]}, {x_BTNH.shape[3]}) but the parameters "
            f"were initialised for num_heads={num_heads}, head_dim={head_dim}"
        )


def check_positive_int(value, name: str, family: str) -> int:
    """``value`` must be a positive Python int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{family}: {name}={value!r} must be a positive integer")
    return value


def check_shape_args(num_heads, head_dim, num_axes, family: str) -> None:
    """The contract's shape arguments must be positive ints, with 1 <= num_axes <= 3."""
    check_positive_int(num_heads, "num_heads", family)
    check_positive_int(head_dim, "head_dim", family)
    check_positive_int(num_axes, "num_axes", family)
    if num_axes > MAX_AXES:
        raise ValueError(
            f"{family}: num_axes={num_axes}; positions have 1 to {MAX_AXES} axes (a sequence, an "
            "image, a volume or video)"
        )


def check_nonnegative_int(value, name: str, family: str | None) -> int:
    """``value`` must be a Python int >= 0 (``family`` None: the error names no family)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        where = f"{family}: " if family else ""
        raise ValueError(f"{where}{name}={value!r} must be a non-negative integer")
    return value


def check_real(value, name: str, family: str, *, positive: bool = False) -> float:
    """``value`` must be a finite real number (not a bool), >= 0, or > 0 if ``positive``.

    Returns:
      ``value`` as a Python float.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        sign = "positive" if positive else "non-negative"
        raise ValueError(f"{family}: {name}={value!r} must be a {sign} finite number")
    return float(value)


def check_state_args(num_heads, head_dim, num_prefix, family: str) -> None:
    """``precompute``'s context: positive head count and size, a non-negative prefix count."""
    check_positive_int(num_heads, "num_heads", family)
    check_positive_int(head_dim, "head_dim", family)
    check_nonnegative_int(num_prefix, "num_prefix", family)


def check_divisible(head_dim: int, divisor: int, what: str, family: str) -> None:
    """``head_dim`` must be divisible by ``divisor`` (``what``: how the family names it)."""
    if head_dim % divisor:
        named = what if what == str(divisor) else f"{what}={divisor}"
        raise ValueError(f"head_dim={head_dim} is not divisible by {named} ({family})")


def check_base(base, family: str) -> float:
    """``base`` must be a positive finite Python number (frequencies are fixed at trace time)."""
    return check_real(base, "base", family, positive=True)


def check_no_params(params, family: str) -> None:
    """Parameter-free families take ``{}``: anything else is another family's parameters."""
    if params:
        raise ValueError(
            f"{family} has no parameters and expects params={{}}, got keys {sorted(params)}"
        )


def check_keys(params, expected, family: str) -> None:
    """``params`` must hold exactly the keys ``expected``: a key more is another family's
    parameter (Cayley-STRING's P beside RoPE-Mixed's frequencies), which would be ignored."""
    if set(params) != set(expected):
        raise ValueError(
            f"{family} expects params with keys {sorted(expected)}, got keys {sorted(params)}: "
            f"pass the parameters of {family}.init"
        )


def param(params, name: str, family: str) -> jax.Array:
    """``params[name]``, or an error naming the missing key and the keys there are."""
    try:
        return params[name]
    except KeyError:
        raise ValueError(
            f"{family}: params have no {name!r} (keys: {sorted(params)}); expected the "
            f"parameters of {family}.init"
        ) from None


def platform_choice(table, table_name: str, platform: str, choices) -> str:
    """``table``'s entry for ``platform`` ("default" for a platform it does not name), one of
    ``choices`` (a per-platform choice read when a program is traced: ``expm.SQUARING_LOOPS``,
    ``position_hook.LAYER_PLANS``)."""
    choice = table.get(platform, table["default"])
    if choice not in choices:
        raise ValueError(f"{table_name}[{platform!r}]={choice!r}; expected one of {list(choices)}")
    return choice
