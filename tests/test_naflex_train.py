"""End to end: a NaFlex run (mixed-size token batches, patch dropout) through rope_lie.train."""

import numpy as np
import tensorflow_datasets as tfds

from configs import arrows, digits
from rope_lie import config_lib, train
from rope_lie.data.spatial_arrows import SpatialArrowsConfig


def test_naflex_digits_smoke_trains_and_evaluates_at_every_size(tfds_dir, tmp_path):
    config = digits.get_config("smoke,naflex,pe=rope_mixed")
    config.dataset.data_dir = tfds_dir
    config.model.variant = "pico"
    config.model.patch_dropout = 0.25  # on the mixed-size tokens, in training only
    config.total_steps = 4
    assert config.naflex.max_tokens == 36 and config.naflex.min_side == 3
    result = train.train_and_evaluate(config, str(tmp_path))
    evals = result["evals"]
    assert result["step"] == 4
    assert {"naflex_s03", "naflex_s04", "naflex_s06", "size8", "size16"} <= set(evals)
    assert evals["naflex_s06"]["resolution"] == "tokens36"
    for res in evals.values():
        assert res["num_examples"] == 360 and np.isfinite(res["loss"])
    # An 8x8 digit under a budget of 16 tokens is its own 4x4 patch grid, unresized: the
    # padded token path and the fixed-size image path classify it alike.
    np.testing.assert_allclose(evals["naflex_s04"]["loss"], evals["size8"]["loss"], rtol=1e-5)
    assert evals["naflex_s04"]["accuracy"] == evals["size8"]["accuracy"]


def test_mixed_grid_arrows_train_native_and_evaluate_on_fixed_grids(tmp_path):
    """arrows' mixed_grids: scenes of 6 to 8 cells read at their own size (naflex.native)."""
    root = str(tmp_path / "tfds")
    for name, fields in [("e2e_mixed", dict(grid_size=8, min_grid=6)), ("e2e_g8", {})]:
        config = SpatialArrowsConfig(name=name, num_train=32, num_test=16, **fields)
        tfds.builder("spatial_arrows", config=config, data_dir=root).download_and_prepare()
    config = arrows.get_config("pe=rope_mixed,mixed_grids,smoke")
    assert config.naflex.native and config.dataset.name == "spatial_arrows/c8_g6to10"
    config.dataset.name, config.dataset.data_dir = "spatial_arrows/e2e_mixed", root
    config.naflex.max_side, config.naflex.max_tokens = 8, 64
    config.total_steps = 2
    config.evals = {"g08": config_lib.eval_entry(name="spatial_arrows/e2e_g8")}
    result = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert result["step"] == 2 and result["evals"]["g08"]["num_examples"] == 16
    assert np.isfinite(result["evals"]["g08"]["loss"])


def _digits_naflex(tfds_dir):
    config = digits.get_config("smoke,naflex,pe=rope_mixed")
    config.dataset.data_dir = tfds_dir
    config.model.variant = "pico"
    config.batch_size = 16
    return config


def test_packed_batches_hold_the_same_images_in_fewer_rows(tfds_dir):
    """naflex.pack: each batch's images (the unpacked batch's, in its order, labels untouched)
    in fewer rows, every image's tokens in its own segment, and the same images on resume."""
    from rope_lie import run_inputs

    config = _digits_naflex(tfds_dir)
    patch = (2, 2)
    padded = next(run_inputs.data_train_batches(config, patch, 1))
    config.naflex.pack = True
    packed_stream = run_inputs.data_train_batches(config, patch, 1)
    packed = next(packed_stream)
    settings = run_inputs.pack_settings(config)
    assert settings["max_images"] == 36 // 9  # max_tokens // min_side**2
    rows = packed["segment"].shape[0]
    assert rows % settings["row_multiple"] == 0 and rows < 16
    np.testing.assert_array_equal(packed["label"], padded["label"])
    for n in range(16):
        row, slot = packed["image_row"][n], packed["image_slot"][n]
        own = packed["segment"][row] == slot + 1
        count = int(padded["token_mask"][n].sum())
        assert own.sum() == count
        np.testing.assert_array_equal(packed["patches"][row][own], padded["patches"][n, :count])
        np.testing.assert_array_equal(packed["index"][row][own], padded["index"][n, :count])
        np.testing.assert_array_equal(packed["slot_grid"][row, slot], padded["grid"][n])
    real = int(padded["token_mask"].sum())
    assert 1 - real / packed["segment"].size < 1 - real / padded["token_mask"].size
    again = next(run_inputs.data_train_batches(config, patch, 1))  # exact resume
    for key in ("patches", "segment", "image_row", "label"):
        np.testing.assert_array_equal(again[key], packed[key])


def test_a_packed_train_step_is_the_padded_one(tfds_dir):
    """One train step (train.make_train_step, SGD with rate 1: the update is the gradient) on a
    packed batch and on the same images padded: the same loss, accuracy and gradients, to
    float32 rounding."""
    import jax
    import optax

    from rope_lie import run_inputs, sharding

    config = _digits_naflex(tfds_dir)
    # No dropout (its masks follow the batch's shape); a head that passes gradients back.
    config.model.dropout, config.model.head_zero_init = 0.0, False
    padded = next(run_inputs.data_train_batches(config, (2, 2), 0))
    config.naflex.pack = True
    packed = next(run_inputs.data_train_batches(config, (2, 2), 0))
    model = train.build_model(config.model, jax.random.key(0))
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1}, jax.devices()[:1])
    tx = optax.sgd(1.0)
    setup, _ = train.make_setup(model, tx, mesh)
    step = train.make_train_step(setup)
    results = []
    for batch in (padded, packed):
        state, other = train.model_state(model, tx)
        state = jax.tree.map(np.array, state)  # copies: the step donates its state
        new_state, metrics = step(state, batch, other, jax.random.key(1))
        results.append((jax.device_get(metrics), jax.device_get(new_state["params"])))
    (m_pad, p_pad), (m_pack, p_pack) = results
    for key in ("loss", "accuracy", "grad_norm"):
        np.testing.assert_allclose(m_pack[key], m_pad[key], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), p_pack, p_pad)


def test_naflex_digits_packed_trains_and_evaluates(tfds_dir, tmp_path):
    """The training job end to end on packed batches (patch dropout refused with them). The
    evaluations are not packed: one of each kind, image and tokens (every kind at every size is
    test_naflex_digits_smoke_trains_and_evaluates_at_every_size's)."""
    import pytest

    config = _digits_naflex(tfds_dir)
    config.naflex.pack = True
    config.total_steps = 3
    config.evals = {name: config.evals[name] for name in ("size8", "naflex_s06")}
    result = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert result["step"] == 3 and set(result["evals"]) == {"size8", "naflex_s06"}
    for res in result["evals"].values():
        assert res["num_examples"] == 360 and np.isfinite(res["loss"])
    config.model.patch_dropout = 0.25
    with pytest.raises(ValueError, match="naflex.pack=True and model.patch_dropout=0.25"):
        train.train_and_evaluate(config, str(tmp_path / "dropout"))
