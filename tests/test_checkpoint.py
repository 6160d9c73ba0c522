"""Tests for rope_lie/checkpoint.py: policies, round trip into shardings, partial saves."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie import checkpoint, sharding


def _state(value: int):
    return {
        "params": {
            "blocks": {0: {"w": jnp.full((4, 3), value, jnp.float32)}},
            "b": jnp.arange(3.0),
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
