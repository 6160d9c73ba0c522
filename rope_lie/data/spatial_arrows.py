"""`spatial_arrows`: the LieRE spatial-reasoning task as a locally generated TFDS dataset.

LieRE (Ostmeier et al., arXiv:2406.10322, Sec. 5.2, Fig. 5): a G x G grid of
cells of c pixels, at most one glyph per cell. One cell holds a Y drawn in one
of four orientations; the cell next to it in the direction its stem (base)
points holds the *target* arrow. The label is the target arrow's direction:

    0 up, 1 right, 2 down, 3 left        (row index grows downwards)

Distractors on random free cells: ``num_distractor_arrows`` more arrows (7,
random directions) and ``num_letters`` distinct letters from A-E (5). The paper
says "eight arrows and six letters (A, B, C, D, E, and Y)" and, in the same
paragraph, "four spurious letters"; we follow the first sentence (all five
letters A-E plus the Y), and ``num_letters`` changes it.

The paper trains on 108 px images (12 px cells, 9 x 9 grid) and evaluates at
168 and 276 px with the same cell size, i.e. larger grids (14 x 14, 23 x 23)
holding the same number of objects; configs ``c12_g9``, ``c12_g14``,
``c12_g23``. CPU-scale configs use 8 px cells (patch = cell, so the grid is the
token grid): ``c8_g8`` for training and ``c8_g12``, ``c8_g16``, ``c8_g20`` (2.5x, the paper's
276/108) for extrapolation. Images are grayscale uint8 (G c, G c, 1), glyphs 255 on 0.

The same scenes at more pixels (a resolution change as Heo et al.'s RoPE-ViT study makes it,
rather than a larger grid): ``c10_g8``, ``c12_g8``, ``c16_g8`` hold exactly the layouts of
``c8_g8`` (same seed, grid and streams), rendered at 8 px cells and resized bilinearly to
80, 96 and 128 px (``render_cell=8``). A model with 8 px patches trained on ``c8_g8`` then sees
each glyph over 1.25-2 patches per side. The eval-only configs have 2,000 training examples
(the first 2,000 of the stream), which keeps their generation short.

Generation is deterministic: examples come in chunks of ``CHUNK`` drawn from
``np.random.default_rng([seed, split_id, chunk])`` with split_id 0 for train
and 1 for test (see arrows.py), so the two splits use different streams and the same config
always gives the same bytes.
"""

import dataclasses

import numpy as np
import tensorflow_datasets as tfds

from rope_lie.data import arrows, glyphs

CHUNK = 1024  # examples rendered per vectorised call; part of the determinism contract


@dataclasses.dataclass(eq=False)
class SpatialArrowsConfig(tfds.core.BuilderConfig):
    """A spatial_arrows variant.

    Attributes:
      cell_size: cell side in pixels (>= 8).
      grid_size: cells per image side; the image is grid_size * cell_size pixels.
      num_train: examples in the train split.
      num_test: examples in the test split.
      seed: generation seed; train and test derive different streams from it.
      num_distractor_arrows: arrows besides the target.
      num_letters: distinct distractor letters drawn from A-E (0..5).
      render_cell: 0 to draw glyphs in ``cell_size`` px cells; otherwise draw them in
        ``render_cell`` px cells and resize the image bilinearly to ``cell_size`` px cells
        (the same scene at another resolution).
      min_grid: 0 for one grid size; otherwise each example's grid is uniform in
        [min_grid, grid_size] cells a side, drawn in the top-left corner of a
        ``grid_size * cell_size`` px canvas (background elsewhere), and the ``extent`` feature
        gives its (height, width) in pixels: mixed-size training scenes, read at their own
        size by the NaFlex pipeline's native mode (rope_lie/data/naflex.py).
    """

    cell_size: int = 8
    grid_size: int = 8
    num_train: int = 20_000
    num_test: int = 2_000
    seed: int = 0
    num_distractor_arrows: int = 7
    num_letters: int = 5
    render_cell: int = 0
    min_grid: int = 0

    def __post_init__(self):
        glyphs.check_layout_sizes(
            (self.min_grid or self.grid_size,) * 2,
            self.num_distractor_arrows,
            self.num_letters,
            len(glyphs.LETTERS),
        )
        if self.min_grid and not 1 <= self.min_grid < self.grid_size:
            raise ValueError(
                f"min_grid={self.min_grid} ({self.name}); expected 0 (one grid size) or "
                f"1 <= min_grid < grid_size={self.grid_size}"
            )
        if self.min_grid and self.render_cell:
            raise ValueError(f"{self.name}: min_grid and render_cell do not combine")
        glyphs.glyph_bank_2d(self.render_cell or self.cell_size)  # validates the cell sizes
        if self.render_cell and self.render_cell > self.cell_size:
            raise ValueError(
                f"render_cell={self.render_cell} > cell_size={self.cell_size} ({self.name}): "
                "resizing is for the same scene at more pixels"
            )
        arrows.check_split_sizes(self)


