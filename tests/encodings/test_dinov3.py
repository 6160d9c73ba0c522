"""DINOv3's RoPE against a float64 transcription of its reference forward (coordinates, periods,
half-split rotation), and its coordinate augmentations: identity when off, key determinism,
distributions, order, prefix tokens untouched."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from rope_lie.encodings import dinov3, positions

N, HEAD_DIM, PREFIX = 2, 16, 3  # class token and two registers


def _reference_sin_cos(h, w, head_dim, normalize, base=100.0, min_period=None, max_period=None):
    """RopePositionEmbedding.forward (eval), float64: sin, cos of shape (h w, head_dim)."""
    if normalize == "max":
        ch, cw = np.arange(0.5, h) / max(h, w), np.arange(0.5, w) / max(h, w)
    elif normalize == "min":
        ch, cw = np.arange(0.5, h) / min(h, w), np.arange(0.5, w) / min(h, w)
    else:
        ch, cw = np.arange(0.5, h) / h, np.arange(0.5, w) / w
    coords = np.stack(np.meshgrid(ch, cw, indexing="ij"), -1).reshape(-1, 2)
    coords = 2.0 * coords - 1.0
    if base is not None:
        periods = base ** (2 * np.arange(head_dim // 4) / (head_dim // 2))
    else:
        ratio = max_period / min_period
        periods = ratio ** np.linspace(0, 1, head_dim // 4) / ratio * max_period
    angles = (2 * math.pi * coords[:, :, None] / periods[None, None, :]).reshape(len(coords), -1)
    angles = np.tile(angles, 2)
    return np.sin(angles), np.cos(angles)


def _reference_apply(x_BTNH, sin, cos, num_prefix):
    """rope_apply on the patch tokens (x cos + rotate_half(x) sin); prefix tokens unchanged."""
    x = np.asarray(x_BTNH, np.float64)
    patch = x[:, num_prefix:]
    half = patch.shape[-1] // 2
    rotated = np.concatenate([-patch[..., half:], patch[..., :half]], -1)
    out = patch * cos[None, :, None] + rotated * sin[None, :, None]
    return np.concatenate([x[:, :num_prefix], out], axis=1)


def _to_half_split(x):
    """Our interleaved pair c = (2c, 2c+1) is the reference's (c, c + H/2)."""
    return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


@pytest.mark.parametrize(
    "grid,normalize,periods",
    [
        ((3, 4), "separate", dict(base=100.0)),
        ((3, 5), "max", dict(base=100.0)),
        ((4, 2), "min", dict(base=100.0)),
        ((3, 4), "separate", dict(base=None, min_period=0.5, max_period=40.0)),
    ],
)
def test_matches_the_reference_forward(grid, normalize, periods):
    convention = {"separate": "centred", "max": "centred_max", "min": "centred_min"}[normalize]
    pos_TA = positions.grid_positions(grid, convention, num_prefix=PREFIX)
    rng = np.random.default_rng(0)
    x_BTNH = rng.standard_normal((2, pos_TA.shape[0], N, HEAD_DIM)).astype(np.float32)
    out = np.asarray(dinov3.apply({}, x_BTNH, pos_TA, **periods), np.float64)
    sin, cos = _reference_sin_cos(*grid, HEAD_DIM, normalize, **periods)
    want = _reference_apply(_to_half_split(x_BTNH), sin, cos, PREFIX)
    np.testing.assert_allclose(_to_half_split(out), want, rtol=0, atol=3e-5)
    # The prefix tokens (class, registers) are not rotated.
    np.testing.assert_array_equal(out[:, :PREFIX], x_BTNH[:, :PREFIX])


def test_base_periods_are_rope_axial_times_two_pi():
    axis_F, freq_F = dinov3.pair_frequencies(32, 2, 100.0)
    np.testing.assert_array_equal(axis_F, np.repeat([0, 1], 8))
    np.testing.assert_allclose(freq_F[:8], 2 * np.pi * 100.0 ** (-4.0 * np.arange(8) / 32))


def test_min_max_periods_span_the_range():
    p = dinov3.periods(32, 2, base=None, min_period=0.5, max_period=40.0)
    np.testing.assert_allclose([p[0], p[-1]], [0.5, 40.0])
    np.testing.assert_allclose(p[1:] / p[:-1], (80.0) ** (1 / 7))


