"""Device mesh, logical-axis rules and shardings for the train state and the batches.

The mesh has two axes (MaxText naming):

- ``data``: pure data parallelism; parameters are replicated along it.
- ``fsdp``: data parallelism *and* parameter sharding (ZeRO-3 / FSDP): every array of the
  train state (parameters and optimizer moments) bigger than ``min_size`` elements is split
  along its largest dimension divisible by the fsdp size; smaller arrays are replicated.

A batch is split over every device, ``P(("data", "fsdp"))``. Arrays name their dims with
*logical* axes and the short table ``LOGICAL_AXIS_RULES`` maps those to mesh axes, so a change
of parallelism is a change of the table, not of the model. Parameters carry no annotations:
``param_logical_axes`` picks their logical axes from their shape by the rule above.

State is created directly sharded (big_vision): ``jax.eval_shape`` gives the abstract state,
``state_shardings`` the placement, and a ``jax.jit(init, out_shardings=...)`` materialises each
shard on its device (nothing is ever built whole on one device).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp")

# Logical axis name -> mesh axis (or tuple of mesh axes, or None = replicated).
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),  # examples are split over every device
    "fsdp": "fsdp",  # the one parameter dim chosen by `param_logical_axes`
    "replicated": None,  # every other parameter dim
}


def mesh_shape(mesh_cfg: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
    """Sizes of the (data, fsdp) axes; one size may be -1 (= the remaining devices)."""
    unknown = [name for name in mesh_cfg if name not in MESH_AXES]
    if unknown:
        raise ValueError(f"Unknown mesh axes {unknown}; expected a subset of {MESH_AXES}.")
    sizes = [int(mesh_cfg.get(name, 1)) for name in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError(
            f"At most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes, strict=True))}."
        )
    known = math.prod(s for s in sizes if s != -1)
    if any(s == 0 or s < -1 for s in sizes) or num_devices % known:
        raise ValueError(
            f"Mesh {dict(zip(MESH_AXES, sizes, strict=True))} does not fit {num_devices} devices "
            "(sizes must be positive or -1 and divide the device count)."
        )
    sizes = [num_devices // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != num_devices:
        raise ValueError(
            f"Mesh {dict(zip(MESH_AXES, sizes, strict=True))} uses {math.prod(sizes)} devices, "
            f"but {num_devices} are available; use -1 for 'the rest'."
        )
    return tuple(sizes)


def make_mesh(mesh_cfg: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, fsdp) mesh of Auto axes over `devices` (default: all).

    Callers enter it with ``with jax.set_mesh(mesh):`` around training, so that raw
    PartitionSpecs resolve against it; it is not set globally here.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    mesh = jax.make_mesh(
        shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )
    return mesh


def logical_to_spec(logical_axes: Sequence[str | None]) -> P:
    """PartitionSpec for dims named by logical axes (None = replicated)."""
    specs = []
    for name in logical_axes:
        if name is not None and name not in LOGICAL_AXIS_RULES:
            raise ValueError(f"Unknown logical axis {name!r}; known: {list(LOGICAL_AXIS_RULES)}.")
        specs.append(None if name is None else LOGICAL_AXIS_RULES[name])
    return P(*specs)


def param_logical_axes(shape: Sequence[int], fsdp_size: int, min_size: int) -> tuple[str, ...]:
    """Logical axes of a state array: 'fsdp' on its largest dim divisible by `fsdp_size`.

    Arrays with fewer than `min_size` elements, or none of whose dims divides, are replicated
    (the communication would cost more than the memory saved). Ties go to the first dim.
    """
    axes = ["replicated"] * len(shape)
    if fsdp_size <= 1 or math.prod(shape) < min_size:
        return tuple(axes)
    candidates = [(d, -i) for i, d in enumerate(shape) if d % fsdp_size == 0]
    if candidates:
        _, neg_i = max(candidates)
        axes[-neg_i] = "fsdp"
    return tuple(axes)


def state_shardings(abstract_state: Any, mesh: Mesh, min_size: int = 2**14) -> Any:
    """NamedSharding per leaf of an (abstract) state pytree, by `param_logical_axes`."""
    fsdp_size = mesh.shape["fsdp"]

    def leaf_sharding(x):
        shape = getattr(x, "shape", ())
        return NamedSharding(mesh, logical_to_spec(param_logical_axes(shape, fsdp_size, min_size)))

    return jax.tree.map(leaf_sharding, abstract_state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (example) dim split over every device; other dims whole."""
    return NamedSharding(mesh, logical_to_spec(["batch"]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_shards(mesh: Mesh) -> int:
    """How many ways a batch is split: every device of the mesh (data x fsdp)."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def check_batch_size(batch_size: int, mesh: Mesh, what: str = "batch_size") -> None:
    """A global batch size must split evenly over the mesh's devices (checked before step 1)."""
    shards = batch_shards(mesh)
    if batch_size < 1 or batch_size % shards:
        raise ValueError(
            f"{what}={batch_size} is not a positive multiple of the {shards} devices of the "
            f"mesh {dict(mesh.shape)} ({jax.process_count()} process(es)); use e.g. "
            f"{max(shards, batch_size // shards * shards)}"
        )


def padded_batch_size(batch_size: int, mesh: Mesh) -> int:
    """The smallest multiple of the mesh's device count that holds `batch_size` examples.

    Evaluation reads batches of this size; the examples beyond the split are padding with mask
    0, so any eval batch size works on any mesh and every example still counts once.
    """
    shards = batch_shards(mesh)
    return -(-batch_size // shards) * shards


def data_shards(config: Any) -> int:
    """The shards each global batch is made of: ``config.data_shards``, or with 0 one per
    process (so that a job's batches then follow its process count)."""
    return config.get("data_shards", 0) or jax.process_count()


def shard_batch(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Global jax arrays from this process's slice of the batch (multi-host safe).

    Each process passes its local examples (its TFDS shard); the global batch size is
    `local * process_count`, and must divide by the number of devices.
    """
    sharding = batch_sharding(mesh)
    num_shards = batch_shards(mesh)
    out = {}
    for key, value in batch.items():
        global_len = value.shape[0] * jax.process_count()
        if global_len % num_shards:
            raise ValueError(
                f"Global batch size {global_len} ({key!r}) is not divisible by the "
                f"{num_shards} devices of the mesh {dict(mesh.shape)}."
            )
        out[key] = jax.make_array_from_process_local_data(sharding, value)
    return out
