"""config.init_from: parameters from another run, APE resized, head kept or new, never silent."""

import jax
import ml_collections as mc
import numpy as np
import pytest
from flax import nnx

from rope_lie import checkpoint, finetune, train
from rope_lie.encodings import ape
from tests.test_train import _config


def _params(**model):
    base = dict(variant="pico/2", image_shape=(8, 8), channels=1, num_classes=10, additive="ape")
    m = train.build_model(mc.ConfigDict({**base, **model}), jax.random.key(0))
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(m, nnx.Param)))


def test_same_shapes_are_taken_and_the_ape_grid_is_resized():
    source, target = _params(), _params(image_shape=(16, 16))
    target = jax.tree.map(lambda x: x + 1.0, target)  # anything not taken would show
    out = finetune.adapt_params(source, target)
    flat_src = dict(jax.tree_util.tree_leaves_with_path(source))
    for path, value in jax.tree_util.tree_leaves_with_path(out):
        if "grid_GD" not in jax.tree_util.keystr(path):
            np.testing.assert_array_equal(value, flat_src[path])
    grid = out["additive_params"]["grid_GD"]
    assert grid.shape == (8, 8, 32)
    expected = ape.table({"grid_GD": source["additive_params"]["grid_GD"]}, grid_shape=(8, 8))
    np.testing.assert_allclose(grid.reshape(64, 32), expected, rtol=1e-6)


def test_another_class_count_needs_init_head_new():
    source, target = _params(), _params(num_classes=3)
    with pytest.raises(ValueError, match=r"head/bias has shape \(10,\) .* \(3,\).*"
                       r"init_head='new'"):  # fmt: skip
        finetune.adapt_params(source, target)
    out = finetune.adapt_params(source, target, init_head="new")
    np.testing.assert_array_equal(out["head"]["kernel"], target["head"]["kernel"])
    np.testing.assert_array_equal(out["embed"]["kernel"], source["embed"]["kernel"])
    with pytest.raises(ValueError, match=r"init_head='old'; expected one of \('keep', 'new'\)"):
        finetune.adapt_params(source, target, init_head="old")


def test_other_differences_are_errors_that_name_the_parameter():
    with pytest.raises(ValueError, match=r"embed/kernel has shape \(4, 32\).*\(12, 32\)"):
        finetune.adapt_params(_params(), _params(channels=3))
    with pytest.raises(ValueError, match=r"no parameters \['additive_params/grid_GD'"):
        finetune.adapt_params(_params(), _params(additive="none"))


def test_a_run_starts_from_another_runs_weights_at_another_resolution(tfds_dir, tmp_path):
    """Train at 8x8 (4x4 tokens), then fine-tune on 16x16 digits (8x8 tokens) from it with a
    zero learning rate: the new run's parameters are exactly the adapted source ones."""
    src_dir = str(tmp_path / "src")
    train.train_and_evaluate(_config(tfds_dir, **{"model.additive": "ape"}), src_dir)
    step, source = finetune.load_params(src_dir)
    assert step == 12
    config = _config(
        tfds_dir, **{"model.additive": "ape", "model.image_shape": (16, 16), "optim.lr": 0.0,
                     "total_steps": 2, "eval_every_steps": 0, "init_from": src_dir},
    )  # fmt: skip
    config.dataset.name = "sklearn_digits/size16"
    del config.evals["size16"]
    final = train.train_and_evaluate(config, str(tmp_path / "ft"))
    assert final["step"] == 2
    _, state = checkpoint.load_state(str(tmp_path / "ft" / "checkpoints"))
    assert int(state["step"]) == 2  # the step starts afresh, not at the source's 12
    tuned = jax.tree.map(np.asarray, state["params"])
    np.testing.assert_array_equal(tuned["blocks"]["1"]["mlp"]["fc1"]["kernel"],
                                  source["blocks"]["1"]["mlp"]["fc1"]["kernel"])  # fmt: skip
    expected = ape.table({"grid_GD": source["additive_params"]["grid_GD"]}, grid_shape=(8, 8))
    np.testing.assert_allclose(
        tuned["additive_params"]["grid_GD"].reshape(64, -1), expected, rtol=1e-6
    )
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        finetune.load_params(str(tmp_path / "nowhere"))
