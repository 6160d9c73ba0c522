"""Tests for the spatial_arrows_3d builder and the 3D glyphs."""

import numpy as np
import pytest
import tensorflow_datasets as tfds

from rope_lie.data import glyphs
from rope_lie.data import spatial_arrows_3d as sa3

# Written out independently of glyphs.DELTAS_3D: (depth, row, col) step of each class.
STEP = {0: (-1, 0, 0), 1: (1, 0, 0), 2: (0, -1, 0), 3: (0, 1, 0), 4: (0, 0, -1), 5: (0, 0, 1)}


def _tiny(name="tiny3d", **kwargs) -> sa3.SpatialArrows3dConfig:
    fields = dict(cell_size=4, grid_size=4, depth_size=3, num_train=32, num_test=16)
    fields.update(kwargs)
    return sa3.SpatialArrows3dConfig(name=name, **fields)


def _build(config, data_dir) -> tfds.core.DatasetBuilder:
    builder = tfds.builder("spatial_arrows_3d", config=config, data_dir=str(data_dir))
    builder.download_and_prepare()
    return builder


def _match(block: np.ndarray, bank: np.ndarray) -> int:
    """Glyph id whose template equals the block exactly; -1 for blank; -2 otherwise."""
    if not block.any():
        return -1
    hits = np.flatnonzero((bank == block).reshape(len(bank), -1).all(axis=1))
    return int(hits[0]) if len(hits) == 1 else -2


def _face(block: np.ndarray, step: tuple[int, int, int]) -> np.ndarray:
    """The slice of a cell on the side ``step`` points to."""
    axis = int(np.flatnonzero(step)[0])
    return np.take(block, -1 if step[axis] > 0 else 0, axis=axis)


@pytest.mark.parametrize("cell_size", [4, 8])
def test_arrows_and_y_point_their_way(cell_size):
    bank = glyphs.glyph_bank_3d(cell_size)
    centre = (cell_size - 1) / 2
    for d, step in STEP.items():
        voxels = np.argwhere(bank[glyphs.ARROW_IDS_3D[d]])
        # The head plane outweighs the shaft: the centroid lies towards the tip.
        offset = voxels.mean(axis=0) - centre
        assert np.sign(np.round(offset, 6)).tolist() == list(step), d
        # The Y's stem reaches the centre of the face it points to; its prongs,
        # at the opposite face, leave that face's centre empty.
        y = bank[glyphs.Y_IDS_3D[d]]
        mid = slice(cell_size // 4, cell_size - cell_size // 4)
        assert _face(y, step)[mid, mid].all()
        assert not _face(y, tuple(-s for s in step))[mid, mid].any()


def test_templates_are_distinct():
    bank = glyphs.glyph_bank_3d(4)
    assert bank.shape == (17, 4, 4, 4) and bank.dtype == np.uint8
    assert len({t.tobytes() for t in bank}) == 17


def test_invalid_configs_are_rejected():
    with pytest.raises(ValueError, match="cell_size=3"):
        _tiny(cell_size=3)
    with pytest.raises(ValueError, match="do not fit"):
        _tiny(grid_size=2, depth_size=2)


@pytest.mark.parametrize("grid", [(3, 4), (4, 6)])
def test_labels_follow_the_y_stem_to_the_arrow_drawn_there(tmp_path, grid):
    depth, side = grid
    config = _tiny(depth_size=depth, grid_size=side)
    builder = _build(config, tmp_path)
    bank, c = glyphs.glyph_bank_3d(config.cell_size), config.cell_size
    cells = list(np.ndindex(depth, side, side))
    for ex in tfds.as_numpy(builder.as_dataset(split="train")):
        volume = ex["volume"][..., 0]
        assert volume.shape == (depth * c, side * c, side * c)
        found = np.full((depth, side, side), -3)
        for cell in cells:
            found[cell] = _match(glyphs.cell_block(volume, cell, c), bank)
        assert (found >= -1).all()  # no overlapping or stray voxels
        np.testing.assert_array_equal(found, ex["glyphs"])
        assert (found >= 0).sum() == 14 and np.isin(found, glyphs.ARROW_IDS_3D).sum() == 8
        assert np.argwhere(np.isin(found, glyphs.Y_IDS_3D)).tolist() == [ex["y_cell"].tolist()]
        stem = int(found[tuple(ex["y_cell"])] - glyphs.Y_IDS_3D[0])
        assert stem == ex["y_orientation"]
        target = ex["y_cell"] + np.array(STEP[stem])
        np.testing.assert_array_equal(target, ex["target_cell"])
        assert found[tuple(target)] == ex["label"]


def test_larger_grid_keeps_object_counts():
    for config in sa3.CONFIGS:
        cells = sa3.generate_chunk(config, "test", 0)["glyphs"].reshape(sa3.CHUNK, -1)
        assert ((cells >= 0).sum(1) == 14).all()
        assert (np.isin(cells, glyphs.SHAPE_IDS_3D).sum(1) == 5).all()
    shapes = {c.name: c.grid_shape for c in sa3.CONFIGS}
    assert shapes == {"c4_g6": (6, 6, 6), "c4_g8": (8, 8, 8)}


def test_labels_cover_all_six_directions():
    layout = sa3.generate_chunk(_tiny(), "train", 0)
    assert np.bincount(layout["label"], minlength=6).min() > sa3.CHUNK / 6 * 0.6


def test_build_is_deterministic(tmp_path):
    contents = []
    for run in ("a", "b"):
        builder = _build(_tiny(), tmp_path / run)
        contents.append([p.read_bytes() for p in sorted(builder.data_path.glob("*.tfrecord*"))])
    assert len(contents[0]) == 2 and contents[0] == contents[1]
    train = sa3.generate_chunk(_tiny(), "train", 0)["volume"]
    test = sa3.generate_chunk(_tiny(), "test", 0)["volume"]
    assert not (train == test).reshape(len(train), -1).all(axis=1).any()
