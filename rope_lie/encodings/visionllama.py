"""VisionLlama AS2DRoPE (Chu et al., "VisionLLaMA", arXiv:2403.00522): axial RoPE, alternating axes.

The F = H/2 channel pairs of a head alternate between the A position axes: pair j belongs to
axis j mod A and is rotated by

    theta_j(p) = p_{j mod A} * base^(-2A*floor(j/A)/H),    base = 10000,

so in 2D the pairs go (row, col, row, col, ...) with frequencies 1, 1, base^(-4/H),
base^(-4/H), ... Every pair sees a single axis, so <R(p) q, R(p') k> depends on p' - p only.
VisionLLaMA's code puts x (the column) first, (col, row, ...): the same encoding with the two
axes swapped, which a converted model's positions must follow.
For A = 1 this is ``rope``.

Auto-scaling (the "AS" of AS2DRoPE: positions times anchor/current grid size, so that a larger
image covers the anchor's range of positions) is a positions convention, not part of this
module: build positions with ``positions.grid_positions(grid, convention="autoscale",
anchor_grid=...)``. It scales each axis by its own ratio; VisionLLaMA's code scales both by the
height's, which differs on non-square grids only (``positions``' docstring).

Conventions: interleaved pairs (2j, 2j+1), (a, b) -> (a cos t - b sin t, a sin t + b cos t);
axis order = array order of the input ((row, col) for images, (depth/time, row, col) for
volumes); R(p) multiplies q and k from the left (never v); prefix (class) tokens sit at position
0 and get R(0) = I. Angles in float32, output in x's dtype. No parameters: ``init`` returns
``{}``; the number of axes is read from ``pos`` in ``apply``.

``variant="liere"``: the baseline the LieRE paper (arXiv:2406.10322) calls "VisionLlama", as
its reference code builds it (github.com/StanfordMIMI/LieRE, ``models/rope_vit.py``,
``TiledPositionEncoder`` with ``phase_type="inverse_exp"``). It is a different encoding from
VisionLLaMA's own: with P = H // A // 2 phases

    phase_p = exp(-4 * p / (P - 1)),    p = 0, ..., P - 1    (``exp(-4 * linspace(0, 1, P))``),

pairs are laid out axis-major: pair ``a * P + p`` is rotated by ``pos_a * phase_p``, the same
for every head; the H - 2 A P leftover channels (when 2A does not divide H) are not rotated.
Its positions are LieRE's ``"sequential"`` ones ([0, 1] at the training grid), and the
rotation (a, b) -> (a cos t - b sin t, a sin t + b cos t) is the reference's
``matrix_exp(t [[0, -1], [1, 0]])``, the same as here. Where we differ: nothing in the
maths; the reference builds the 2x2 rotations with ``torch.matrix_exp`` and multiplies, we use
cos/sin of the same angles.
"""

from __future__ import annotations

import jax
import numpy as np

from rope_lie.encodings import _checks, family, fixed_frequency, state

VARIANTS = ("visionllama", "liere")

_FAMILY = "visionllama"
FAMILY = family.Family(
    name=_FAMILY,
    kind="rotary",
    convention="autoscale",
    relative=True,
    apply_defaults={"base": 10000.0, "variant": "visionllama", "rotary_fraction": 1.0},
    stored_count=lambda num_heads, head_dim, num_axes, settings: 0,
    examples=(({}, (1, 2, 3)), ({"rotary_fraction": 0.5}, (2,)), ({"variant": "liere"}, (2,))),
    # The LieRE paper's "VisionLlama" baseline (its reference code), not VisionLLaMA's AS2DRoPE.
    variants={"visionllama_liere": ({"variant": "liere"}, "sequential")},
    pair_spectrum=lambda head_dim, num_axes, s: (
        liere_pair_frequencies if s["variant"] == "liere" else pair_frequencies
    )(head_dim, num_axes, s["base"]),
)
APPLY_HPARAMS: tuple[str, ...] = tuple(FAMILY.apply_defaults)


