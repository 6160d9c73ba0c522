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
