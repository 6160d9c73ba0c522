"""Orbax checkpointing of the train state, with the ``args=`` API.

A checkpoint at step s holds two items in ``DIR/checkpoints/<s>/``:

- ``state``: the train state pytree (params, optimizer state, step), saved with
  ``StandardSave`` and restored with ``StandardRestore`` into the abstract state *with its
  shardings*, so every shard is read straight onto its device;
- ``meta``: JSON (step, best eval metrics so far, ...), for the loop's host-side state.

When to save is a ``SaveDecisionPolicy``: every ``every_steps`` steps, or when the JAX
preemption service reports a preemption sync point (multi-host jobs started through
``jax.distributed``; on a single host it never fires and the interval policy alone applies).
Which to keep is ``LatestN(keep)``. Writes go to a temporary directory renamed on completion, so
a process killed mid-save (even ``kill -9``) leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as cm

STATE = "state"
META = "meta"


def make_manager(
    directory: str | os.PathLike,
    *,
    every_steps: int,
    keep: int,
    async_save: bool = True,
) -> ocp.CheckpointManager:
    """A CheckpointManager saving every `every_steps` steps (and on preemption), keeping `keep`.

    Args:
      directory: where step folders are written (created if missing).
      every_steps: fixed save interval in steps (>= 1).
      keep: number of most recent checkpoints kept (>= 1).
      async_save: write in a background thread while training continues.
    """
    if every_steps < 1 or keep < 1:
        raise ValueError(f"checkpoint every_steps={every_steps} and keep={keep} must be >= 1")
    policy = cm.AnySavePolicy(
        [cm.FixedIntervalPolicy(every_steps), cm.PreemptionCheckpointingPolicy()]
    )
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=policy,
        preservation_policy=cm.LatestN(keep),
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        create=True,
    )
    return ocp.CheckpointManager(
        os.path.abspath(directory), options=options, item_names=(STATE, META)
    )


def save(
    manager: ocp.CheckpointManager,
    step: int,
    state: Any,
    meta: dict[str, Any],
    *,
    force: bool = False,
) -> bool:
    """Save `state` and `meta` at `step` if the policy says so (or `force`); True if saving."""
    args = ocp.args.Composite(
        **{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}
    )
    return manager.save(step, args=args, force=force)


def restore_latest(
    manager: ocp.CheckpointManager, abstract_state: Any
) -> tuple[int, Any, dict[str, Any]] | None:
    """(step, state, meta) of the latest complete checkpoint, or None if there is none.

    Args:
      manager: from `make_manager`.
      abstract_state: pytree of `jax.ShapeDtypeStruct` with `.sharding` set; the state is
        restored with this structure, dtypes and shardings.
    """
    step = manager.latest_step()
    if step is None:
        return None
    args = ocp.args.Composite(
        **{STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}
    )
    try:
        restored = manager.restore(step, args=args)
    except ValueError as e:  # orbax's message lists whole trees; name the first conflict
        conflict = _first_conflict(manager.directory, step, abstract_state)
        if conflict is None:
            raise
        raise ValueError(
            f"The checkpoint at step {step} in {manager.directory} was written by another "
            f"configuration: {conflict}. Use a new --workdir for this config, or the config "
            "that wrote it."
        ) from e
    return step, restored[STATE], dict(restored[META])


def _first_conflict(directory, step: int, abstract_state: Any) -> str | None:
    """The first parameter whose presence or shape differs between the checkpoint and the
    abstract state, described; None when they agree (the restore failed for another reason)."""
    _, saved = load_state(directory, step)

    def names(tree):
        return {path_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}

    saved, wanted = names(saved.get("params", {})), names(abstract_state["params"])
    for name in sorted(set(saved) | set(wanted)):
        if name not in saved:
            return f"parameter {name} is not in the checkpoint"
        if name not in wanted:
            return f"the checkpoint has parameter {name}, which this config's model does not"
        if tuple(np.shape(saved[name])) != tuple(wanted[name].shape):
            return (
                f"parameter {name} has shape {tuple(np.shape(saved[name]))} in the checkpoint and "
                f"{tuple(wanted[name].shape)} in this config"
            )
    return None


def path_name(path) -> str:
    """ "blocks/0/attn/wq_DNH": a state leaf's name, the same for a checkpoint read without a
    target (whose list indices come back as strings) and for the model's own pure dict."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def load_state(directory: str | os.PathLike, step: int | None = None) -> tuple[int, Any]:
    """(step, state as numpy arrays) from a checkpoint directory, no target structure needed.

    For analysis, tests and ``init_from``; works whatever the devices and processes that saved
    it. `step` defaults to the latest checkpoint.
    """
    manager = ocp.CheckpointManager(os.path.abspath(directory), item_names=(STATE, META))
    step = manager.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"No checkpoint in {directory}")
    # Saved on any topology (e.g. 4 devices in 2 processes), read onto this process's first
    # device, then to numpy.
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    args = ocp.args.StandardRestore(fallback_sharding=device)
    restored = manager.restore(step, args=ocp.args.Composite(**{STATE: args}))
    manager.close()
    return step, jax.tree.map(np.asarray, restored[STATE])
