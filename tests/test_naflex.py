"""Tests for rope_lie.data.naflex: token budgets, patches that reassemble the resized image,
and NaFlex training/evaluation streams from a TFDS dataset."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import rope_lie.data as data
from rope_lie.data import naflex
from rope_lie.data.spatial_arrows import SpatialArrowsConfig

NAME = "spatial_arrows/naflex_g6"  # 48 x 48 px, 8 px cells


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("tfds"))
    config = SpatialArrowsConfig(name="naflex_g6", grid_size=6, num_train=32, num_test=10)
    tfds.builder("spatial_arrows", config=config, data_dir=root).download_and_prepare()
    return root


def _cfg(data_dir):
    cfg = data.default_config(NAME)
    cfg.data_dir = data_dir
    return cfg


@pytest.mark.parametrize(
    "height, width, budget, expected",
    [
        (64, 64, 64, (8, 8)),
        (64, 64, 80, (8, 8)),
        (48, 96, 50, (5, 10)),
        (100, 30, 30, (10, 3)),
        (10, 300, 16, (1, 16)),
        (33, 47, 1, (1, 1)),
    ],
)
def test_budget_grid_keeps_the_aspect_ratio_within_the_budget(height, width, budget, expected):
    grid = tuple(naflex.budget_grid(height, width, 8, budget).numpy())
    assert grid == expected


def test_budget_grid_never_exceeds_the_budget_and_is_largest():
    rng = np.random.default_rng(0)
    for _ in range(200):
        h, w, budget = (
            int(rng.integers(8, 400)),
            int(rng.integers(8, 400)),
            int(rng.integers(1, 300)),
        )
        gh, gw = naflex.budget_grid(h, w, 4, budget).numpy()
        assert 1 <= gh * gw <= budget, (h, w, budget, gh, gw)
        # One more patch on the side whose ratio allows it would break the budget or the ratio.
        if gh > 1 and gw > 1:
            assert (gh + 1) * (gw + 1) > budget


def test_patches_reassemble_the_resized_image():
    image = tf.constant(np.random.default_rng(1).normal(size=(30, 45, 2)), tf.float32)
    grid = naflex.budget_grid(30, 45, 3, 40)
    out = {k: v.numpy() for k, v in naflex.tokens_of(image, 3, grid, 48).items()}
    gh, gw = out["grid"]
    count = gh * gw
    assert count <= 40 and out["token_mask"].sum() == count
    np.testing.assert_array_equal(out["patches"][count:], 0)
    resized = tf.image.resize(image, [gh * 3, gw * 3], antialias=True).numpy()
    rebuilt = np.zeros_like(resized)
    for (r, c), patch in zip(out["index"][:count], out["patches"][:count], strict=True):
        rebuilt[3 * r : 3 * r + 3, 3 * c : 3 * c + 3] = patch.reshape(3, 3, 2)
    np.testing.assert_array_equal(rebuilt, resized)


def test_training_stream_mixes_sizes_within_the_budget_and_resumes(data_dir):
    finish = naflex.example_fn(8, 36, min_side=3, max_side=6)
    stream = lambda start: data.make_train_iterator(
        _cfg(data_dir), batch_size=8, seed=0, start_step=start, finish=finish
    )
    batches = [next(it) for it in [stream(0)] for _ in range(3)]
    grids = np.concatenate([b["grid"] for b in batches])
    assert len({tuple(g) for g in grids}) > 2  # sizes vary (square images: side x side)
    assert (grids[:, 0] == grids[:, 1]).all() and (grids >= 3).all() and (grids <= 6).all()
    for b in batches:
        assert "image" not in b and b["patches"].shape == (8, 36, 64)
        np.testing.assert_array_equal(b["token_mask"].sum(1), b["grid"].prod(1))
    resumed = next(stream(2))
    for key in ("patches", "grid", "label"):
        np.testing.assert_array_equal(resumed[key], batches[2][key])


def test_native_stream_reads_each_scene_at_its_own_extent(tmp_path):
    config = SpatialArrowsConfig(
        name="naflex_mixed", grid_size=8, min_grid=6, num_train=24, num_test=8
    )
    root = str(tmp_path)
    builder = tfds.builder("spatial_arrows", config=config, data_dir=root)
    builder.download_and_prepare()
    cfg = data.default_config("spatial_arrows/naflex_mixed")
    cfg.data_dir = root
    finish = naflex.example_fn(8, 64, native=True)
    batch = next(data.make_train_iterator(cfg, batch_size=8, seed=0, finish=finish))
    by_image = list(tfds.as_numpy(builder.as_dataset(split="train")))
    for patches, grid, mask, label in zip(
        batch["patches"], batch["grid"], batch["token_mask"], batch["label"], strict=True
    ):
        count = int(grid.prod())
        assert grid[0] == grid[1] and 6 <= grid[0] <= 8 and mask.sum() == count
        np.testing.assert_array_equal(patches[count:], 0)
        # The tokens are the scene's own 8 px cells, normalised, unresized: find its example.
        cells = patches[:count].reshape(grid[0], grid[1], 8, 8)
        image = cells.transpose(0, 2, 1, 3).reshape(8 * grid[0], 8 * grid[1])
        matches = [
            ex
            for ex in by_image
            if ex["extent"][0] == 8 * grid[0]
            and np.allclose(image, ex["image"][: 8 * grid[0], : 8 * grid[1], 0] / 127.5 - 1.0)
        ]
        assert len(matches) == 1 and matches[0]["label"] == label
    with pytest.raises(tf.errors.InvalidArgumentError, match="more tokens than max_tokens"):
        next(
            data.make_train_iterator(
                cfg, batch_size=8, seed=0, finish=naflex.example_fn(8, 36, native=True)
            )
        )


def test_eval_stream_at_a_fixed_budget(data_dir):
    finish = naflex.example_fn(8, 25, budget=25)
    batch = next(data.make_eval_iterator(_cfg(data_dir), batch_size=16, finish=finish))
    np.testing.assert_array_equal(batch["grid"][:10], np.full((10, 2), 5))
    np.testing.assert_array_equal(batch["grid"][10:], 0)  # padding examples: zeros
    np.testing.assert_array_equal(batch["mask"], [1] * 10 + [0] * 6)
    assert batch["token_mask"][:10].all() and not batch["token_mask"][10:].any()


def test_mixing_and_bad_configs_are_rejected(data_dir):
    cfg = _cfg(data_dir)
    cfg.augment.mixup_alpha = 0.2
    with pytest.raises(ValueError, match="mixup and cutmix"):
        data.make_train_iterator(
            cfg, batch_size=8, seed=0, finish=naflex.example_fn(8, 36, budget=36)
        )
    with pytest.raises(ValueError, match="budget=49 > max_tokens=36"):
        naflex.example_fn(8, 36, budget=49)


def test_check_config_names_the_bad_field():
    from rope_lie import config_lib

    naflex.check_config(config_lib.naflex_config(3, 6), (8, 8), 2)
    with pytest.raises(ValueError, match="min_side=7, max_side=6"):
        naflex.check_config(config_lib.naflex_config(7, 6), (8, 8), 2)
    with pytest.raises(ValueError, match="max_tokens=20 < max_side"):
        naflex.check_config(config_lib.naflex_config(3, 6, max_tokens=20), (8, 8), 2)
    with pytest.raises(ValueError, match="square patches"):
        naflex.check_config(config_lib.naflex_config(3, 6), (2, 8, 8), 3)


def test_native_mode_refuses_augmentations_that_move_the_content():
    from configs import arrows
    from rope_lie import run_inputs

    config = arrows.get_config("pe=rope_mixed,mixed_grids")
    patch = (8, 8)  # the recipe's mu/8
    run_inputs.naflex_finish(config, patch)  # the recipe as it is: no augmentation
    config.dataset.augment.flip = True
    with pytest.raises(ValueError, match=r"flip=True .* expected crop='none', flip=False"):
        run_inputs.naflex_finish(config, patch)
