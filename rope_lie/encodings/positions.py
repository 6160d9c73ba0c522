"""Token positions ``pos_TA`` for grids of rank 1-3 under named conventions.

Tokens are ordered row-major over the grid (the array order of the input: (row, col) for
images, (time/depth, row, col) for volumes), after ``num_prefix`` prefix (class/register) tokens.
Prefix tokens get position 0 on every axis, so rotary families give them R(0): the identity for
RoPE and LieRE, P for Cayley-STRING. Bias and absolute families treat them separately
(``num_prefix`` argument).

Conventions (``convention=``), per axis of length n:

- ``"integer"``: patch indices 0, 1, ..., n - 1 (rope-vit, RoFormer).
- ``"sequential"``: linspace(0, n / n_train, n), i.e. [0, 1] at the training grid and a range
  that grows with the image (LieRE's reference; evaluating at a larger image extrapolates).
- ``"normalized"``: linspace(lo, hi, n) over a fixed ``value_range`` (default [-1, 1]) at every
  resolution (interpolation).
- ``"autoscale"``: integer * n_anchor / n per axis (VisionLlama's AS2DRoPE): the anchor grid's
  range at every resolution. VisionLLaMA's code scales both axes by one factor, the height's
  (``base_size / H``, github.com/Meituan-AutoML/VisionLLaMA, ``deit/my_models.py``): the same
  on square grids, the only ones its models see; on others we keep each axis at the anchor's
  range, where one factor would keep the spacing equal on both axes.
- ``"centred"``: pixel centres 2 (i + 0.5) / n - 1 in (-1, 1) at every resolution (DINOv3's
  ``normalize_coords="separate"``); ``"centred_max"`` / ``"centred_min"`` divide by the longest /
  shortest axis of the grid instead of n (DINOv3's ``"max"`` / ``"min"``: 2 (i + 0.5) / max(n)
  - 1, which is not centred on a non-square grid). Prefix tokens at 0 are at the image centre.
- ``"unit_centred"``: (i + 0.5) / n - 1/2 in (-1/2, 1/2): ComRoPE's reference positions
  (i + 0.5) / n with the class token at 1/2, all shifted by -1/2 so that the class token is at
  our prefix position 0 (a common shift that relative encodings cannot see).
- ``"diagonal"``: VideoRoPE's Diagonal Layout (below), for (t, h, w) grids.

VideoRoPE's Diagonal Layout (Wei et al., "VideoRoPE: What Makes for Good Video Rotary Position
Embedding?", ICML 2025, arXiv:2502.05173; github.com/Wiselnn570/VideoRoPE,
``videorope-transformer/modeling_videorope.py``,
``Qwen2VLForConditionalGeneration.get_t_scale_rope_index``, its "body-diagonal symmetry"):
the integer indices (t, h, w) of a (T, H, W) grid become

    (delta t,  delta t + h - floor((H - 1) / 2),  delta t + w - floor((W - 1) / 2)),

each frame's spatial indices centred (by the reference's integer ``(n - 1) // 2``) and moved
along the diagonal with its time index, so that frames advance along (1, 1, 1);
``temporal_spacing`` = delta is the reference's ``scale_factor`` (its adjustable temporal
spacing; the paper uses 2). Any rank: axis 0 is time and the other axes are centred and moved
with it (rank 1: delta t). Where we differ: the reference starts the video at the position after
its preceding text, o = ``text_len + st_idx``, adding o to all three axes; ours start at o = 0,
so the prefix tokens at 0 sit at the centre of frame 0 (the reference's preceding text token
sits one diagonal step earlier, at o - 1). A common shift of every patch token is invisible to
the relative encodings among the patches; it only places the prefix tokens. With this
convention delta lives in the positions: keep ``rope_axial``'s ``temporal_scale`` at 1 (it scales
the time pairs only, not the spatial shift, and would apply delta twice).

Evaluating at a new resolution is a change of positions only: pass the new ``grid_shape`` and
the training grid as ``train_grid`` (sequential) or ``anchor_grid`` (autoscale).

``augment`` draws DINOv3's train-time coordinate augmentations (shift, jitter, rescale) from an
explicit key; prefix tokens stay at 0. ``randomize`` draws RPE-2D's randomized positions (a
sorted random subset of a larger grid's positions per axis) in training, so that a larger grid
at evaluation sees positions the model has seen.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rope_lie.encodings import _checks

CONVENTIONS = (
    "integer",
    "sequential",
    "normalized",
    "autoscale",
    "centred",
    "centred_max",
    "centred_min",
    "unit_centred",
    "diagonal",
)
# The keyword arguments each convention takes beyond the grids (``grid_positions``).
CONVENTION_HPARAMS = {"normalized": ("value_range",), "diagonal": ("temporal_spacing",)}


_GRID_EXPECTED = (
    "1 to 3 positive integers (a tuple of ints, or a concrete 1-D integer numpy or JAX array)"
)


def _grid_int(n, name: str, grid) -> int:
    """One entry of a grid as a Python int; anything but a positive integer is an error."""
    if isinstance(n, jax.core.Tracer):
        raise ValueError(
            f"{name}={grid!r} holds a traced value {n!r}: a grid is static (it sets the token "
            f"count); pass {_GRID_EXPECTED} from outside jit"
        )
    dtype = getattr(n, "dtype", None)  # numpy / JAX scalars and 0-d arrays
    if dtype is not None and np.ndim(n) == 0:
        shown = f"{n.item()!r} ({dtype})"
        is_int = dtype.kind in ("i", "u")
    else:
        shown, is_int = repr(n), isinstance(n, int) and not isinstance(n, bool)
    if isinstance(n, bool) or (dtype is not None and dtype.kind == "b"):
        raise ValueError(f"{name}={grid!r} holds the boolean {shown}; expected {_GRID_EXPECTED}")
    if not is_int:
        raise ValueError(f"{name}={grid!r} holds {shown}; expected {_GRID_EXPECTED}")
    if int(n) < 1:
        raise ValueError(f"{name}={grid!r} holds {int(n)}; expected {_GRID_EXPECTED}")
    return int(n)


def _check_grid(grid, name: str) -> tuple[int, ...]:
    """``grid`` (tokens per axis) as a tuple of Python ints, checked.

    A tuple or list of ints (numpy and JAX integer scalars too) or a concrete 1-D integer array
    is a grid; floats (even 4.0), booleans, values < 1, traced values and ranks other than 1-3
    are errors naming the value.
    """
    if isinstance(grid, jax.core.Tracer):
        raise ValueError(
            f"{name}={grid!r} is a traced value: a grid is static (it sets the token count); "
            f"pass {_GRID_EXPECTED} from outside jit"
        )
    if isinstance(grid, (np.ndarray, jax.Array)):
        if grid.ndim != 1:
            raise ValueError(f"{name}={grid!r} has {grid.ndim} dims; expected {_GRID_EXPECTED}")
        entries = list(np.asarray(grid))  # numpy scalars of the array's dtype
    elif isinstance(grid, (str, bytes)) or not hasattr(grid, "__iter__"):
        raise ValueError(f"{name}={grid!r} is not a sequence; expected {_GRID_EXPECTED}")
    else:
        entries = list(grid)
    out = tuple(_grid_int(n, name, grid) for n in entries)
    if not 1 <= len(out) <= 3:
        raise ValueError(f"{name}={out} must have rank 1, 2 or 3 (sequence, image, volume)")
    return out


def _axis_coords(
    n: int, convention: str, n_ref: int, value_range: tuple[float, float], grid: tuple[int, ...]
) -> np.ndarray:
    if convention.startswith("centred"):
        size = {"centred": n, "centred_max": max(grid), "centred_min": min(grid)}[convention]
        return 2.0 * (np.arange(n) + 0.5) / size - 1.0
    if convention == "unit_centred":
        return (np.arange(n) + 0.5) / n - 0.5
    if convention in ("integer", "diagonal"):  # the diagonal's shear follows (``_diagonal``)
        return np.arange(n, dtype=np.float64)
    if convention == "sequential":
        return np.linspace(0.0, n / n_ref, n)
    if convention == "normalized":
        return np.linspace(value_range[0], value_range[1], n)
    return np.arange(n, dtype=np.float64) * (n_ref / n)  # autoscale


def _check_convention(convention: str) -> None:
    if convention not in CONVENTIONS:
        raise ValueError(
            f"unknown position convention {convention!r}; expected one of {CONVENTIONS}"
        )


def check_temporal_spacing(temporal_spacing, convention: str) -> float:
    """delta: a positive finite number, and 1 (the default) unless the convention is diagonal."""
    spacing = _checks.check_real(temporal_spacing, "temporal_spacing", "positions", positive=True)
    if spacing != 1.0 and convention != "diagonal":
        raise ValueError(
            f"positions: temporal_spacing={temporal_spacing!r} is the 'diagonal' convention's; "
            f"got convention={convention!r} (rope_axial's temporal_scale scales time there)"
        )
    return spacing


def check_hparams(convention: str, hparams) -> dict:
    """``hparams`` (a model's ``position_hparams``) as a dict of the keyword arguments that
    ``convention`` takes (``CONVENTION_HPARAMS``); any other key is an error naming it."""
    _check_convention(convention)
    hparams = dict(hparams or {})
    allowed = CONVENTION_HPARAMS.get(convention, ())
    unknown = sorted(set(hparams) - set(allowed))
    if unknown:
        raise ValueError(
            f"position_hparams has {unknown}, which convention {convention!r} does not take; "
            f"it takes {list(allowed)}"
        )
    return hparams


def _diagonal(index_XTA, grid_XA, spacing: float, xp):
    """VideoRoPE's Diagonal Layout of integer indices (module docstring), in ``xp`` (numpy or
    jax.numpy): axis 0 times delta, the others centred by floor((n - 1) / 2) and moved by it."""
    time_XT1 = spacing * index_XTA[..., :1]
    centre_XA = xp.floor((grid_XA[..., 1:] - 1) / 2)
    return xp.concatenate([time_XT1, index_XTA[..., 1:] - centre_XA + time_XT1], axis=-1)


def grid_positions(
    grid_shape: Sequence[int],
    convention: str = "integer",
    *,
    num_prefix: int = 0,
    train_grid: Sequence[int] | None = None,
    anchor_grid: Sequence[int] | None = None,
    value_range: tuple[float, float] = (-1.0, 1.0),
    temporal_spacing: float = 1.0,
) -> jnp.ndarray:
    """Positions of the tokens of a grid, prefix tokens first.

    Args:
      grid_shape: tokens per axis, rank 1-3, e.g. (8, 8) for an 8x8 patch grid.
      convention: one of ``CONVENTIONS`` (see the module docstring).
      num_prefix: number of prefix tokens (class token etc.), placed first at position 0.
      train_grid: the training grid for ``"sequential"``; None means grid_shape is the training
        grid.
      anchor_grid: the anchor grid for ``"autoscale"``; None means grid_shape is the anchor.
      value_range: (lo, hi) for ``"normalized"``.
      temporal_spacing: delta of ``"diagonal"`` (1 for every other convention).

    Returns:
      float32 array (num_prefix + prod(grid_shape), len(grid_shape)).
    """
    grid = _check_grid(grid_shape, "grid_shape")
    _check_convention(convention)
    spacing = check_temporal_spacing(temporal_spacing, convention)
    _checks.check_nonnegative_int(num_prefix, "num_prefix", None)
    ref = train_grid if convention == "sequential" else anchor_grid
    ref = grid if ref is None else _check_grid(ref, "train_grid/anchor_grid")
    if len(ref) != len(grid):
        raise ValueError(
            f"reference grid {ref} has rank {len(ref)} but grid_shape={grid} has rank {len(grid)}"
        )
    if convention == "normalized" and not value_range[0] < value_range[1]:
        raise ValueError(f"value_range={value_range} must be (lo, hi) with lo < hi")
    axes = [
        _axis_coords(n, convention, r, value_range, grid) for n, r in zip(grid, ref, strict=True)
    ]
    mesh = np.meshgrid(*axes, indexing="ij")
    pos_TA = np.stack([m.reshape(-1) for m in mesh], axis=-1)
    if convention == "diagonal":
        pos_TA = _diagonal(pos_TA, np.asarray(grid, np.float64), spacing, np)
    pos_TA = np.concatenate([np.zeros((num_prefix, len(grid))), pos_TA], axis=0)
    return jnp.asarray(pos_TA, jnp.float32)


def _check_augment(name: str, value, lowest: float) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and value >= lowest):
        raise ValueError(f"{name}={value!r} must be None or a number >= {lowest}")


def check_augment(shift=None, jitter=None, rescale=None, randomize=None) -> None:
    """``augment``'s bounds: shift >= 0, jitter and rescale >= 1, or None (step skipped); and
    ``randomize``'s (RPE-2D's scale): >= 1, or None."""
    _check_augment("shift", shift, 0.0)
    _check_augment("jitter", jitter, 1.0)
    _check_augment("rescale", rescale, 1.0)
    _check_augment("randomize", randomize, 1.0)


def randomized_grid(grid_shape: Sequence[int], scale: float) -> tuple[int, ...]:
    """RPE-2D's larger grid: round(scale * n) positions per axis (at least n)."""
    grid = _check_grid(grid_shape, "grid_shape")
    _check_augment("randomize", scale, 1.0)
    return tuple(max(n, int(round(scale * n))) for n in grid)


