"""Glyphs, layout sampling and vectorised rendering shared by the spatial-reasoning datasets.

2D glyphs are 7x7 bitmaps (arrows, a Y, letters A-E), scaled by the largest
integer factor k with 7k <= cell_size - 1 and centred in the cell, so two
glyphs in neighbouring cells are always separated by at least one background
pixel. Rotations use ``np.rot90`` on odd-sized bitmaps, which is exact.

3D glyphs are 4x4x4 voxel patterns scaled by k = cell_size // 4 and centred:
an arrow is a 2x2 shaft with a wide head plane one voxel before its tip, the Y
is a 2x2 stem with two prongs, and the five "letters" are symmetric shapes.

Glyph ids (index into the bank returned by ``glyph_bank_2d``/``glyph_bank_3d``;
-1 in a layout is an empty cell):

- 2D: 0-3 arrow pointing up/right/down/left; 4-7 Y whose stem points
  up/right/down/left; 8-12 letters A-E.
- 3D: 0-5 arrow pointing along direction d; 6-11 Y whose stem points along d;
  12-16 distractor shapes (cube, corners, jack, ring, plates). A 3D direction d
  is axis d // 2 of (depth, row, col), towards decreasing index when d is even
  and increasing index when d is odd.

Foreground pixels are 255, background 0.
"""

import struct
import zlib

import numpy as np

