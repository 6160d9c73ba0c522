"""Orbax checkpointing of the train state, with the ``args=`` API.

A checkpoint at step s holds two items in ``DIR/checkpoints/<s>/``:

- ``state``: the train state pytree (params, optimizer state, step), saved with
  ``StandardSave`` and restored with ``StandardRestore`` into the abstract state *with its
  shardings*, so every shard is read straight onto its device;
- ``meta``: JSON (step, best eval metrics so far, ``config.model``, ...), for the loop's
  host-side state and the checks of a resume or a load against the model that wrote it.

When to save is a ``SaveDecisionPolicy``: every ``every_steps`` steps, or when the JAX
preemption service reports a preemption sync point (multi-host jobs started through
``jax.distributed``; on a single host it never fires and the interval policy alone applies).
Which to keep is ``LatestN(keep)``. Writes go to a temporary directory renamed on completion, so
a process killed mid-save (even ``kill -9``) leaves the previous checkpoint as the latest one.

A complete checkpoint whose files were damaged afterwards (truncated, deleted, unparseable: a
full disk, a bad copy) is reported by ``restore_latest``, which falls back to the newest one
that reads and moves the damaged ones to ``<directory>-unreadable/`` (so their steps can be
written again). Orbax keeps no checksums of array data: bytes overwritten inside an array's
chunk restore without an error, as wrong values. In a multi-process job a file that only some
processes read fails only their restore, and the others time out at orbax's restore barrier:
an error, not a fallback.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as cm

from rope_lie.job import say

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
    """(step, state, meta) of the newest checkpoint that reads, or None if there is none.

    Newer checkpoints whose files cannot be read are named, with the reason, and moved to
    ``<directory>-unreadable/<step>``. Any other error (e.g. a checkpoint of another config) is
    raised, as is the case where no checkpoint reads (nothing is moved then).

    Args:
      manager: from `make_manager`.
      abstract_state: pytree of `jax.ShapeDtypeStruct` with `.sharding` set; the state is
        restored with this structure, dtypes and shardings.
    """
    args = ocp.args.Composite(
        **{STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}
    )
    unreadable = {}  # step -> why
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            restored = manager.restore(step, args=args)
        except Exception as e:  # every error but an unreadable file is raised
            reason = unreadable_reason(e)
            if reason is None:
                conflict = _conflict_error(manager, step, abstract_state, e)
                if conflict is None:
                    raise
                raise conflict from e
            say(f"Checkpoint step {step} in {manager.directory} cannot be read: {reason}")
            unreadable[step] = reason
            continue
        if unreadable:
            aside = _set_aside(manager, unreadable)
            say(f"Falling back to checkpoint step {step}; moved the unreadable ones to {aside}")
        return step, restored[STATE], dict(restored[META])
    if unreadable:
        raise OSError(
            f"No checkpoint in {manager.directory} can be read (steps {sorted(unreadable)}; "
            "reasons above). Restore them from a copy, or move them away to start from step 0."
        )
    return None


# What orbax 0.12 raises when a step's files were truncated, deleted or overwritten: tensorstore
# errors (ValueError, or wrapped as the cause of a bare Exception for array data) with these
# status codes, a JSON file that does not parse, an item folder that is gone.
_TENSORSTORE_READ_ERRORS = ("NOT_FOUND:", "OUT_OF_RANGE:", "DATA_LOSS:", "FAILED_PRECONDITION:")


def unreadable_reason(error: BaseException) -> str | None:
    """What orbax could not read, from `error` or the errors it wraps (``raise ... from``); None
    when it is not a damaged-file error (another config, a bug: raise it)."""
    while error is not None:
        text = str(error)
        if isinstance(error, json.JSONDecodeError):
            return f"a JSON file does not parse ({text})"
        if isinstance(error, FileNotFoundError):
            return text
        if isinstance(error, KeyError) and "was not found in the checkpoint" in text:
            return str(error.args[0])  # str() of a KeyError is the repr of its message
        if isinstance(error, ValueError) and text.startswith(_TENSORSTORE_READ_ERRORS):
            return text.split(" [tensorstore_spec=")[0]
        error = error.__cause__
    return None


def _set_aside(manager: ocp.CheckpointManager, unreadable: dict[int, str]) -> str:
    """Move unreadable step folders to ``<directory>-unreadable/`` (process 0; the others wait)
    so the run can write those steps again; returns that folder."""
    aside = f"{manager.directory}-unreadable"
    if jax.process_index() == 0:
        os.makedirs(aside, exist_ok=True)
        for step in unreadable:
            target = os.path.join(aside, str(step))
            if os.path.exists(target):  # set aside before: keep both
                target += time.strftime("-%Y%m%d-%H%M%S")
            os.rename(os.path.join(manager.directory, str(step)), target)
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(f"rope_lie_set_aside_{max(unreadable)}")
    manager.reload()
    return aside


def _conflict_error(manager, step: int, abstract_state: Any, error: Exception):
    """For a checkpoint of another configuration, an error naming the first parameter that
    differs (orbax's own message lists whole trees); None for any other error."""
    if not isinstance(error, ValueError):
        return None
    conflict = _first_conflict(manager.directory, step, abstract_state)
    if conflict is None:
        return None
    return ValueError(
        f"The checkpoint at step {step} in {manager.directory} was written by another "
        f"configuration: {conflict}. Use a new --workdir for this config, or the config "
        "that wrote it."
    )


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


def load_meta(directory: str | os.PathLike, step: int) -> dict[str, Any]:
    """The JSON ``meta`` of the checkpoint of `step` in a checkpoint directory."""
    manager = ocp.CheckpointManager(os.path.abspath(directory), item_names=(STATE, META))
    restored = manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))
    manager.close()
    return dict(restored[META])
