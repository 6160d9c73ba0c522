"""rope_axial's axis layouts for video (t, h, w): M-RoPE sections, Qwen3-VL's interleaving and
VideoRoPE's low-frequency temporal allocation, against transcriptions of the reference codes'
angle tables in float64; VideoRoPE's temporal scaling and its diagonal layout (the
``"diagonal"`` position convention), alone and through the 3D ViT; errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from rope_lie.encodings import positions, rope_axial
from rope_lie.models.vit import ViT

T = 6


def _pos(seed=0, num_axes=3):
    return np.random.default_rng(seed).uniform(-4.0, 4.0, (T, num_axes)).astype(np.float32)


def _angles(pos_TA, head_dim, **hparams):
    pe = rope_axial.precompute({}, pos_TA, num_heads=1, head_dim=head_dim, **hparams)
    return np.asarray(pe.angle_TNF[:, 0], np.float64)


def _embeds(pos_TA, head_dim, base):
    """(A, T, F): every axis's position times every frequency of the one spectrum."""
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim)
    return np.asarray(pos_TA, np.float64).T[:, :, None] * inv_freq


def _qwen2_mrope(pos_TA, head_dim, base, sections):
    """Qwen2-VL's MRotaryEmbedding: split the table into sections, section i from axis i."""
    embeds = _embeds(pos_TA, head_dim, base)
    bounds = np.cumsum(sections)[:-1]
    parts = np.split(embeds, bounds, axis=-1)
    return np.concatenate([part[i] for i, part in enumerate(parts)], axis=-1)


def _qwen3_interleaved(pos_TA, head_dim, base, sections):
    """Qwen3-VL's apply_interleaved_mrope: t everywhere, then h at 1::3 and w at 2::3."""
    embeds = _embeds(pos_TA, head_dim, base)
    out = embeds[0].copy()
    for dim, offset in ((1, 1), (2, 2)):
        idx = slice(offset, sections[dim] * 3, 3)
        out[:, idx] = embeds[dim][:, idx]
    return out


def _videorope_lta(pos_TA, head_dim, base, sections):
    """VideoRoPE's m_modify_forward: [s_h + s_w, s_t]; the first alternate h, w; then t."""
    embeds = _embeds(pos_TA, head_dim, base)
    columns, index = [], 0
    for i, section in enumerate([sections[1] + sections[2], sections[0]]):
        if i % 2 == 0:
            for j in range(section):
                columns.append(embeds[1 if j % 2 == 0 else 2][:, index])
                index += 1
        else:
            columns.extend(embeds[0][:, index + k] for k in range(section))
            index += section
    return np.stack(columns, axis=-1)


@pytest.mark.parametrize(
    "layout,reference,sections,head_dim",
    [
        ("mrope", _qwen2_mrope, (16, 24, 24), 128),  # Qwen2-VL's mrope_section
        ("mrope", _qwen2_mrope, (2, 3, 3), 16),
        ("mrope_interleaved", _qwen3_interleaved, (24, 20, 20), 128),  # Qwen3-VL's
        ("mrope_interleaved", _qwen3_interleaved, (4, 2, 2), 16),
        ("videorope", _videorope_lta, (16, 24, 24), 128),
        ("videorope", _videorope_lta, (2, 3, 3), 16),
    ],
)
def test_layouts_match_the_reference_tables(layout, reference, sections, head_dim):
    pos_TA = _pos()
    got = _angles(pos_TA, head_dim, base=10000.0, layout=layout, sections=sections)
    want = reference(pos_TA, head_dim, 10000.0, sections)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "layout,expected",
    [("mrope", (16, 24, 24)), ("mrope_interleaved", (24, 20, 20)), ("videorope", (16, 24, 24))],
)
def test_default_sections_are_the_references_at_head_dim_128(layout, expected):
    pos_TA = _pos(1)
    np.testing.assert_array_equal(
        _angles(pos_TA, 128, base=1e4, layout=layout),
        _angles(pos_TA, 128, base=1e4, layout=layout, sections=expected),
    )


def test_videorope_gives_time_the_lowest_frequencies():
    axis_F, freq_F = rope_axial.pair_frequencies(64, 3, 10000.0, layout="videorope")
    assert np.all(axis_F[-8:] == 0) and not np.any(axis_F[:-8] == 0)
    assert freq_F[axis_F == 0].max() < freq_F[axis_F != 0].min()
    np.testing.assert_array_equal(axis_F[:6], [1, 2, 1, 2, 1, 2])


@pytest.mark.parametrize("layout", ["axial", "mrope", "videorope"])
def test_temporal_scale_multiplies_the_time_positions(layout):
    pos_TA = _pos(2)
    scaled = pos_TA * np.array([2.0, 1.0, 1.0], np.float32)
    np.testing.assert_allclose(
        _angles(pos_TA, 24, layout=layout, temporal_scale=2.0),
        _angles(scaled, 24, layout=layout),
        rtol=1e-6,
        atol=1e-6,
    )