def pair_frequencies(head_dim: int, num_axes: int, base: float = 10000.0):
    """The axis and frequency of every pair.

    Args:
      head_dim: H, divisible by 2 * num_axes.
      num_axes: A.
      base: frequency base.

    Returns:
      (axis_F, freq_F): int (F,) axis j mod A of pair j and float64 (F,) its frequency
      base^(-2A*floor(j/A)/H), F = H/2.
    """
    j = np.arange(head_dim // 2)
    return j % num_axes, base ** (-2.0 * num_axes * (j // num_axes) / head_dim)


def liere_pair_frequencies(head_dim: int, num_axes: int, base: float | None = None):
    """Axis and frequency of every pair of the LieRE paper's "VisionLlama" (``variant="liere"``).

    Args:
      head_dim: H, even.
      num_axes: A.
      base: unused (the LieRE code's phases have no base; kept for the common table signature).

    Returns:
      (axis_F, freq_F): pair ``a * P + p`` (P = H // A // 2) has axis a and frequency
      exp(-4 p / (P - 1)) (1 when P = 1); the leftover pairs have frequency 0 (not rotated).
    """
    del base
    num_phases = head_dim // num_axes // 2
    phases = np.exp(-4.0 * np.linspace(0.0, 1.0, num_phases))
    axis_F = np.zeros(head_dim // 2, np.int64)
    freq_F = np.zeros(head_dim // 2)
    axis_F[: num_axes * num_phases] = np.repeat(np.arange(num_axes), num_phases)
    freq_F[: num_axes * num_phases] = np.tile(phases, num_axes)
    return axis_F, freq_F


def _check_variant(variant) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"{_FAMILY}: variant={variant!r}; expected one of {VARIANTS}")
    return variant


def _dims_check(variant: str):
    """The (head_dim, num_axes) check of a variant, for ``fixed_frequency``."""

    def check(head_dim: int, num_axes: int) -> None:
        if variant == "visionllama":
            _checks.check_divisible(head_dim, 2 * num_axes, "2*num_axes", _FAMILY)
            return
        _checks.check_divisible(head_dim, 2, "2", _FAMILY)
        if head_dim < 2 * num_axes:
            raise ValueError(
                f"{_FAMILY}: head_dim={head_dim} leaves no pair for some of the "
                f"num_axes={num_axes} axes (variant='liere' needs head_dim >= "
                f"2*num_axes={2 * num_axes})"
            )

    return check


def init(
    key: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_axes: int,
    base: float = 10000.0,
    variant: str = "visionllama",
    rotary_fraction: float = 1.0,
) -> dict[str, jax.Array]:
    """Validate the configuration; neither variant has parameters.

    Args:
      key: unused (kept for the common ``init`` signature).
      num_heads: number of heads N.
      head_dim: head dimension H, divisible by 2 * num_axes (``variant="liere"``: even, and
        at least 2 * num_axes).
      num_axes: number of position axes A.
      base: frequency base (10000 in VisionLlama; unused by ``variant="liere"``).
      variant: ``"visionllama"`` (VisionLLaMA's AS2DRoPE) or ``"liere"`` (the LieRE paper's
        baseline, see the module docstring).
      rotary_fraction: p-RoPE's fraction of pairs rotated per axis, the highest frequencies
        (``fixed_frequency``); 1 = all.

    Returns:
      ``{}``.
    """
    del key
    check_dims = _dims_check(_check_variant(variant))
    fixed_frequency.init(
        _FAMILY,
        check_dims,
        num_heads=num_heads,
        head_dim=head_dim,
        num_axes=num_axes,
        base=base,
        rotary_fraction=rotary_fraction,
    )
    return family.params(
        _FAMILY,
        {},
        num_heads=num_heads,
        head_dim=head_dim,
        num_axes=num_axes,
        base=base,
        variant=variant,
        rotary_fraction=rotary_fraction,
    )


def apply(
    params: dict[str, jax.Array],
    x_BTNH: jax.Array,
    pos: jax.Array,
    *,
    base: float = family.INIT,
    variant: str = family.INIT,
    rotary_fraction: float = family.INIT,
) -> jax.Array:
    """Rotate queries or keys by R(p).

    Args:
      params: ``{}`` (from ``init``).
      x_BTNH: queries or keys (B, T, N, H), any float dtype, H divisible by 2A.
      pos: positions ``pos_TA`` shared by the batch, or ``pos_BTA`` per example (already
        auto-scaled if wanted, see the module docstring).
      base, variant, rotary_fraction: ``init``'s (read from its parameters; a plain ``{}``:
        these arguments, else ``init``'s defaults).

    Returns:
      (B, T, N, H) array in x's dtype.
    """
    s = family.bound(params, _FAMILY, base=base, variant=variant, rotary_fraction=rotary_fraction)
    variant = _check_variant(s["variant"])
    table = liere_pair_frequencies if variant == "liere" else pair_frequencies
    return fixed_frequency.apply(
        _FAMILY,
        _dims_check(variant),
        table,
        params,
        x_BTNH,
        pos,
        base=s["base"],
        rotary_fraction=s["rotary_fraction"],
    )


def precompute(
    params: dict[str, jax.Array],
    pos: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_prefix: int = 0,
    base: float = family.INIT,
    variant: str = family.INIT,
    rotary_fraction: float = family.INIT,
) -> state.PairAngles:
    """The rotation angles of every token (the encoder state, ``encodings/state.py``).

    Args:
      params: ``{}`` (from ``init``).
      pos: positions ``pos_TA`` or ``pos_BTA``.
      num_heads: N (the angles are the same for every head).
      head_dim: H.
      num_prefix: prefix tokens (at position 0, not rotated).
      base, variant, rotary_fraction: ``init``'s (read from its parameters; a plain ``{}``:
        these arguments, else ``init``'s defaults).

    Returns:
      ``PairAngles`` of shape (T, 1, H/2), or (B, T, 1, H/2) per example; float32 (pairs with
      frequency 0, the leftover channels of ``variant="liere"``, turn by 0).
    """
    s = family.bound(params, _FAMILY, base=base, variant=variant, rotary_fraction=rotary_fraction)
    variant = _check_variant(s["variant"])
    table = liere_pair_frequencies if variant == "liere" else pair_frequencies
    return fixed_frequency.precompute(
        _FAMILY,
        _dims_check(variant),
        table,
        params,
        pos,
        num_heads=num_heads,
        head_dim=head_dim,
        num_prefix=num_prefix,
        base=s["base"],
        rotary_fraction=s["rotary_fraction"],
    )
