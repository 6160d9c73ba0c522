"""Tests for the spatial_arrows builder and the 2D glyphs: labels, layout, determinism."""

import io

import numpy as np
import pytest
import tensorflow_datasets as tfds

from rope_lie.data import glyphs
from rope_lie.data import spatial_arrows as sa

# Written out independently of glyphs.DELTAS_2D: (row, col) step, rows grow downwards.
STEP = {0: (-1, 0), 1: (0, 1), 2: (1, 0), 3: (0, -1)}  # up, right, down, left


def _tiny(name="tiny", **kwargs) -> sa.SpatialArrowsConfig:
    fields = dict(cell_size=8, grid_size=6, num_train=48, num_test=24)
    fields.update(kwargs)
    return sa.SpatialArrowsConfig(name=name, **fields)


def _build(config, data_dir) -> tfds.core.DatasetBuilder:
    builder = tfds.builder("spatial_arrows", config=config, data_dir=str(data_dir))
    builder.download_and_prepare()
    return builder


def _match(block_HW: np.ndarray, bank: np.ndarray) -> int:
    """Glyph id whose template equals the block exactly; -1 for blank; -2 for anything else."""
    if not block_HW.any():
        return -1
    hits = np.flatnonzero((bank == block_HW).all(axis=(1, 2)))
    return int(hits[0]) if len(hits) == 1 else -2


def _decode_cells(image_HW1: np.ndarray, cell: int, grid: int, bank: np.ndarray) -> np.ndarray:
    return np.array(
        [
            [_match(glyphs.cell_block(image_HW1[..., 0], (r, c), cell), bank) for c in range(grid)]
            for r in range(grid)
        ]
    )


@pytest.mark.parametrize("cell_size", [8, 12])
def test_arrow_templates_point_their_way(cell_size):
    # The head holds more pixels than the tail, so the centroid lies towards the tip;
    # a Y's arms outweigh its stem, so its centroid lies away from where the stem points.
    bank = glyphs.glyph_bank_2d(cell_size)
    for d, (dr, dc) in STEP.items():
        for glyph_id, sign in ((glyphs.ARROW_IDS_2D[d], 1), (glyphs.Y_IDS_2D[d], -1)):
            rows, cols = np.nonzero(bank[glyph_id])
            centre = np.array([rows.min() + rows.max(), cols.min() + cols.max()]) / 2
            offset = np.array([rows.mean(), cols.mean()]) - centre
            assert np.sign(np.round(offset, 6)).tolist() == [sign * dr, sign * dc], glyph_id


@pytest.mark.parametrize("cell_size", [8, 12, 16])
def test_templates_distinct_and_leave_a_gap(cell_size):
    bank = glyphs.glyph_bank_2d(cell_size)
    assert bank.shape == (13, cell_size, cell_size) and bank.dtype == np.uint8
    flat = bank.reshape(13, -1)
    assert len({row.tobytes() for row in flat}) == 13
    # Last row and column are always background: neighbouring glyphs never touch.
    assert not bank[:, -1, :].any() and not bank[:, :, -1].any()


def test_cell_size_too_small_is_rejected():
    with pytest.raises(ValueError, match="cell_size=6"):
        _tiny(cell_size=6)
    with pytest.raises(ValueError, match="do not fit"):
        _tiny(grid_size=3)


def test_named_configs_match_the_paper_resolutions():
    sides = {c.name: c.cell_size * c.grid_size for c in sa.CONFIGS}
    assert sides["c12_g9"] == 108 and sides["c12_g14"] == 168 and sides["c12_g23"] == 276
    assert {"c8_g8", "c8_g12", "c8_g16"} <= set(sides)
    assert sides["c8_g20"] / sides["c8_g8"] == 2.5  # the paper's 276 / 108 step, rounded


def _named(name: str) -> sa.SpatialArrowsConfig:
    return next(c for c in sa.CONFIGS if c.name == name)