def randomize(
    key: jax.Array,
    grid_shape: Sequence[int],
    convention: str = "integer",
    *,
    scale: float,
    num_prefix: int = 0,
    train_grid: Sequence[int] | None = None,
    anchor_grid: Sequence[int] | None = None,
    value_range: tuple[float, float] = (-1.0, 1.0),
    temporal_spacing: float = 1.0,
) -> jax.Array:
    """Randomized positions in training: RPE-2D (Liu et al., "Boosting Resolution
    Generalization of Diffusion Transformers with Randomized Positional Encodings",
    arXiv:2503.18719), the 2D form of Ruoss et al.'s randomized positional encodings
    (arXiv:2305.16843).

    What is implemented (written from the papers' descriptions, not from their code): on every
    axis a of the n_a-token grid, independently, n_a distinct indices are drawn uniformly from
    the L_a = round(scale n_a) indices of a larger grid and sorted (Ruoss et al.'s ordered
    subsample, per axis as RPE-2D does for rows and columns), and each token (i, j) gets the
    position that ``convention`` gives index (r_i, c_j) in the larger grid
    (``index_positions``; integer positions: (r_i, c_j) themselves). Tokens keep their order
    and their row and column structure; the gaps between them vary. At evaluation the model
    takes its usual positions: a grid up to L_a tokens long then has positions it saw in
    training. One draw for the whole batch (as ``augment``; Ruoss et al. draw per sequence).
    Prefix tokens stay at 0. Where this differs from the reference: Ruoss et al.'s code
    (google-deepmind/randomized_positional_encodings) draws the positions at evaluation as
    well, so a grid shorter than L_a is still read with gaps of about L_a / n_a; on the usual
    positions (gaps of 1) RPE-2D's Fashion-MNIST models score 4.8-8.9 points lower at the
    training size than on the reference's draws (``experiments/studies/rpe_positions.py``).

    Args:
      key: PRNG key; axis a draws from its a-th split.
      grid_shape: the token grid, rank 1-3.
      convention: one of ``CONVENTIONS``, applied at the larger grid.
      scale: L_a / n_a >= 1 (1: every index drawn, the usual positions).
      num_prefix: prefix tokens, first, at position 0.
      train_grid, anchor_grid, value_range, temporal_spacing: as ``index_positions``.

    Returns:
      float32 (num_prefix + prod(grid), A).
    """
    grid = _check_grid(grid_shape, "grid_shape")
    wide = randomized_grid(grid, scale)
    keys = jax.random.split(key, len(grid))
    axes = [
        jnp.sort(jax.random.choice(k, size, (n,), replace=False))
        for k, n, size in zip(keys, grid, wide, strict=True)
    ]
    mesh = jnp.meshgrid(*axes, indexing="ij")
    index_TA = jnp.stack([m.reshape(-1) for m in mesh], axis=-1)
    pos_TA = index_positions(
        index_TA,
        jnp.asarray(wide),
        convention,
        train_grid=train_grid,
        anchor_grid=anchor_grid,
        value_range=value_range,
        temporal_spacing=temporal_spacing,
    )
    return jnp.concatenate([jnp.zeros((num_prefix, len(grid)), jnp.float32), pos_TA], axis=0)


