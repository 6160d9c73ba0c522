"""`spatial_arrows_3d`: the spatial-reasoning task of `spatial_arrows` in a volume.

A D x G x G grid of cubic cells of c voxels, at most one glyph per cell (see
glyphs.py for the voxel patterns): a Y whose stem points along one of six
directions, the target arrow in the neighbouring cell along the stem,
``num_distractor_arrows`` more arrows and ``num_letters`` distinct distractor
shapes (cube, corners, jack, ring, plates: the 3D stand-ins for letters A-E).
The label is the target arrow's direction, 6 classes over (depth, row, col):

    0 -depth, 1 +depth, 2 -row, 3 +row, 4 -col, 5 +col    (class = 2 * axis + [increasing])

An arrow is a 2k x 2k shaft along its axis with a wide head plane one block
before its tip (k = c // 4); a Y is a 2k x 2k stem on the half of the cell
towards its base and two prongs on the other half. Volumes are uint8
(D c, G c, G c, 1), glyph voxels 255 on 0, stored zlib-compressed.

Configs: ``c4_g6`` (6 x 6 x 6 cells, 24^3 voxels; with a 4^3 tubelet the grid
is the token grid) for training and ``c4_g8`` (8^3 cells, same object counts)
for extrapolation. Deterministic as in `spatial_arrows`: chunk k of split s is
drawn from ``np.random.default_rng([seed, s, k])`` (s = 0 train, 1 test).
"""

import dataclasses

import numpy as np
import tensorflow_datasets as tfds

from rope_lie.data import arrows, glyphs

CHUNK = 256  # examples rendered per vectorised call; part of the determinism contract


@dataclasses.dataclass(eq=False)
class SpatialArrows3dConfig(tfds.core.BuilderConfig):
    """A spatial_arrows_3d variant.

    Attributes:
      cell_size: cell side in voxels (>= 4; glyphs scale by cell_size // 4).
      grid_size: cells along rows and along columns (G).
      depth_size: cells along depth (D).
      num_train: examples in the train split.
      num_test: examples in the test split.
      seed: generation seed; train and test derive different streams from it.
      num_distractor_arrows: arrows besides the target.
      num_letters: distinct distractor shapes (0..5).
    """

    cell_size: int = 4
    grid_size: int = 6
    depth_size: int = 6
    num_train: int = 20_000
    num_test: int = 2_000
    seed: int = 0
    num_distractor_arrows: int = 7
    num_letters: int = 5

    def __post_init__(self):
        glyphs.check_layout_sizes(
            self.grid_shape, self.num_distractor_arrows, self.num_letters, len(glyphs.SHAPES_3D)
        )
        glyphs.glyph_bank_3d(self.cell_size)  # validates cell_size
        arrows.check_split_sizes(self)

    @property
    def grid_shape(self) -> tuple[int, int, int]:
        """Cells per axis, (D, G, G)."""
        return (self.depth_size, self.grid_size, self.grid_size)


CONFIGS = (
    SpatialArrows3dConfig(
        name="c4_g6",
        description="4-voxel cells, 6x6x6 grid (24^3 voxels); training grid",
        grid_size=6,
        depth_size=6,
    ),
    SpatialArrows3dConfig(
        name="c4_g8",
        description="4-voxel cells, 8x8x8 grid (32^3 voxels); extrapolation, same objects",
        grid_size=8,
        depth_size=8,
        num_train=2_000,
    ),
)


def generate_chunk(config: SpatialArrows3dConfig, split: str, chunk: int) -> dict[str, np.ndarray]:
    """Layouts and volumes of one chunk of a split (pure numpy, no TFDS).

    Args:
      config: the variant.
      split: "train" or "test".
      chunk: chunk index; examples [chunk * CHUNK, (chunk + 1) * CHUNK) of the split.

    Returns:
      ``glyphs.sample_layouts`` output (cells are (depth, row, col)) plus
      ``volume`` uint8 (CHUNK, D c, G c, G c, 1).
    """
    layout = arrows.sample_chunk(
        config,
        split,
        chunk,
        chunk_size=CHUNK,
        grid_shape=config.grid_shape,
        deltas=glyphs.DELTAS_3D,
        letter_ids=glyphs.SHAPE_IDS_3D,
    )
    bank = glyphs.glyph_bank_3d(config.cell_size)
    layout["volume"] = glyphs.render_grid(layout["glyphs"], bank)[..., None]
    return layout


class SpatialArrows3d(arrows.ChunkedSplits, tfds.core.GeneratorBasedBuilder):
    """3D spatial-reasoning task: direction of the arrow the Y's stem points to."""

    name = "spatial_arrows_3d"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    # Nothing is downloaded, so there is no checksums file beside the code for TFDS to find
    # (its lookup would also need the importlib_resources package).
    code_path = None
    BUILDER_CONFIGS = list(CONFIGS)
    DEFAULT_CONFIG_NAME = "c4_g6"
    chunk_size = CHUNK
    generate_chunk = staticmethod(generate_chunk)

    def _info(self) -> tfds.core.DatasetInfo:
        cfg = self.builder_config
        shape = tuple(n * cfg.cell_size for n in cfg.grid_shape) + (1,)
        return self.dataset_info_from_configs(
            description=__doc__,
            features=tfds.features.FeaturesDict(
                {
                    "volume": tfds.features.Tensor(
                        shape=shape, dtype=np.uint8, encoding=tfds.features.Encoding.ZLIB
                    ),
                    "label": tfds.features.ClassLabel(names=glyphs.DIRECTIONS_3D),
                    "y_cell": tfds.features.Tensor(shape=(3,), dtype=np.int32),
                    "y_orientation": tfds.features.ClassLabel(names=glyphs.DIRECTIONS_3D),
                    "target_cell": tfds.features.Tensor(shape=(3,), dtype=np.int32),
                    "glyphs": tfds.features.Tensor(shape=cfg.grid_shape, dtype=np.int8),
                }
            ),
            supervised_keys=("volume", "label"),
            homepage="https://arxiv.org/abs/2406.10322",
        )