DIRECTIONS_2D = ("up", "right", "down", "left")
# (row, col) step of each 2D direction.
DELTAS_2D = np.array([(-1, 0), (0, 1), (1, 0), (0, -1)], dtype=np.int32)
DIRECTIONS_3D = ("-depth", "+depth", "-row", "+row", "-col", "+col")
# (depth, row, col) step of each 3D direction: axis d // 2, sign -1 (even d) or +1 (odd d).
DELTAS_3D = np.array(
    [[(-1 if d % 2 == 0 else 1) * (axis == d // 2) for axis in range(3)] for d in range(6)],
    dtype=np.int32,
)
LETTERS = ("A", "B", "C", "D", "E")
SHAPES_3D = ("cube", "corners", "jack", "ring", "plates")

ARROW_IDS_2D = np.arange(0, 4)
Y_IDS_2D = np.arange(4, 8)
LETTER_IDS_2D = np.arange(8, 13)
ARROW_IDS_3D = np.arange(0, 6)
Y_IDS_3D = np.arange(6, 12)
SHAPE_IDS_3D = np.arange(12, 17)

_BITMAPS_2D = {
    "arrow_up": ("...#...", "..###..", ".#.#.#.", "#..#..#", "...#...", "...#...", "...#..."),
    "y_stem_down": ("#.....#", ".#...#.", "..#.#..", "...#...", "...#...", "...#...", "...#..."),
    "A": ("..###..", ".#...#.", "#.....#", "#######", "#.....#", "#.....#", "#.....#"),
    "B": ("######.", "#.....#", "#.....#", "######.", "#.....#", "#.....#", "######."),
    "C": (".#####.", "#.....#", "#......", "#......", "#......", "#.....#", ".#####."),
    "D": ("#####..", "#....#.", "#.....#", "#.....#", "#.....#", "#....#.", "#####.."),
    "E": ("#######", "#......", "#......", "#####..", "#......", "#......", "#######"),
}
BITMAP_SIZE_2D = 7
BITMAP_SIZE_3D = 4


def _bitmap(rows: tuple[str, ...]) -> np.ndarray:
    """Parses '#'/'.' strings into a uint8 {0, 255} array."""
    return np.array([[255 if ch == "#" else 0 for ch in row] for row in rows], dtype=np.uint8)


def _place(pattern: np.ndarray, cell_size: int) -> np.ndarray:
    """Scales a square/cubic pattern by an integer factor and centres it in a cell.

    Args:
      pattern: uint8 array of side s and rank 2 or 3.
      cell_size: side of the output cell in pixels (voxels).

    Returns:
      uint8 array of side cell_size and the rank of ``pattern``.
    """
    side = pattern.shape[0]
    scale = max(1, (cell_size - 1) // side) if pattern.ndim == 2 else cell_size // side
    big = pattern
    for axis in range(pattern.ndim):
        big = np.repeat(big, scale, axis=axis)
    start = (cell_size - side * scale) // 2
    out = np.zeros((cell_size,) * pattern.ndim, dtype=np.uint8)
    out[tuple(slice(start, start + side * scale) for _ in range(pattern.ndim))] = big
    return out


def glyph_bank_2d(cell_size: int) -> np.ndarray:
    """All 2D glyph templates for one cell size.

    Args:
      cell_size: cell side in pixels; at least 8 (a 7x7 glyph plus a 1-pixel gap).

    Returns:
      uint8 array (13, cell_size, cell_size), indexed by the 2D glyph ids above.
    """
    if cell_size < BITMAP_SIZE_2D + 1:
        raise ValueError(
            f"cell_size={cell_size} is too small for 2D glyphs; expected >= "
            f"{BITMAP_SIZE_2D + 1} (a {BITMAP_SIZE_2D}x{BITMAP_SIZE_2D} glyph and a 1-pixel gap)"
        )
    arrow_up = _bitmap(_BITMAPS_2D["arrow_up"])
    y_stem_up = np.rot90(_bitmap(_BITMAPS_2D["y_stem_down"]), 2)
    # np.rot90(x, -d) turns clockwise d times: up -> right -> down -> left.
    arrows = [np.rot90(arrow_up, -d) for d in range(4)]
    ys = [np.rot90(y_stem_up, -d) for d in range(4)]
    letters = [_bitmap(_BITMAPS_2D[letter]) for letter in LETTERS]
    return np.stack([_place(g, cell_size) for g in arrows + ys + letters])


def _orient_3d(pattern_DHW: np.ndarray, direction: int) -> np.ndarray:
    """Turns a pattern drawn along +depth so that it points along ``direction``."""
    axis, positive = direction // 2, direction % 2 == 1
    out = np.swapaxes(pattern_DHW, 0, axis)
    return out if positive else np.flip(out, axis=axis)


def _base_patterns_3d() -> dict[str, np.ndarray]:
    """4x4x4 {0, 255} patterns; arrow and Y are drawn pointing along +depth."""
    shaft = np.zeros((4, 4), bool)
    shaft[1:3, 1:3] = True
    arrow = np.stack([shaft, shaft, np.ones((4, 4), bool), shaft])
    arrow[2, [0, 0, 3, 3], [0, 3, 0, 3]] = False  # head plane without its corners
    prongs = np.zeros((4, 4), bool)
    prongs[[0, 3], 1:3] = True
    y_fork = np.stack([prongs, prongs, shaft, shaft])
    cube = np.zeros((4, 4, 4), bool)
    cube[1:3, 1:3, 1:3] = True
    corners = np.zeros((4, 4, 4), bool)
    corners[np.ix_([0, 3], [0, 3], [0, 3])] = True
    jack = cube.copy()
    jack[:, 1:3, 1:3] = jack[1:3, :, 1:3] = jack[1:3, 1:3, :] = True
    ring = np.zeros((4, 4, 4), bool)
    ring[1:3] = ~shaft
    plates = np.zeros((4, 4, 4), bool)
    plates[[0, 3]] = True
    shapes = {"arrow": arrow, "y": y_fork, "cube": cube, "corners": corners, "jack": jack}
    shapes.update(ring=ring, plates=plates)
    return {k: v.astype(np.uint8) * 255 for k, v in shapes.items()}


def glyph_bank_3d(cell_size: int) -> np.ndarray:
    """All 3D glyph templates for one cell size.

    Args:
      cell_size: cell side in voxels; at least 4.

    Returns:
      uint8 array (17, cell_size, cell_size, cell_size), indexed by the 3D glyph ids.
    """
    if cell_size < BITMAP_SIZE_3D:
        raise ValueError(
            f"cell_size={cell_size} is too small for 3D glyphs; expected >= {BITMAP_SIZE_3D}"
        )
    base = _base_patterns_3d()
    arrows = [_orient_3d(base["arrow"], d) for d in range(6)]
    ys = [_orient_3d(base["y"], d) for d in range(6)]
    shapes = [base[name] for name in SHAPES_3D]
    return np.stack([_place(g, cell_size) for g in arrows + ys + shapes])


def render_grid(glyphs_BG: np.ndarray, bank: np.ndarray) -> np.ndarray:
    """Renders layouts of glyph ids into images (2D) or volumes (3D), vectorised.

    Args:
      glyphs_BG: int array (B, G_1, ..., G_r) of glyph ids, -1 for an empty cell;
        r = 2 (rows, cols) or 3 (depth, rows, cols).
      bank: uint8 (num_glyphs, c, ..., c) templates of rank r.

    Returns:
      uint8 array (N, G_1 * c, ..., G_r * c): cell (i, j[, k]) holds its template.
    """
    rank = glyphs_BG.ndim - 1
    if bank.ndim != rank + 1:
        raise ValueError(f"bank rank {bank.ndim - 1} does not match layout rank {rank}")
    if glyphs_BG.min(initial=0) < -1 or glyphs_BG.max(initial=0) >= bank.shape[0]:
        raise ValueError(
            f"glyph ids must lie in [-1, {bank.shape[0]}), "
            f"got values in [{glyphs_BG.min()}, {glyphs_BG.max()}]"
        )
    padded = np.concatenate([np.zeros_like(bank[:1]), bank])
    cells = padded[glyphs_BG + 1]  # (B, G_1..G_r, c_1..c_r)
    # Interleave grid and in-cell axes: (N, G_1, c_1, ..., G_r, c_r).
    order = [0] + [a for i in range(rank) for a in (1 + i, 1 + rank + i)]
    out_shape = [glyphs_BG.shape[0]] + [g * bank.shape[1] for g in glyphs_BG.shape[1:]]
    return cells.transpose(order).reshape(out_shape)


def bilinear_weights(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) matrix of 1D bilinear resampling with half-pixel centres.

    Output pixel j samples input coordinate (j + 1/2) n_in / n_out - 1/2 (clamped to the
    edges), as ``jax.image.resize``/``tf.image.resize`` "bilinear" and PIL do when enlarging.
    Every row sums to 1.
    """
    src = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0.0, n_in - 1)
    lo = np.floor(src).astype(np.int64)
    hi = np.minimum(lo + 1, n_in - 1)
    frac = src - lo
    weights = np.zeros((n_out, n_in))
    np.add.at(weights, (np.arange(n_out), lo), 1.0 - frac)
    np.add.at(weights, (np.arange(n_out), hi), frac)
    return weights


def resize_bilinear(images_BHW: np.ndarray, out_hw: tuple[int, int]) -> np.ndarray:
    """Resizes uint8 images (N, H, W) to (N, *out_hw) bilinearly (half-pixel centres), rounded.

    The same scene at another resolution, as a camera with more pixels sees it: glyph edges
    become grey where they fall between the new pixels.
    """
    rows = bilinear_weights(images_BHW.shape[1], out_hw[0])
    cols = bilinear_weights(images_BHW.shape[2], out_hw[1])
    out = rows @ images_BHW.astype(np.float64) @ cols.T  # (i, h) @ (b, h, w) @ (w, j)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def check_layout_sizes(
    grid_shape: tuple[int, ...], num_distractor_arrows: int, num_letters: int, num_kinds: int
) -> None:
    """Raises ValueError unless a Y, its target and all distractors fit on the grid.

    Args:
      grid_shape: cells per axis, e.g. (G, G) or (D, G, G).
      num_distractor_arrows: arrows besides the target.
      num_letters: distinct distractor letters (or 3D shapes).
      num_kinds: how many distinct letters/shapes exist.
    """
    if min(grid_shape) < 2:
        raise ValueError(f"grid shape {grid_shape} needs >= 2 cells per axis (the Y's neighbour)")
    if not 0 <= num_letters <= num_kinds or num_distractor_arrows < 0:
        raise ValueError(
            f"num_letters={num_letters} must lie in [0, {num_kinds}] and "
            f"num_distractor_arrows={num_distractor_arrows} must be >= 0"
        )
    num_objects = 2 + num_distractor_arrows + num_letters
    if num_objects > np.prod(grid_shape):
        raise ValueError(f"{num_objects} objects do not fit on a grid of shape {grid_shape}")


def sample_layouts(
    rng: np.random.Generator,
    num_examples: int,
    *,
    grid_shape: tuple[int, ...],
    deltas: np.ndarray,
    num_distractor_arrows: int,
    letter_ids: np.ndarray,
    num_letters: int,
) -> dict[str, np.ndarray]:
    """Draws glyph layouts (no pixels) for a batch of examples, 2D or 3D.

    The Y (stem direction uniform) is uniform over the cells whose neighbour
    along the stem lies inside the grid; that neighbour holds the target arrow
    (direction uniform, the label); distractor arrows (random directions) and
    letters fill distinct random free cells; the letters are ``num_letters`` distinct ids
    drawn from ``letter_ids``. Arrow ids are 0..K-1 and Y ids K..2K-1 for K
    directions, as in both glyph banks.

    Args:
      rng: numpy generator; consumed in a fixed order.
      num_examples: B.
      grid_shape: cells per axis, (G, G) or (D, G, G).
      deltas: int (K, rank) cell step of each direction.
      num_distractor_arrows: arrows besides the target.
      letter_ids: ids of the candidate letters (3D shapes).
      num_letters: how many distinct candidates to place.

    Returns:
      dict with ``glyphs`` int8 (B, *grid_shape) glyph ids (-1 empty),
      ``y_cell`` int32 (B, rank), ``y_orientation`` int64 (B,) stem direction,
      ``target_cell`` int32 (B, rank), ``label`` int64 (B,) target direction.
    """
    n, shape, num_dirs = num_examples, np.array(grid_shape), len(deltas)
    rows = np.arange(n)
    strides = np.array([int(np.prod(shape[i + 1 :])) for i in range(len(shape))])
    stem = rng.integers(0, num_dirs, n)
    delta_BA = deltas[stem]
    low_BA, high_BA = np.maximum(0, -delta_BA), shape - np.maximum(0, delta_BA)
    y_cell = (low_BA + np.floor(rng.random(delta_BA.shape) * (high_BA - low_BA))).astype(np.int32)
    target_cell = (y_cell + delta_BA).astype(np.int32)
    label = rng.integers(0, num_dirs, n)
    y_flat, target_flat = y_cell @ strides, target_cell @ strides
    keys = rng.random((n, int(shape.prod())))
    keys[rows, y_flat] = keys[rows, target_flat] = 2.0  # sorted last: never reused
    free_cells = np.argsort(keys, axis=1)[:, : num_distractor_arrows + num_letters]
    arrows = rng.integers(0, num_dirs, (n, num_distractor_arrows))
    order = np.argsort(rng.random((n, len(letter_ids))), axis=1)[:, :num_letters]
    letters = np.asarray(letter_ids)[order]
    flat = np.full((n, int(shape.prod())), -1, dtype=np.int8)
    flat[rows[:, None], free_cells] = np.concatenate([arrows, letters], axis=1)
    flat[rows, y_flat] = num_dirs + stem
    flat[rows, target_flat] = label
    return {
        "glyphs": flat.reshape(n, *grid_shape),
        "y_cell": y_cell,
        "y_orientation": stem,
        "target_cell": target_cell,
        "label": label,
    }


def cell_block(image: np.ndarray, cell: np.ndarray, cell_size: int) -> np.ndarray:
    """The pixels of one grid cell.

    Args:
      image: uint8 (G_1 c, ..., G_r c) image or volume (a trailing channel axis is allowed).
      cell: int (r,) cell index.
      cell_size: c.

    Returns:
      The (c, ..., c[, channels]) block of ``image`` at ``cell``.
    """
    return image[tuple(slice(i * cell_size, (i + 1) * cell_size) for i in cell)]


def png_bytes(image_HW1: np.ndarray) -> bytes:
    """Lossless PNG file of a uint8 (H, W, 1) image: 8-bit grayscale, no filter, zlib level 6.

    Written directly (signature, IHDR, one IDAT, IEND; PNG spec, ISO/IEC 15948): faster and
    smaller than PIL's encoder on 64 x 64 glyph images, since PIL's per-image setup costs more
    than compressing 4 KiB (benchmarks README, section 14).

    Args:
      image_HW1: uint8 (H, W, 1).

    Returns:
      The PNG file's bytes; decoding gives back ``image_HW1`` exactly.
    """
    if image_HW1.dtype != np.uint8 or image_HW1.ndim != 3 or image_HW1.shape[-1] != 1:
        raise ValueError(f"expected uint8 (H, W, 1), got {image_HW1.dtype} {image_HW1.shape}")
    height, width = image_HW1.shape[:2]
    rows = np.concatenate([np.zeros((height, 1), np.uint8), image_HW1[..., 0]], axis=1)  # filter 0

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit gray, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
        + chunk(b"IEND", b"")
    )