def test_the_axial_default_is_unchanged_by_the_layout_option():
    pos_TA, head_dim = _pos(3), 24
    np.testing.assert_array_equal(
        _angles(pos_TA, head_dim, layout="axial"), _angles(pos_TA, head_dim)
    )
    per_axis = head_dim // 6  # the rope-vit formula, written out
    freq = 100.0 ** (-6.0 * np.arange(per_axis) / head_dim)
    want = np.concatenate([pos_TA[:, a : a + 1].astype(np.float64) * freq for a in range(3)], -1)
    np.testing.assert_allclose(_angles(pos_TA, head_dim), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(layout="spiral"), "layout='spiral'"),
        (dict(layout="mrope", sections=(1, 2, 2)), "summing to head_dim/2=6"),
        (dict(layout="videorope", num_axes=2), "num_axes=3, got 2"),
        (dict(layout="axial", sections=(2, 2, 2)), "need a layout other than 'axial'"),
        (dict(layout="mrope", temporal_scale=0.0), "temporal_scale=0.0"),
    ],
)
def test_bad_layouts_name_the_value(kwargs, match):
    kwargs = {"num_axes": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        rope_axial.init(jax.random.key(0), num_heads=1, head_dim=12, **kwargs)


def _videorope_position_ids(grid_thw, scale_factor, offset=0):
    """The vision positions of VideoRoPE's ``get_t_scale_rope_index`` (videorope-transformer/
    modeling_videorope.py, "body-diagonal symmetry") for one video whose preceding text ends at
    ``offset`` - 1 (``text_len + st_idx`` = offset), transcribed in float64: (T H W, 3)."""
    t, h, w = grid_thw
    t_index = np.repeat(np.arange(t), h * w).astype(np.float64)
    h_index = np.tile(np.repeat(np.arange(h), w), t) - (h - 1) // 2
    w_index = np.tile(np.arange(w), t * h) - (w - 1) // 2
    t_index = t_index * scale_factor
    t_index = t_index + offset
    h_index = h_index + t_index
    w_index = w_index + t_index
    return np.stack([t_index, h_index, w_index], axis=-1)


@pytest.mark.parametrize("grid", [(3, 4, 5), (2, 5, 5), (4, 2, 6), (1, 3, 3)])
@pytest.mark.parametrize("delta", [1.0, 2.0, 0.5])
def test_diagonal_positions_are_the_references(grid, delta):
    """Odd and even sides (the reference centres by (n - 1) // 2), delta 1, 2 (the paper's) and
    0.5; the prefix token first at 0, the video from 0 (the reference's offset 0)."""
    got = positions.grid_positions(grid, "diagonal", num_prefix=1, temporal_spacing=delta)
    want = np.concatenate([np.zeros((1, 3)), _videorope_position_ids(grid, delta)])
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)


def test_the_references_text_offset_is_a_shift_the_patches_do_not_see():
    """The reference starts a video at offset o (its text before it); ours at 0. Every patch
    moves by (o, o, o), so the patches' attention logits under VideoRoPE are the same."""
    grid, head_dim = (3, 4, 4), 32
    ours = _videorope_position_ids(grid, 2.0)
    shifted = _videorope_position_ids(grid, 2.0, offset=7)
    np.testing.assert_array_equal(shifted - ours, 7.0)
    rng = np.random.default_rng(4)
    q, k = (rng.normal(size=(1, len(ours), 1, head_dim)).astype(np.float32) for _ in range(2))
    hp = dict(base=1e4, layout="videorope")

    def logits(pos):
        pos = pos.astype(np.float32)
        rq, rk = (np.asarray(rope_axial.apply({}, x, pos, **hp))[0, :, 0] for x in (q, k))
        return rq @ rk.T

    np.testing.assert_allclose(logits(shifted), logits(ours), rtol=1e-4, atol=1e-4)


def test_videorope_whole_through_the_3d_vit():
    """The 3D ViT with VideoRoPE's three parts, low-frequency temporal allocation
    (``layout="videorope"``), diagonal layout and temporal spacing delta = 2
    (``position_convention="diagonal"``, ``position_hparams``): every block's angles are the
    reference's table (``_videorope_lta``) at the reference's position ids; the class token's
    are 0."""
    model = ViT(
        variant=None,
        dims=dict(width=32, depth=2, num_heads=2, mlp_dim=64),
        patch_size=(1, 2, 2),
        image_shape=(3, 10, 8),
        channels=2,
        num_classes=3,
        pe="rope_axial",
        pe_hparams=dict(layout="videorope", base=1e4, sections=(2, 3, 3)),
        position_convention="diagonal",
        position_hparams=dict(temporal_spacing=2.0),
        rngs=nnx.Rngs(0),
    )
    grid = (3, 5, 4)
    want = _videorope_lta(_videorope_position_ids(grid, 2.0), 16, 1e4, (2, 3, 3))
    for state in model.precompute_pe(grid):
        angle_TF = np.asarray(state.angle_TNF[:, 0], np.float64)
        np.testing.assert_array_equal(angle_TF[0], 0.0)
        np.testing.assert_allclose(angle_TF[1:], want, rtol=1e-6, atol=1e-5)
    images = np.random.default_rng(5).normal(size=(2, 3, 10, 8, 2)).astype(np.float32)
    assert np.isfinite(np.asarray(model(images))).all()
