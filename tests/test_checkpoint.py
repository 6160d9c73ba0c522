"""Tests for rope_lie/checkpoint.py: policies, round trip into shardings, partial saves,
damaged checkpoints."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie import checkpoint, sharding

# A failed restore leaves orbax's read coroutines behind: pyproject's filterwarnings says why
# their warning is ignored.


def _state(value: int):
    return {
        "params": {
            "blocks": {0: {"w": jnp.full((4, 3), value, jnp.float32)}},
            "b": jnp.arange(3.0),
            "emb": jax.random.normal(jax.random.key(value), (64, 64)),  # stored out of line
        },
        "step": jnp.array(int(value), jnp.int32),
    }


def _abstract(state, mesh):
    shardings = sharding.state_shardings(state, mesh)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )


def test_interval_policy_latest_n_and_round_trip(tmp_path):
    manager = checkpoint.make_manager(tmp_path, every_steps=2, keep=2, async_save=True)
    saved = [checkpoint.save(manager, s, _state(s), {"step": s, "best": {}}) for s in range(1, 8)]
    assert saved == [False, True, False, True, False, True, False]
    assert checkpoint.save(manager, 7, _state(7), {"step": 7}, force=True)  # e.g. the last step
    manager.wait_until_finished()
    assert manager.all_steps() == [6, 7]

    mesh = sharding.make_mesh({"data": -1}, jax.devices()[:1])
    abstract = _abstract(_state(0), mesh)
    step, state, meta = checkpoint.restore_latest(manager, abstract)
    assert step == 7 and meta == {"step": 7}
    jax.tree.map(np.testing.assert_array_equal, state, _state(7))
    assert jax.tree.map(lambda x: x.sharding, state) == jax.tree.map(lambda x: x.sharding, abstract)


def test_empty_directory_restores_nothing(tmp_path):
    manager = checkpoint.make_manager(tmp_path / "ckpt", every_steps=1, keep=1)
    mesh = sharding.make_mesh({"data": -1}, jax.devices()[:1])
    assert checkpoint.restore_latest(manager, _abstract(_state(0), mesh)) is None


def test_interrupted_save_is_ignored(tmp_path):
    manager = checkpoint.make_manager(tmp_path, every_steps=2, keep=3, async_save=False)
    checkpoint.save(manager, 2, _state(2), {"step": 2})
    manager.close()
    # What a process killed in the middle of writing step 4 leaves behind.
    os.makedirs(tmp_path / "4.orbax-checkpoint-tmp-1234" / "state")
    manager = checkpoint.make_manager(tmp_path, every_steps=2, keep=3)
    mesh = sharding.make_mesh({"data": -1}, jax.devices()[:1])
    step, state, _ = checkpoint.restore_latest(manager, _abstract(_state(0), mesh))
    assert step == 2
    np.testing.assert_array_equal(state["step"], 2)
    assert checkpoint.load_state(tmp_path)[0] == 2


@pytest.mark.parametrize("every_steps, keep", [(0, 1), (1, 0)])
def test_bad_policy_fails_clearly(tmp_path, every_steps, keep):
    with pytest.raises(ValueError, match="must be >= 1"):
        checkpoint.make_manager(tmp_path, every_steps=every_steps, keep=keep)


def _cut_in_half(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _largest_file(directory):
    files = [os.path.join(d, f) for d, _, names in os.walk(directory) for f in names]
    return max(files, key=os.path.getsize)


# Damage done to a complete step folder after it was written, and what the message says.
DAMAGE = {
    "largest file cut in half": (lambda d: _cut_in_half(_largest_file(d)), "OUT_OF_RANGE"),
    "state manifest deleted": (lambda d: os.remove(d / "state" / "manifest.ocdbt"), "NOT_FOUND"),
    "state tree metadata emptied": (
        lambda d: open(d / "state" / "_METADATA", "w").close(),
        "a JSON file does not parse",
    ),
    "meta item deleted": (lambda d: shutil.rmtree(d / "meta"), 'Item "meta" was not found'),
}


def _two_checkpoints(directory):
    manager = checkpoint.make_manager(directory, every_steps=2, keep=3, async_save=False)
    for step in (2, 4):
        checkpoint.save(manager, step, _state(step), {"step": step})
    manager.close()
    return checkpoint.make_manager(directory, every_steps=2, keep=3, async_save=False)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_an_unreadable_checkpoint_is_named_and_the_previous_one_restored(tmp_path, capsys, damage):
    directory = tmp_path / "ckpt"
    manager = _two_checkpoints(directory)
    corrupt, reason = DAMAGE[damage]
    corrupt(directory / "4")
    mesh = sharding.make_mesh({"data": -1}, jax.devices()[:1])
    step, state, meta = checkpoint.restore_latest(manager, _abstract(_state(0), mesh))
    assert step == 2 and meta == {"step": 2}
    jax.tree.map(np.testing.assert_array_equal, state, _state(2))
    out = capsys.readouterr().out
    assert f"Checkpoint step 4 in {directory} cannot be read: " in out and reason in out
    assert f"Falling back to checkpoint step 2; moved the unreadable ones to {directory}-un" in out
    assert os.listdir(f"{directory}-unreadable") == ["4"]  # kept for inspection
    assert manager.all_steps() == [2]
    assert checkpoint.save(manager, 4, _state(4), {"step": 4})  # the run can save step 4 again
    assert manager.all_steps() == [2, 4]


def test_no_readable_checkpoint_is_an_error_that_moves_nothing(tmp_path):
    directory = tmp_path / "ckpt"
    manager = _two_checkpoints(directory)
    for step in ("2", "4"):
        os.remove(directory / step / "state" / "manifest.ocdbt")
    mesh = sharding.make_mesh({"data": -1}, jax.devices()[:1])
    with pytest.raises(OSError, match=r"No checkpoint in .*ckpt can be read \(steps \[2, 4\]"):
        checkpoint.restore_latest(manager, _abstract(_state(0), mesh))
    assert sorted(os.listdir(directory)) == ["2", "4"]
    assert not os.path.exists(f"{directory}-unreadable")


def test_a_checkpoint_of_another_shape_is_an_error_not_a_fallback(tmp_path):
    directory = tmp_path / "ckpt"
    manager = _two_checkpoints(directory)
    other = _state(0)
    other["params"]["emb"] = jnp.zeros((64, 32))
    mesh = sharding.make_mesh({"data": -1}, jax.devices()[:1])
    match = r"step 4 .* another configuration: parameter emb has shape \(64, 64\) in the checkp"
    with pytest.raises(ValueError, match=match):
        checkpoint.restore_latest(manager, _abstract(other, mesh))
    assert sorted(os.listdir(directory)) == ["2", "4"]