def augment(
    key: jax.Array,
    pos: jax.Array,
    *,
    num_prefix: int,
    shift: float | None = None,
    jitter: float | None = None,
    rescale: float | None = None,
    batch_size: int | None = None,
) -> jax.Array:
    """DINOv3's coordinate augmentations (``RopePositionEmbedding.forward`` in training).

    In the reference's order: add a shift u_a ~ U[-shift, shift] per axis; multiply axis a by
    exp(U[-log jitter, log jitter]); multiply every axis by one exp(U[-log rescale,
    log rescale]). None (the default) skips a step, so all None returns ``pos`` unchanged. Prefix
    tokens keep their positions (0: unrotated, as the reference leaves them).

    Args:
      key: PRNG key; the three draws use its three splits.
      pos: ``pos_TA`` (e.g. ``grid_positions(grid, "centred", num_prefix=...)``).
      num_prefix: prefix tokens at the start of ``pos``, not moved.
      shift: half-width of the uniform shift (the reference's ``shift_coords``).
      jitter: per-axis log-uniform factor bound, >= 1 (``jitter_coords``).
      rescale: common log-uniform factor bound, >= 1 (``rescale_coords``).
      batch_size: None: one draw for the whole batch, as the reference (returns (T, A));
        B: one draw per example (returns ``pos_BTA``).

    Returns:
      float32 positions, (T, A) or (B, T, A).
    """
    check_augment(shift, jitter, rescale)
    pos = jnp.asarray(pos, jnp.float32)
    if pos.ndim != 2:
        raise ValueError(f"augment: pos must be (T, A), got shape {tuple(pos.shape)}")
    if isinstance(num_prefix, bool) or not isinstance(num_prefix, int) or num_prefix < 0:
        raise ValueError(f"augment: num_prefix={num_prefix!r} must be a non-negative integer")
    lead = () if batch_size is None else (int(batch_size),)
    num_axes = pos.shape[-1]
    key_shift, key_jitter, key_rescale = jax.random.split(key, 3)
    out = jnp.broadcast_to(pos, (*lead, *pos.shape))
    if shift is not None:
        u = jax.random.uniform(key_shift, (*lead, 1, num_axes), minval=-shift, maxval=shift)
        out = out + u
    if jitter is not None:
        bound = float(np.log(jitter))
        out = out * jnp.exp(
            jax.random.uniform(key_jitter, (*lead, 1, num_axes), minval=-bound, maxval=bound)
        )
    if rescale is not None:
        bound = float(np.log(rescale))
        out = out * jnp.exp(
            jax.random.uniform(key_rescale, (*lead, 1, 1), minval=-bound, maxval=bound)
        )
    is_prefix = (jnp.arange(pos.shape[0]) < num_prefix)[:, None]
    return jnp.where(is_prefix, pos, out)