@pytest.mark.parametrize("name, side", [("c10_g8", 80), ("c12_g8", 96), ("c16_g8", 128)])
def test_resized_configs_hold_c8_g8s_scenes_at_more_pixels(name, side):
    base, big = (sa.generate_chunk(_named(n), "test", 0) for n in ("c8_g8", name))
    for key in ("glyphs", "label", "y_cell", "target_cell", "y_orientation"):
        np.testing.assert_array_equal(big[key], base[key], err_msg=key)
    assert big["image"].shape == (sa.CHUNK, side, side, 1)
    # Same scene: the 8 px rendering resized, bilinear weights written out here; the ink is the
    # same in proportion to the area.
    small = base["image"][:64, ..., 0].astype(np.float64)
    src = np.clip((np.arange(side) + 0.5) * 64 / side - 0.5, 0, 63)
    lo, frac = np.floor(src).astype(int), src - np.floor(src)
    hi = np.minimum(lo + 1, 63)
    rows = small[:, lo] * (1 - frac)[:, None] + small[:, hi] * frac[:, None]
    ref = rows[:, :, lo] * (1 - frac) + rows[:, :, hi] * frac
    # (+-1 where a value sits on .5 and the two sums round differently)
    np.testing.assert_allclose(big["image"][:64, ..., 0], ref, rtol=0, atol=0.5 + 1e-9)
    np.testing.assert_allclose(
        big["image"].mean(axis=(1, 2, 3)), base["image"].mean(axis=(1, 2, 3)), rtol=0.02
    )


def test_bilinear_weights_by_hand():
    # 2 -> 4 px, half-pixel centres: samples at -0.25, 0.25, 0.75, 1.25 (clamped to [0, 1]).
    np.testing.assert_allclose(
        glyphs.bilinear_weights(2, 4), [[1, 0], [0.75, 0.25], [0.25, 0.75], [0, 1]]
    )
    np.testing.assert_allclose(glyphs.bilinear_weights(5, 5), np.eye(5))
    image = np.array([[[0, 255], [255, 0]]], np.uint8)
    np.testing.assert_array_equal(glyphs.resize_bilinear(image, (2, 2)), image)


def test_render_cell_larger_than_the_cell_is_rejected():
    with pytest.raises(ValueError, match=r"render_cell=12 > cell_size=8"):
        _tiny(render_cell=12)


@pytest.mark.parametrize("grid_size", [6, 12])
def test_labels_follow_the_y_stem_to_the_arrow_drawn_there(tmp_path, grid_size):
    config = _tiny(grid_size=grid_size)
    builder = _build(config, tmp_path)
    bank = glyphs.glyph_bank_2d(config.cell_size)
    for ex in tfds.as_numpy(builder.as_dataset(split="train")):
        cells = _decode_cells(ex["image"], config.cell_size, grid_size, bank)
        # Every cell is blank or exactly one template: glyphs neither overlap nor bleed.
        assert (cells >= -1).all()
        np.testing.assert_array_equal(cells, ex["glyphs"])
        y_cells = np.argwhere(np.isin(cells, glyphs.Y_IDS_2D))
        assert y_cells.tolist() == [ex["y_cell"].tolist()]
        stem = int(cells[tuple(ex["y_cell"])] - glyphs.Y_IDS_2D[0])
        assert stem == ex["y_orientation"]
        target = ex["y_cell"] + np.array(STEP[stem])
        np.testing.assert_array_equal(target, ex["target_cell"])
        arrow = _match(glyphs.cell_block(ex["image"][..., 0], target, config.cell_size), bank)
        assert arrow in glyphs.ARROW_IDS_2D and arrow == ex["label"]


@pytest.mark.parametrize("grid_size", [6, 9, 23])
def test_object_counts_are_the_same_on_every_grid(grid_size):
    config = _tiny(grid_size=grid_size)
    layout = sa.generate_chunk(config, "train", 0)
    cells = layout["glyphs"].reshape(sa.CHUNK, -1)
    assert ((cells >= 0).sum(1) == 1 + 8 + 5).all()
    assert (np.isin(cells, glyphs.Y_IDS_2D).sum(1) == 1).all()
    assert (np.isin(cells, glyphs.ARROW_IDS_2D).sum(1) == 8).all()
    letters = np.sort(np.where(np.isin(cells, glyphs.LETTER_IDS_2D), cells, 99), axis=1)[:, :5]
    np.testing.assert_array_equal(letters, np.tile(glyphs.LETTER_IDS_2D, (sa.CHUNK, 1)))
    assert layout["image"].shape == (sa.CHUNK, grid_size * 8, grid_size * 8, 1)