def _config(
    cell: int, grid: int, num_train: int, num_test: int, note: str, render_cell: int = 0
) -> SpatialArrowsConfig:
    return SpatialArrowsConfig(
        name=f"c{cell}_g{grid}",
        description=f"{cell} px cells, {grid}x{grid} grid ({cell * grid} px); {note}",
        cell_size=cell,
        grid_size=grid,
        num_train=num_train,
        num_test=num_test,
        render_cell=render_cell,
    )


def _mixed_config(
    cell: int, min_grid: int, grid: int, num_train: int, num_test: int, note: str
) -> SpatialArrowsConfig:
    return SpatialArrowsConfig(
        name=f"c{cell}_g{min_grid}to{grid}",
        description=f"{cell} px cells, grids of {min_grid} to {grid} cells a side on a "
        f"{cell * grid} px canvas; {note}",
        cell_size=cell,
        grid_size=grid,
        min_grid=min_grid,
        num_train=num_train,
        num_test=num_test,
    )


CONFIGS = (
    _config(12, 9, 800_000, 10_000, "paper training resolution (108 px)"),
    _config(12, 14, 10_000, 10_000, "paper evaluation at 168 px"),
    _config(12, 23, 10_000, 10_000, "paper evaluation at 276 px"),
    _config(8, 8, 20_000, 2_000, "CPU scale, training grid"),
    _config(8, 12, 20_000, 2_000, "CPU scale, extrapolation"),
    _config(8, 16, 20_000, 2_000, "CPU scale, extrapolation"),
    _config(8, 20, 2_000, 2_000, "CPU scale, extrapolation at 2.5x (the paper's 276/108)"),
    *(
        _config(c, 8, 2_000, 2_000, f"c8_g8's scenes resized to {8 * c} px", render_cell=8)
        for c in (10, 12, 16)
    ),
    _mixed_config(8, 6, 10, 20_000, 2_000, "CPU scale, mixed-size training"),
    _mixed_config(12, 7, 11, 800_000, 10_000, "paper scale (around g9), mixed-size training"),
)


def generate_chunk(config: SpatialArrowsConfig, split: str, chunk: int) -> dict[str, np.ndarray]:
    """Layouts and images of one chunk of a split (pure numpy, no TFDS).

    Args:
      config: the variant.
      split: "train" or "test".
      chunk: chunk index; examples [chunk * CHUNK, (chunk + 1) * CHUNK) of the split.

    Returns:
      ``glyphs.sample_layouts`` output plus ``image`` uint8 (CHUNK, G c, G c, 1); with
      ``min_grid``, ``glyphs`` is padded to (G, G) with empty cells and ``extent`` int32
      (CHUNK, 2) gives each scene's pixels.
    """
    if config.min_grid:
        return _mixed_chunk(config, split, chunk)
    layout = arrows.sample_chunk(
        config,
        split,
        chunk,
        chunk_size=CHUNK,
        grid_shape=(config.grid_size, config.grid_size),
        deltas=glyphs.DELTAS_2D,
        letter_ids=glyphs.LETTER_IDS_2D,
    )
    bank = glyphs.glyph_bank_2d(config.render_cell or config.cell_size)
    image = glyphs.render_grid(layout["glyphs"], bank)
    if config.render_cell:
        side = config.grid_size * config.cell_size
        image = glyphs.resize_bilinear(image, (side, side))
    layout["image"] = image[..., None]
    return layout


