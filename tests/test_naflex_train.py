"""End to end: a NaFlex run (mixed-size token batches, patch dropout) through rope_lie.train."""

import numpy as np

from configs import digits
from rope_lie import train


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
