"""config.init_from: parameters from another run, APE resized, head kept or new, never silent."""

import json
import os

import jax
import ml_collections as mc
import numpy as np
import pytest
import tensorflow_datasets as tfds
from flax import nnx

from configs import arrows
from rope_lie import checkpoint, config_lib, errors, finetune, train
from rope_lie.data.spatial_arrows import SpatialArrowsConfig
from rope_lie.encodings import ape


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
    with pytest.raises(
        ValueError,
        match=r"head/bias has shape \(10,\) .* \(3,\).*"
        r"init_head='new'",
    ):
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


def _arrows_config(data_dir: str, grid: int, **fields) -> mc.ConfigDict:
    """configs/arrows.py smoke (LieRE 2x2 blocks, plus a learned APE table) on the pico ViT and
    a tiny local grid of 8 px cells."""
    config = arrows.get_config("pe=liere,block=2,smoke")
    config.model.variant = "pico/8"
    config.model.additive = "ape"
    config.dataset.name = f"spatial_arrows/ft_g{grid}"
    config.dataset.data_dir = data_dir
    config.dataset.eval_split = "test"
    config.model.image_shape = (8 * grid, 8 * grid)
    config.evals = {f"g{grid:02d}": config_lib.eval_entry()}
    config.update(fields)
    return config


def test_arrows_trained_on_an_8x8_grid_fine_tunes_and_evaluates_on_a_12x12_grid(tmp_path, capsys):
    """Issue 15's recipe at test scale: spatial_arrows with 8 px cells, trained on an 8x8 grid
    (64 px), then a run from its weights on a 12x12 grid (96 px) with a zero learning rate, so
    that its parameters must be exactly the adapted source ones: LieRE's generators taken as
    they are (they act on positions, not on a grid), the APE table resized to 12x12 tokens."""
    data_dir = str(tmp_path / "tfds")
    for grid, num_train in ((8, 32), (12, 16)):
        tfds.builder(
            "spatial_arrows",
            config=SpatialArrowsConfig(
                name=f"ft_g{grid}", grid_size=grid, num_train=num_train, num_test=8
            ),
            data_dir=data_dir,
        ).download_and_prepare()
    src_dir, ft_dir = str(tmp_path / "g8"), str(tmp_path / "g12")
    train.train_and_evaluate(_arrows_config(data_dir, 8), src_dir)
    step, source = finetune.load_params(src_dir)
    assert step == 4
    with pytest.raises(
        FileNotFoundError, match=r"has no checkpoint of step 3; its steps are \[2, 4\]"
    ):
        finetune.load_params(os.path.join(src_dir, "checkpoints", "3"))
    config = _arrows_config(data_dir, 12, init_from=src_dir, total_steps=2)
    config.optim.lr = 0.0
    capsys.readouterr()
    final = train.train_and_evaluate(config, ft_dir)
    # what the fine-tune changes of the source's model is said, not refused
    assert "init_from: the source's model had model.image_shape=[64, 64] (here [96, 96])" in (
        capsys.readouterr().out
    )
    assert final["step"] == 2 and final["evals"]["g12"]["num_examples"] == 8
    with open(os.path.join(ft_dir, train.INIT_FROM_JSON)) as f:
        assert json.load(f) == {"init_from": src_dir, "step": 4}
    assert final["evals"]["g12"]["resolution"] == "96x96"
    _, state = checkpoint.load_state(os.path.join(ft_dir, "checkpoints"))
    assert int(state["step"]) == 2  # the step starts afresh, not at the source's 4
    tuned = jax.tree.map(np.asarray, state["params"])
    gen = lambda p: p["blocks"]["1"]["attn"]["pe_params"]["gen_ANKbb"]  # noqa: E731
    np.testing.assert_array_equal(gen(tuned), gen(source))
    np.testing.assert_array_equal(
        tuned["blocks"]["1"]["mlp"]["fc1"]["kernel"], source["blocks"]["1"]["mlp"]["fc1"]["kernel"]
    )
    expected = ape.table({"grid_GD": source["additive_params"]["grid_GD"]}, grid_shape=(12, 12))
    np.testing.assert_allclose(
        tuned["additive_params"]["grid_GD"].reshape(144, -1), expected, rtol=1e-6
    )
    assert not np.allclose(gen(source), 0)  # trained and carried, not a fresh zero init
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory") as raised:
        finetune.load_params(missing)
    assert "init_from" not in str(raised.value)  # rope_lie.load's caller never named it
    # refused as the user's error before anything is written: a missing source, a model the
    # source's parameters do not fit
    never = str(tmp_path / "never")
    with pytest.raises(FileNotFoundError, match=f"init_from='{missing}': '{missing}': no such"):
        train.train_and_evaluate(_arrows_config(data_dir, 12, init_from=missing), never)
    with pytest.raises(ValueError, match=r"init_from: parameter .*gen.* has shape") as raised:
        config = _arrows_config(data_dir, 12, init_from=src_dir, init_head="new")
        config.model.pe_hparams.block_size = 4
        train.train_and_evaluate(config, never)
    assert errors.is_user_error(raised.value)
    assert not [f for _, _, files in os.walk(never) for f in files]  # rope_lie.main removes it


def test_init_head_new_is_a_fresh_head_whatever_the_class_count():
    """Another task with as many classes: "new" still means the new model's head."""
    source, target = _params(head_zero_init=False), _params(head_zero_init=False)
    target = jax.tree.map(lambda x: x + 1.0, target)
    out = finetune.adapt_params(source, target, init_head="new")
    np.testing.assert_array_equal(out["head"]["kernel"], target["head"]["kernel"])
    np.testing.assert_array_equal(out["embed"]["kernel"], source["embed"]["kernel"])
    kept = finetune.adapt_params(source, target)  # "keep": the source's
    np.testing.assert_array_equal(kept["head"]["kernel"], source["head"]["kernel"])


def test_the_parameter_check_reads_shapes_only():
    """``check_params`` on the new model's abstract parameters (``_prepare`` checks init_from
    before the state exists)."""
    source = _params()
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _params(image_shape=(16, 16))
    )
    plan = finetune.check_params(source, target, init_head="new")
    assert plan["additive_params/grid_GD"] == finetune.RESIZE
    assert plan["head/kernel"] == finetune.NEW and plan["embed/kernel"] == finetune.TAKE
