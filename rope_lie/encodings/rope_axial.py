"""RoPE-Axial (Heo et al., "Rotary Position Embedding for Vision Transformer", arXiv:2403.13298).

Axial RoPE for A position axes: the F = H/2 channel pairs of a head are split into A contiguous
groups of F/A pairs, and axis a rotates its own group with 1D RoPE frequencies:

    pair a*F/A + i:   theta(p) = p_a * base^(-2A*i/H),    i = 0, ..., F/A - 1,    base = 100

(for A = 2 this is base^(-4i/H), the rope-vit reference's ``compute_axial_cis`` with
theta = 100). Every pair sees a single axis, so
<R(p) q, R(p') k> depends on p' - p only. For A = 1 this is ``rope`` with the same base.

Axis order: axis 0 of ``pos`` (the row of an image, array order) gets the first F/A pairs. The
rope-vit reference gives the first half to x (the column); the two agree up to swapping the
position axes, i.e. ours at (row, col) = reference at (t_x=row, t_y=col).

Conventions: interleaved pairs (2j, 2j+1), (a, b) -> (a cos t - b sin t, a sin t + b cos t);
contiguous groups per axis; R(p) multiplies q and k from the left (never v); prefix (class)
tokens sit at position 0 and get R(0) = I. Angles in float32, output in x's dtype. No
parameters: ``init`` returns ``{}``; the number of axes is read from ``pos`` in ``apply``.
Validation and rotation are ``fixed_frequency``'s; this module holds the frequency table.

Axis layouts (``layout``), for video (t, h, w) above all; the first is the default and the
others share one RoFormer spectrum f_j = base^(-2j/H), j < F, among the axes (``sections``
(s_0, ..., s_(A-1)) pairs per axis, summing to F):

- ``"axial"``: the above, each axis its own compressed spectrum (``sections`` unused).
- ``"mrope"``: contiguous sections, pairs [s_0 + ... + s_(a-1), ... + s_a) to axis a: Qwen2-VL's
  M-RoPE (``mrope_section``, (16, 24, 24) of 64 pairs; default (F - 2 m, m, m), m = floor(3F/8),
  for A = 3, equal sections otherwise): time gets the highest frequencies.
- ``"mrope_interleaved"``: Qwen3-VL's interleaved M-RoPE (``apply_interleaved_mrope``), A = 3:
  pair j goes to h if j = 1 (mod 3) and j < 3 s_1, to w if j = 2 (mod 3) and j < 3 s_2, else
  to t (default (F - 2 m, m, m), m = floor(5F/16): (24, 20, 20) of 64).
- ``"videorope"``: VideoRoPE's low-frequency temporal allocation (Wei et al., arXiv:2502.05173,
  github.com/Wiselnn570/VideoRoPE ``videorope-vllm/rotary_embedding.py``,
  ``MRotaryEmbedding.m_modify_forward``), A = 3: the first s_1 + s_2 pairs (highest
  frequencies) alternate h, w, h, w, ... and the last s_0 go to t (lowest frequencies); default
  as ``"mrope"``.

``temporal_scale`` (delta, default 1) multiplies the axis-0 position (VideoRoPE's adjustable
temporal spacing, ``t_index * scale_factor``; as a frequency factor here). VideoRoPE's diagonal
layout (each frame's spatial positions centred and moved with its time index, delta included)
is a position convention, ``positions``' ``"diagonal"`` with its ``temporal_spacing``: with it,
keep ``temporal_scale`` at 1 (the ViT raises otherwise). VideoRoPE whole is
``layout="videorope"``, ``base=10000`` and ``position_convention="diagonal"``,
``position_hparams=dict(temporal_spacing=2.0)``. The references rotate half-split pairs
(j, j + H/2); ours are interleaved, the same rotation up to a fixed channel permutation of q
and k. ``rotary_fraction`` < 1 leaves the lowest frequencies of every axis unrotated (p-RoPE,
``fixed_frequency``).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from rope_lie.encodings import _checks, family, fixed_frequency, state

LAYOUTS = ("axial", "mrope", "mrope_interleaved", "videorope")

_FAMILY = "rope_axial"
FAMILY = family.Family(
    name=_FAMILY,
    kind="rotary",
    convention="integer",
    relative=True,
    apply_defaults={
        "base": 100.0,
        "rotary_fraction": 1.0,
        "layout": "axial",
        "sections": None,
        "temporal_scale": 1.0,
    },
    stored_count=lambda num_heads, head_dim, num_axes, settings: 0,
    examples=(
        ({}, (1, 2, 3)),
        ({"rotary_fraction": 0.5}, (2,)),
        ({"layout": "mrope", "base": 10000.0}, (3,)),
        ({"layout": "mrope_interleaved", "sections": (2, 2, 2)}, (3,)),
        ({"layout": "videorope", "temporal_scale": 2.0}, (3,)),
    ),
    pair_spectrum=lambda head_dim, num_axes, s: pair_frequencies(
        head_dim, num_axes, s["base"], s["layout"], s["sections"], s["temporal_scale"]
    ),
)
APPLY_HPARAMS: tuple[str, ...] = tuple(FAMILY.apply_defaults)


def _default_sections(layout: str, num_pairs: int, num_axes: int) -> tuple[int, ...]:
    if num_axes == 3 and layout in ("mrope", "videorope"):
        m = 3 * num_pairs // 8
        return (num_pairs - 2 * m, m, m)
    if layout == "mrope_interleaved":
        m = 5 * num_pairs // 16
        return (num_pairs - 2 * m, m, m)
    return tuple(len(g) for g in np.array_split(np.arange(num_pairs), num_axes))


def _checked_layout(layout, sections, temporal_scale, head_dim: int, num_axes: int):
    """(layout, sections or None, temporal_scale), validated against (H, A)."""
    if layout not in LAYOUTS:
        raise ValueError(f"{_FAMILY}: layout={layout!r}; expected one of {LAYOUTS}")
    if isinstance(temporal_scale, bool) or not (
        isinstance(temporal_scale, (int, float))
        and np.isfinite(temporal_scale)
        and temporal_scale > 0
    ):
        raise ValueError(f"{_FAMILY}: temporal_scale={temporal_scale!r} must be a positive number")
    if layout == "axial":
        if sections is not None:
            raise ValueError(f"{_FAMILY}: sections={sections!r} need a layout other than 'axial'")
        _checks.check_divisible(head_dim, 2 * num_axes, "2*num_axes", _FAMILY)
        return layout, None, float(temporal_scale)
    _checks.check_divisible(head_dim, 2, "2", _FAMILY)
    if layout != "mrope" and num_axes != 3:
        raise ValueError(
            f"{_FAMILY}: layout={layout!r} is for (t, h, w): num_axes=3, got {num_axes}"
        )
    num_pairs = head_dim // 2
    if sections is None:
        sections = _default_sections(layout, num_pairs, num_axes)
    sections = tuple(sections)
    if (
        len(sections) != num_axes
        or any(
            isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in sections
        )
        or sum(sections) != num_pairs
    ):
        raise ValueError(
            f"{_FAMILY}: sections={sections} must be {num_axes} non-negative ints summing to "
            f"head_dim/2={num_pairs}"
        )
    return layout, tuple(int(s) for s in sections), float(temporal_scale)


def _layout_axes(layout: str, sections: tuple[int, ...], num_pairs: int) -> np.ndarray:
    """The axis of every pair of the shared spectrum (module docstring)."""
    if layout == "mrope":
        return np.repeat(np.arange(len(sections)), sections)
    j = np.arange(num_pairs)
    if layout == "mrope_interleaved":
        axis_F = np.zeros(num_pairs, np.int64)
        axis_F[(j % 3 == 1) & (j < 3 * sections[1])] = 1
        axis_F[(j % 3 == 2) & (j < 3 * sections[2])] = 2
        return axis_F
    spatial = sections[1] + sections[2]  # videorope
    return np.where(j < spatial, 1 + j % 2, 0)


def pair_frequencies(
    head_dim: int,
    num_axes: int,
    base: float = 100.0,
    layout: str = "axial",
    sections=None,
    temporal_scale: float = 1.0,
):
    """The axis and frequency of every pair.

    Args:
      head_dim: H (``"axial"``: divisible by 2 * num_axes).
      num_axes: A.
      base: frequency base.
      layout: one of ``LAYOUTS`` (module docstring).
      sections: pairs per axis for the shared-spectrum layouts (None: the layout's default).
      temporal_scale: factor on the axis-0 frequencies.

    Returns:
      (axis_F, freq_F): int (F,) axis of pair j and float64 (F,) its frequency, F = H/2.
    """
    layout, sections, temporal_scale = _checked_layout(
        layout, sections, temporal_scale, head_dim, num_axes
    )
    if layout == "axial":
        per_axis = head_dim // (2 * num_axes)
        axis_F = np.repeat(np.arange(num_axes), per_axis)
        freq_F = base ** (-2.0 * num_axes * np.tile(np.arange(per_axis), num_axes) / head_dim)
    else:
        axis_F = _layout_axes(layout, sections, head_dim // 2)
        freq_F = base ** (-2.0 * np.arange(head_dim // 2) / head_dim)
    if temporal_scale != 1.0:
        freq_F = np.where(axis_F == 0, temporal_scale * freq_F, freq_F)
    return axis_F, freq_F


def _table(layout, sections, temporal_scale):
    """(table, dims check) of a layout, for ``fixed_frequency``."""
    table = functools.partial(
        pair_frequencies, layout=layout, sections=sections, temporal_scale=temporal_scale
    )

    def check(head_dim: int, num_axes: int) -> None:
        _checked_layout(layout, sections, temporal_scale, head_dim, num_axes)

    return table, check


def init(
    key: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_axes: int,
    base: float = 100.0,
    rotary_fraction: float = 1.0,
    layout: str = "axial",
    sections=None,
    temporal_scale: float = 1.0,
) -> dict[str, jax.Array]:
    """Validate the configuration; RoPE-Axial has no parameters.

    Args:
      key: unused (kept for the common ``init`` signature).
      num_heads: number of heads N.
      head_dim: head dimension H, divisible by 2 * num_axes (other layouts: even).
      num_axes: number of position axes A.
      base: frequency base (100 in the rope-vit reference; 10000 in M-RoPE and VideoRoPE).
      rotary_fraction: p-RoPE's fraction of pairs rotated per axis (``fixed_frequency``).
      layout: one of ``LAYOUTS`` (module docstring).
      sections: pairs per axis for the shared-spectrum layouts; None: the layout's default.
      temporal_scale: VideoRoPE's delta on the axis-0 positions.

    Returns:
      ``{}``.
    """
    del key
    _, check = _table(layout, sections, temporal_scale)
    fixed_frequency.init(
        _FAMILY,
        check,
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
        rotary_fraction=rotary_fraction,
        layout=layout,
        sections=sections,
        temporal_scale=temporal_scale,
    )


def apply(
    params: dict[str, jax.Array],
    x_BTNH: jax.Array,
    pos: jax.Array,
    *,
    base: float = family.INIT,
    rotary_fraction: float = family.INIT,
    layout: str = family.INIT,
    sections=family.INIT,
    temporal_scale: float = family.INIT,
) -> jax.Array:
    """Rotate queries or keys by R(p).

    Args:
      params: ``{}`` (from ``init``).
      x_BTNH: queries or keys (B, T, N, H), any float dtype.
      pos: positions ``pos_TA`` shared by the batch, or ``pos_BTA`` per example.
      base, rotary_fraction, layout, sections, temporal_scale: ``init``'s (read from its
        parameters; a plain ``{}``: these arguments, else ``init``'s defaults).

    Returns:
      (B, T, N, H) array in x's dtype.
    """
    s = _bound(params, base, rotary_fraction, layout, sections, temporal_scale)
    table, check = _table(s["layout"], s["sections"], s["temporal_scale"])
    return fixed_frequency.apply(
        _FAMILY,
        check,
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
    rotary_fraction: float = family.INIT,
    layout: str = family.INIT,
    sections=family.INIT,
    temporal_scale: float = family.INIT,
) -> state.PairAngles:
    """The rotation angles of every token (the encoder state, ``encodings/state.py``).

    Args:
      params: ``{}`` (from ``init``).
      pos: positions pos_TA or pos_BTA.
      num_heads: N (the angles are the same for every head).
      head_dim: H.
      num_prefix: prefix tokens (at position 0, not rotated).
      base, rotary_fraction, layout, sections, temporal_scale: ``init``'s (read from its
        parameters; a plain ``{}``: these arguments, else ``init``'s defaults).

    Returns:
      ``PairAngles`` of shape (T, 1, H/2), or (B, T, 1, H/2) per example; float32.
    """
    s = _bound(params, base, rotary_fraction, layout, sections, temporal_scale)
    table, check = _table(s["layout"], s["sections"], s["temporal_scale"])
    return fixed_frequency.precompute(
        _FAMILY,
        check,
        table,
        params,
        pos,
        num_heads=num_heads,
        head_dim=head_dim,
        num_prefix=num_prefix,
        base=s["base"],
        rotary_fraction=s["rotary_fraction"],
    )


def _bound(params, base, rotary_fraction, layout, sections, temporal_scale) -> dict:
    return family.bound(
        params,
        _FAMILY,
        base=base,
        rotary_fraction=rotary_fraction,
        layout=layout,
        sections=sections,
        temporal_scale=temporal_scale,
    )