def test_labels_and_orientations_cover_all_classes():
    layout = sa.generate_chunk(_tiny(), "train", 0)
    for key in ("label", "y_orientation"):
        counts = np.bincount(layout[key], minlength=4)
        assert counts.min() > sa.CHUNK / 4 * 0.8, (key, counts)


def test_build_is_deterministic_and_splits_differ(tmp_path):
    config = _tiny()
    files = []
    for run in ("a", "b"):
        builder = _build(config, tmp_path / run)
        paths = sorted(builder.data_path.glob("*.tfrecord*"))
        files.append([p.read_bytes() for p in paths])
    assert len(files[0]) == 2 and files[0] == files[1]
    other = _build(_tiny(name="seed1", seed=1), tmp_path / "c")
    other_bytes = [p.read_bytes() for p in sorted(other.data_path.glob("*.tfrecord*"))]
    assert other_bytes != files[0]
    train = sa.generate_chunk(config, "train", 0)["image"]
    test = sa.generate_chunk(config, "test", 0)["image"]
    assert not (train == test).all(axis=(1, 2, 3)).any()


@pytest.mark.parametrize("shape", [(64, 64, 1), (3, 5, 1), (1, 1, 1)])
def test_png_bytes_decode_exactly_with_pil_and_tensorflow(shape):
    import tensorflow as tf
    from PIL import Image

    rng = np.random.default_rng(sum(shape))
    for image in (rng.integers(0, 256, shape, dtype=np.uint8), 255 * (rng.random(shape) < 0.2)):
        image = image.astype(np.uint8)
        data = glyphs.png_bytes(image)
        np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(data)))[..., None], image)
        np.testing.assert_array_equal(tf.io.decode_png(data).numpy(), image)
    with pytest.raises(ValueError, match=r"expected uint8 \(H, W, 1\), got float32"):
        glyphs.png_bytes(np.zeros((2, 2, 1), np.float32))


def test_mixed_grids_put_each_scene_in_the_canvas_corner_with_its_extent(tmp_path):
    config = _tiny("tiny_mixed", grid_size=8, min_grid=6)
    builder = _build(config, tmp_path)
    assert builder.info.features["image"].shape == (64, 64, 1)
    bank = glyphs.glyph_bank_2d(8)
    sizes = []
    for ex in tfds.as_numpy(builder.as_dataset(split="train")):
        side = int(ex["extent"][0])
        grid = side // 8
        sizes.append(grid)
        assert ex["extent"].tolist() == [side, side] and 6 <= grid <= 8
        assert not ex["image"][side:].any() and not ex["image"][:, side:].any()
        cells = _decode_cells(ex["image"], 8, 8, bank)
        np.testing.assert_array_equal(cells, ex["glyphs"])  # padded cells: empty (-1)
        scene = cells[:grid, :grid]
        assert (
            np.isin(scene, glyphs.Y_IDS_2D).sum(),
            np.isin(scene, glyphs.ARROW_IDS_2D).sum(),
        ) == (1, 8)
        target = ex["y_cell"] + np.array(STEP[int(ex["y_orientation"])])
        assert (target < grid).all() and cells[tuple(target)] == ex["label"]
    assert set(sizes) == {6, 7, 8}


def test_fixed_configs_draw_the_same_scenes_as_before_mixed_grids():
    # chunk_rng without a sub-stream is the generator the fixed-size configs always used.
    layout = sa.generate_chunk(_tiny(), "train", 3)
    rng = np.random.default_rng([0, 0, 3])
    expected = glyphs.sample_layouts(
        rng,
        sa.CHUNK,
        grid_shape=(6, 6),
        deltas=glyphs.DELTAS_2D,
        num_distractor_arrows=7,
        letter_ids=glyphs.LETTER_IDS_2D,
        num_letters=5,
    )
    np.testing.assert_array_equal(layout["glyphs"], expected["glyphs"])


@pytest.mark.parametrize(
    "fields", [dict(min_grid=8), dict(min_grid=9), dict(min_grid=6, render_cell=8, cell_size=10)]
)
def test_bad_mixed_grid_configs_are_rejected(fields):
    with pytest.raises(ValueError, match="min_grid"):
        _tiny(**{"grid_size": 8, **fields})