def _mixed_chunk(config: SpatialArrowsConfig, split: str, chunk: int) -> dict[str, np.ndarray]:
    """``generate_chunk`` of a mixed-size config: every example's grid uniform in
    [min_grid, grid_size], its layout sampled at that grid (one stream per grid size), drawn in
    the canvas's top-left corner."""
    grids = arrows.chunk_rng(config, split, chunk, "grids").integers(
        config.min_grid, config.grid_size + 1, size=CHUNK
    )
    big, cell = config.grid_size, config.cell_size
    out = {
        "glyphs": np.full((CHUNK, big, big), -1, np.int8),
        "image": np.zeros((CHUNK, big * cell, big * cell, 1), np.uint8),
        "extent": np.repeat(grids[:, None] * cell, 2, axis=1).astype(np.int32),
    }
    bank = glyphs.glyph_bank_2d(cell)
    for g in range(config.min_grid, big + 1):
        chosen = np.flatnonzero(grids == g)
        if not chosen.size:
            continue
        layout = arrows.sample_chunk(
            config,
            split,
            chunk,
            chunk_size=len(chosen),
            grid_shape=(g, g),
            deltas=glyphs.DELTAS_2D,
            letter_ids=glyphs.LETTER_IDS_2D,
            stream=(g,),
        )
        glyphs_BGG = layout.pop("glyphs")
        out["glyphs"][chosen, :g, :g] = glyphs_BGG
        out["image"][chosen, : g * cell, : g * cell, 0] = glyphs.render_grid(glyphs_BGG, bank)
        for key, value in layout.items():  # labels and cells: one row per example
            if key not in out:
                out[key] = np.zeros((CHUNK, *value.shape[1:]), value.dtype)
            out[key][chosen] = value
    return out


class SpatialArrows(arrows.ChunkedSplits, tfds.core.GeneratorBasedBuilder):
    """LieRE spatial-reasoning task: direction of the arrow the Y's stem points to."""

    name = "spatial_arrows"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    # Nothing is downloaded, so there is no checksums file beside the code for TFDS to find
    # (its lookup would also need the importlib_resources package).
    code_path = None
    BUILDER_CONFIGS = list(CONFIGS)
    DEFAULT_CONFIG_NAME = "c8_g8"
    chunk_size = CHUNK
    generate_chunk = staticmethod(generate_chunk)

    @staticmethod
    def encode_example(example: dict) -> dict:
        return {**example, "image": glyphs.png_bytes(example["image"])}

    def _info(self) -> tfds.core.DatasetInfo:
        cfg = self.builder_config
        side, g = cfg.grid_size * cfg.cell_size, cfg.grid_size
        return self.dataset_info_from_configs(
            description=__doc__,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(side, side, 1), encoding_format="png"),
                    "label": tfds.features.ClassLabel(names=glyphs.DIRECTIONS_2D),
                    "y_cell": tfds.features.Tensor(shape=(2,), dtype=np.int32),
                    "y_orientation": tfds.features.ClassLabel(names=glyphs.DIRECTIONS_2D),
                    "target_cell": tfds.features.Tensor(shape=(2,), dtype=np.int32),
                    "glyphs": tfds.features.Tensor(shape=(g, g), dtype=np.int8),
                    **(
                        {"extent": tfds.features.Tensor(shape=(2,), dtype=np.int32)}
                        if cfg.min_grid
                        else {}
                    ),
                }
            ),
            supervised_keys=("image", "label"),
            homepage="https://arxiv.org/abs/2406.10322",
        )
