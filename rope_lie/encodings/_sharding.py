"""Explicit mesh axes: keeping an array's batch split where JAX cannot infer it.

``jax.make_mesh`` makes Explicit axes by default: under ``jax.set_mesh(mesh)`` an array's
sharding is part of its type (``jax.typeof(x).sharding``), every operation must be able to
name its output's sharding from its inputs', and a few cannot (a reshape that splits a
dimension beside a sharded batch axis, a sort along a sharded axis, a concatenation of a split
array with a replicated one). These helpers say what the batch axis is split over and move
arrays to that split. Under Auto axes (the training loop's mesh, ``rope_lie/sharding.py``) or
without a mesh a type carries no mesh axes, and every function here returns its input as it is:
the programs the training loop compiles do not change.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def batch_axes(x: Any) -> Any:
    """The Explicit mesh axes x's leading axis is split over (a name or a tuple), or None.

    None for a replicated leading axis, for Auto axes and without a mesh (their types name no
    axes), for numpy arrays and for scalars.
    """
    if not isinstance(x, jax.Array) or x.ndim == 0:
        return None
    spec = jax.typeof(x).sharding.spec
    return spec[0] if len(spec) else None


def _is_split(x: jax.Array) -> bool:
    return any(axes is not None for axes in jax.typeof(x).sharding.spec)


def split_batch(a: jax.Array, axes: Any) -> jax.Array:
    """``a`` with its leading axis split over the mesh axes ``axes`` and the others whole.

    Unchanged when ``axes`` is None and ``a`` is not split (Auto axes, no mesh), or when ``a``
    is already split that way.

    Args:
      a: an array with a leading batch axis.
      axes: ``batch_axes`` of the array whose split ``a`` should follow.

    Returns:
      ``a``, resharded where needed (a ``jax.sharding.reshard``, differentiable).
    """
    target = (axes,) + (None,) * (a.ndim - 1)
    current = tuple(jax.typeof(a).sharding.spec)
    current += (None,) * (a.ndim - len(current))
    if current == target:
        return a
    return jax.sharding.reshard(a, P(*target))


def replicated(a: jax.Array) -> jax.Array:
    """``a`` whole on every device (from Explicit axes); unchanged when it is not split."""
    if not _is_split(a):
        return a
    return jax.sharding.reshard(a, P())


def reshape(x: Any, shape: tuple[int, ...]) -> Any:
    """``x.reshape(shape)`` keeping the leading (batch) axis split as x's is.

    The leading axis must keep its size. Under Explicit axes JAX asks for the output's
    sharding when a reshape splits or merges dimensions beside a split batch axis; numpy
    arrays and unsplit ones reshape as usual.
    """
    axes = batch_axes(x)
    if axes is None:
        return x.reshape(shape)
    if shape[0] != x.shape[0]:
        raise ValueError(
            f"reshape of a batch split over {axes!r} must keep the batch axis: {x.shape} -> {shape}"
        )
    return jnp.reshape(x, shape, out_sharding=P(axes, *(None,) * (len(shape) - 1)))