@pytest.mark.parametrize(
    "kwargs",
    [dict(base=None), dict(base=100.0, min_period=1.0, max_period=2.0), dict(min_period=1.0)],
)
def test_periods_need_base_or_both_bounds(kwargs):
    with pytest.raises(ValueError, match="either base or both min_period and max_period"):
        dinov3.init(jax.random.key(0), num_heads=1, head_dim=8, num_axes=2, **kwargs)


# Augmentations.

POS = positions.grid_positions((4, 6), "centred", num_prefix=PREFIX)


def test_augment_off_is_the_identity():
    out = positions.augment(jax.random.key(0), POS, num_prefix=PREFIX)
    np.testing.assert_array_equal(out, POS)


def test_augment_is_a_function_of_the_key():
    kw = dict(num_prefix=PREFIX, shift=0.5, jitter=1.5, rescale=2.0)
    a = positions.augment(jax.random.key(1), POS, **kw)
    np.testing.assert_array_equal(a, positions.augment(jax.random.key(1), POS, **kw))
    assert float(np.abs(a - positions.augment(jax.random.key(2), POS, **kw)).max()) > 1e-3
    np.testing.assert_array_equal(a[:PREFIX], 0.0)  # prefix tokens stay unrotated


def test_shift_is_uniform_per_axis_and_shared_by_the_tokens():
    out = np.asarray(
        positions.augment(jax.random.key(3), POS, num_prefix=PREFIX, shift=0.5, batch_size=4000)
    )
    u = out[:, PREFIX:] - np.asarray(POS)[PREFIX:]
    np.testing.assert_allclose(u, np.broadcast_to(u[:, :1], u.shape), atol=1e-6)
    u = u[:, 0]  # (B, A)
    assert np.all(np.abs(u) <= 0.5) and np.abs(u).max() > 0.49
    np.testing.assert_allclose(u.mean(0), 0.0, atol=0.02)
    np.testing.assert_allclose(u.var(0), 0.25 / 3, rtol=0.08)  # U[-s, s]: s^2 / 3
    assert abs(np.corrcoef(u.T)[0, 1]) < 0.06  # independent axes


@pytest.mark.parametrize("name", ["jitter", "rescale"])
def test_jitter_and_rescale_are_log_uniform(name):
    out = np.asarray(
        positions.augment(jax.random.key(4), POS, num_prefix=PREFIX, batch_size=4000, **{name: 2.0})
    )
    factor = out[:, PREFIX:] / np.asarray(POS)[PREFIX:]  # (B, T, A), the same for every token
    np.testing.assert_allclose(factor, np.broadcast_to(factor[:, :1], factor.shape), rtol=1e-5)
    log_f = np.log(factor[:, 0])
    assert np.all(np.abs(log_f) <= np.log(2.0) + 1e-6)
    np.testing.assert_allclose(log_f.var(0), np.log(2.0) ** 2 / 3, rtol=0.08)
    same_for_axes = np.allclose(log_f[:, 0], log_f[:, 1], rtol=0, atol=1e-5)
    assert same_for_axes == (name == "rescale")  # jitter per axis, rescale one factor


def test_augment_order_is_shift_then_jitter_then_rescale():
    key, kw = jax.random.key(5), dict(num_prefix=PREFIX)
    pos = np.asarray(POS)[PREFIX:]
    shifted = np.asarray(positions.augment(key, POS, shift=0.3, **kw))[PREFIX:]
    jittered = np.asarray(positions.augment(key, POS, jitter=1.4, **kw))[PREFIX:]
    rescaled = np.asarray(positions.augment(key, POS, rescale=1.7, **kw))[PREFIX:]
    u, j, r = shifted - pos, jittered / pos, rescaled / pos
    every = np.asarray(positions.augment(key, POS, shift=0.3, jitter=1.4, rescale=1.7, **kw))
    np.testing.assert_allclose(every[PREFIX:], (pos + u) * j * r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,match", [(dict(jitter=0.5), "jitter=0.5"), (dict(shift=-1.0), "shift=-1.0")]
)
def test_bad_augmentations_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        positions.augment(jax.random.key(0), POS, num_prefix=PREFIX, **kwargs)