def grid_indices(grid_shape: Sequence[int]) -> np.ndarray:
    """Integer grid coordinates of every token of a grid, row-major: int32 (prod(grid), A)."""
    grid = _check_grid(grid_shape, "grid_shape")
    mesh = np.meshgrid(*[np.arange(n) for n in grid], indexing="ij")
    return np.stack([m.reshape(-1) for m in mesh], axis=-1).astype(np.int32)


def index_positions(
    index_XTA: jnp.ndarray,
    grid_XA: jnp.ndarray,
    convention: str = "integer",
    *,
    train_grid: Sequence[int] | None = None,
    anchor_grid: Sequence[int] | None = None,
    value_range: tuple[float, float] = (-1.0, 1.0),
    temporal_spacing: float = 1.0,
) -> jnp.ndarray:
    """Positions of tokens given by their grid coordinates, each in its own example's grid.

    The traceable form of ``grid_positions`` for batches whose examples have different grids
    (and for a subset of a grid's tokens, as patch dropout keeps): token t of example b at
    integer coordinates ``index[b, t]`` of the grid ``grid[b]`` gets the position that
    ``grid_positions(grid[b], convention, ...)`` gives it. No prefix rows.

    Args:
      index_XTA: integer coordinates (..., T, A), each in [0, grid).
      grid_XA: tokens per axis of each example's grid (..., A), broadcast against the tokens.
      convention: one of ``CONVENTIONS``.
      train_grid: the training grid for ``"sequential"`` (required for it).
      anchor_grid: the anchor grid for ``"autoscale"`` (required for it).
      value_range: (lo, hi) for ``"normalized"``.
      temporal_spacing: delta of ``"diagonal"`` (1 for every other convention).

    Returns:
      float32 (..., T, A).
    """
    _check_convention(convention)
    spacing = check_temporal_spacing(temporal_spacing, convention)
    _checks.check_index(index_XTA, "index_positions")
    index = jnp.asarray(index_XTA, jnp.float32)
    n = jnp.asarray(grid_XA, jnp.float32)[..., None, :]
    if convention == "integer":
        return index
    if convention == "diagonal":
        return _diagonal(index, n, spacing, jnp)
    if convention == "normalized":
        lo, hi = value_range
        if not lo < hi:
            raise ValueError(f"value_range={value_range} must be (lo, hi) with lo < hi")
        # linspace(lo, hi, n)[i]; a single token sits at lo.
        return lo + (hi - lo) * index / jnp.maximum(n - 1, 1)
    if convention.startswith("centred"):
        reduce = {"centred": None, "centred_max": jnp.max, "centred_min": jnp.min}[convention]
        size = n if reduce is None else reduce(n, axis=-1, keepdims=True)
        return 2.0 * (index + 0.5) / size - 1.0
    if convention == "unit_centred":
        return (index + 0.5) / n - 0.5
    ref = train_grid if convention == "sequential" else anchor_grid
    if ref is None:
        raise ValueError(f"convention={convention!r} needs its reference grid (train/anchor)")
    ref = jnp.asarray(_check_grid(ref, "train_grid/anchor_grid"), jnp.float32)
    if ref.shape[0] != index.shape[-1]:
        raise ValueError(f"reference grid has rank {ref.shape[0]}, positions {index.shape[-1]}")
    ref = ref.reshape((1,) * (n.ndim - 1) + ref.shape)  # broadcast against n, written out
    if convention == "sequential":  # linspace(0, n / n_ref, n)[i]
        return index * (n / ref) / jnp.maximum(n - 1, 1)
    return index * (ref / n)  # autoscale
