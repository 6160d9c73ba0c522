"""sincos: against a float64 port of MAE's get_2d_sincos_pos_embed, and its 1D/3D extension."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie.encodings import positions, sincos

_KEY = jax.random.key(0)


def _mae_1d(embed_dim: int, pos: np.ndarray) -> np.ndarray:
    """MAE's get_1d_sincos_pos_embed_from_grid: [sin(pos * omega), cos(pos * omega)]."""
    omega = np.arange(embed_dim // 2, dtype=np.float64)
    omega /= embed_dim / 2.0
    omega = 1.0 / 10000**omega
    out = np.einsum("m,d->md", pos.reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def _mae_2d(embed_dim: int, grid_hw: tuple[int, int], cls_token: bool) -> np.ndarray:
    """MAE's get_2d_sincos_pos_embed, with a (grid_h, grid_w) grid instead of a square one."""
    grid_h = np.arange(grid_hw[0], dtype=np.float32)
    grid_w = np.arange(grid_hw[1], dtype=np.float32)
    grid = np.meshgrid(grid_w, grid_h)  # here w goes first (MAE's comment)
    grid = np.stack(grid, axis=0).reshape([2, 1, grid_hw[0], grid_hw[1]])
    emb_h = _mae_1d(embed_dim // 2, grid[0])
    emb_w = _mae_1d(embed_dim // 2, grid[1])
    pos_embed = np.concatenate([emb_h, emb_w], axis=1)
    if cls_token:
        pos_embed = np.concatenate([np.zeros([1, embed_dim]), pos_embed], axis=0)
    return pos_embed


@pytest.mark.parametrize("grid", [(4, 4), (3, 5), (6, 2)])
@pytest.mark.parametrize("cls_token", [False, True])
def test_matches_mae_2d(grid, cls_token):
    emb = sincos.table({}, grid_shape=grid, width=16, num_prefix=int(cls_token))
    chex.assert_type(emb, jnp.float32)
    np.testing.assert_allclose(np.asarray(emb), _mae_2d(16, grid, cls_token), atol=1e-6)


def test_two_d_channel_halves_encode_column_then_row():
    """MAE's meshgrid(w, h): the first half varies along columns, the second along rows."""
    emb = np.asarray(sincos.table({}, grid_shape=(3, 5), width=8)).reshape(3, 5, 8)
    np.testing.assert_allclose(emb[:, :, :4], np.broadcast_to(emb[:1, :, :4], (3, 5, 4)))
    np.testing.assert_allclose(emb[:, :, 4:], np.broadcast_to(emb[:, :1, 4:], (3, 5, 4)))
    assert np.ptp(emb[0, :, 0]) > 0.5 and np.ptp(emb[:, 0, 4]) > 0.5


@pytest.mark.parametrize("width", [2, 8, 32])
def test_one_d_matches_vaswani(width):
    emb = np.asarray(sincos.table({}, grid_shape=(11,), width=width))
    pos = np.arange(11, dtype=np.float64)[:, None]
    freq = 10000.0 ** (-2.0 * np.arange(width // 2) / width)
    np.testing.assert_allclose(emb[:, : width // 2], np.sin(pos * freq), atol=1e-6)
    np.testing.assert_allclose(emb[:, width // 2 :], np.cos(pos * freq), atol=1e-6)


def test_three_d_blocks_in_reverse_axis_order():
    grid, width = (2, 3, 4), 24
    emb = np.asarray(sincos.table({}, grid_shape=grid, width=width, num_prefix=1))
    chex.assert_shape(emb, (1 + 24, width))
    np.testing.assert_array_equal(emb[0], 0.0)
    t, r, c = np.meshgrid(*[np.arange(n, dtype=np.float64) for n in grid], indexing="ij")
    expected = np.concatenate(
        [_mae_1d(8, c), _mae_1d(8, r), _mae_1d(8, t)], axis=1
    )  # x (col), y (row), z (depth)
    np.testing.assert_allclose(emb[1:], expected, atol=1e-6)


@pytest.mark.parametrize("grid", [(7,), (3, 4), (2, 3, 2)])
def test_values_bounded_and_prefix_rows_zero(grid):
    emb = np.asarray(sincos.table({}, grid_shape=grid, width=12, num_prefix=3))
    chex.assert_shape(emb, (3 + int(np.prod(grid)), 12))
    np.testing.assert_array_equal(emb[:3], 0.0)
    assert np.all(np.abs(emb) <= 1.0)
    # every grid row is a unit vector per (sin, cos) pair: sin^2 + cos^2 = 1
    half = 12 // (2 * len(grid))
    blocks = emb[3:].reshape(-1, len(grid), 2, half)
    np.testing.assert_allclose(np.sum(blocks**2, axis=2), 1.0, atol=1e-6)


def test_larger_grid_extends_the_table():
    small = np.asarray(sincos.table({}, grid_shape=(3, 4), width=8)).reshape(3, 4, 8)
    large = np.asarray(sincos.table({}, grid_shape=(5, 6), width=8)).reshape(5, 6, 8)
    np.testing.assert_array_equal(large[:3, :4], small)


def test_init_returns_empty_and_table_is_jittable():
    assert sincos.init(_KEY, grid_shape=(4, 4), width=8, num_prefix=1) == {}
    emb = jax.jit(lambda p: sincos.table(p, grid_shape=(4, 4), width=8, num_prefix=1))({})
    chex.assert_shape(emb, (17, 8))


@pytest.mark.parametrize("grid, width", [((4,), 3), ((4, 4), 6), ((2, 2, 2), 8)])
def test_width_must_be_divisible_by_twice_the_axes(grid, width):
    with pytest.raises(ValueError, match=f"width={width} is not divisible by 2 \\* num_axes"):
        sincos.init(_KEY, grid_shape=grid, width=width)
    with pytest.raises(ValueError, match=f"width={width}"):
        sincos.table({}, grid_shape=grid, width=width)


def test_argument_errors():
    with pytest.raises(ValueError, match=r"grid_shape=\(\)"):
        sincos.table({}, grid_shape=(), width=8)
    with pytest.raises(ValueError, match="num_prefix=-2"):
        sincos.table({}, grid_shape=(4,), width=8, num_prefix=-2)
    with pytest.raises(ValueError, match="expects params={}"):
        sincos.table({"grid_GD": jnp.zeros((4, 8))}, grid_shape=(4,), width=8)
    with pytest.raises(TypeError):
        sincos.init(_KEY, grid_shape=(4,), width=8, base=100.0)


@pytest.mark.parametrize("grid", [(5,), (3, 7), (2, 3, 4)])
def test_gather_is_the_table_at_the_tokens(grid):
    index_TA = positions.grid_indices(grid)
    emb_BTD = jax.jit(sincos.gather, static_argnames=("width", "num_prefix"))(
        {}, jnp.asarray(index_TA[None, ::-1]), width=12, num_prefix=1
    )
    table_TD = np.asarray(sincos.table({}, grid_shape=grid, width=12, num_prefix=1))
    np.testing.assert_allclose(emb_BTD[0, 0], table_TD[0], atol=0)
    np.testing.assert_allclose(emb_BTD[0, 1:], table_TD[1:][::-1], atol=2e-6)
