"""APE: learned table, exact at the training grid, resized (linear/bicubic/trilinear) elsewhere."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie.encodings import ape, positions, sincos

_KEY = jax.random.key(0)


def _params_from(grid_GD: np.ndarray, prefix_PD: np.ndarray | None = None) -> dict:
    params = {"grid_GD": jnp.asarray(grid_GD, jnp.float32)}
    if prefix_PD is not None:
        params["prefix_PD"] = jnp.asarray(prefix_PD, jnp.float32)
    return params


def _random_params(grid, width, num_prefix, seed=0) -> dict:
    """Tables from numpy's RNG (jax.random compiles once per shape, which is slow on CPU)."""
    rng = np.random.default_rng(seed)
    prefix = rng.normal(size=(num_prefix, width)) if num_prefix else None
    return _params_from(rng.normal(size=(*grid, width)), prefix)


def _ramp(grid, slope_A, offset_D) -> np.ndarray:
    """f(p) = <slope, p> + offset_d on the integer grid, shape (*grid, D), float64."""
    mesh = np.meshgrid(*[np.arange(n, dtype=np.float64) for n in grid], indexing="ij")
    value = sum(s * m for s, m in zip(slope_A, mesh, strict=True))
    return value[..., None] + np.asarray(offset_D)


@pytest.mark.parametrize("grid, num_prefix", [((6,), 0), ((2, 3, 4), 2)])
def test_init_shapes_names_and_distribution(grid, num_prefix):
    params = ape.init(_KEY, grid_shape=grid, width=48, num_prefix=num_prefix, init_std=0.5)
    expected = {"grid_GD"} | ({"prefix_PD"} if num_prefix else set())
    assert set(params) == expected
    chex.assert_shape(params["grid_GD"], (*grid, 48))
    chex.assert_type(params["grid_GD"], jnp.float32)
    if num_prefix:
        chex.assert_shape(params["prefix_PD"], (num_prefix, 48))
    values = np.concatenate([np.ravel(v) for v in params.values()])
    np.testing.assert_allclose(np.std(values), 0.5, rtol=0.1)


def test_default_init_std():
    params = ape.init(_KEY, grid_shape=(16, 16), width=64)
    np.testing.assert_allclose(np.std(np.asarray(params["grid_GD"])), 0.02, rtol=0.05)


@pytest.mark.parametrize("grid", [(6,), (4, 5), (2, 3, 4)])
@pytest.mark.parametrize("num_prefix", [0, 1])
def test_identity_at_training_grid(grid, num_prefix):
    params = _random_params(grid, 8, num_prefix)
    emb = ape.table(params, grid_shape=grid, width=8, num_prefix=num_prefix)
    chex.assert_type(emb, jnp.float32)
    expected = np.asarray(params["grid_GD"]).reshape(-1, 8)  # row-major token order
    if num_prefix:
        expected = np.concatenate([np.asarray(params["prefix_PD"]), expected])
    np.testing.assert_array_equal(np.asarray(emb), expected)


@pytest.mark.parametrize("grid, new_grid", [((6,), (9,)), ((4, 5), (7, 3)), ((2, 3, 4), (4, 3, 2))])
def test_resized_shape_and_prefix_rows_kept(grid, new_grid):
    params = _random_params(grid, 6, num_prefix=2)
    emb = ape.table(params, grid_shape=new_grid)
    chex.assert_shape(emb, (2 + int(np.prod(new_grid)), 6))
    chex.assert_tree_all_finite(emb)
    np.testing.assert_array_equal(np.asarray(emb[:2]), np.asarray(params["prefix_PD"]))


@pytest.mark.parametrize(
    "grid, new_grid",
    [((6,), (11,)), ((6,), (4,)), ((5, 7), (9, 12)), ((9, 8), (4, 5)), ((3, 4, 5), (5, 2, 7))],
)
def test_constant_table_stays_constant(grid, new_grid):
    value_D = np.array([0.3, -1.2, 2.0])
    params = _params_from(np.broadcast_to(value_D, (*grid, 3)))
    emb = ape.table(params, grid_shape=new_grid)
    np.testing.assert_allclose(
        np.asarray(emb), np.broadcast_to(value_D, emb.shape), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize(
    "grid, new_grid, support",
    [((5,), (13,), 1), ((6, 8), (10, 15), 2), ((7, 6), (10, 9), 2), ((3, 4, 5), (5, 7, 9), 1)],
)
def test_linear_ramp_resizes_to_the_analytic_ramp(grid, new_grid, support):
    """Interior samples of a resized ramp lie on the ramp, at half-pixel-centre coordinates.

    Linear and Keys cubic interpolation reproduce linear functions exactly wherever the kernel
    (half-width ``support``) does not reach past the border.
    """
    slope_A, offset_D = [0.7, -0.4, 0.25][: len(grid)], [1.0, -2.0]
    params = _params_from(_ramp(grid, slope_A, offset_D))
    emb = np.asarray(ape.table(params, grid_shape=new_grid)).reshape(*new_grid, 2)
    coords = [(np.arange(m) + 0.5) * n / m - 0.5 for n, m in zip(grid, new_grid, strict=True)]
    mesh = np.meshgrid(*coords, indexing="ij")
    expected = sum(s * m for s, m in zip(slope_A, mesh, strict=True))[..., None] + np.asarray(
        offset_D
    )
    interior = np.ones(new_grid, bool)
    for m, n in zip(mesh, grid, strict=True):
        interior &= (m >= support - 1) & (m <= n - support)
    assert interior.sum() >= 4
    np.testing.assert_allclose(emb[interior], expected[interior], atol=1e-5)


def test_two_d_is_cubic_not_linear():
    """A quadratic is reproduced by Keys' cubic in the interior, not by bilinear."""
    row = np.arange(8, dtype=np.float64)
    params = _params_from(np.broadcast_to((row**2)[:, None, None], (8, 4, 1)))
    emb = np.asarray(ape.table(params, grid_shape=(16, 4))).reshape(16, 4)
    coords = (np.arange(16) + 0.5) / 2 - 0.5
    interior = (coords >= 1) & (coords <= 6)
    np.testing.assert_allclose(emb[interior, 0], coords[interior] ** 2, atol=1e-4)
    bilinear = np.asarray(ape.table(params, grid_shape=(16, 4), method="linear")).reshape(16, 4)
    assert np.max(np.abs(bilinear[interior, 0] - coords[interior] ** 2)) > 0.05


def test_jit_and_grad():
    params = _random_params((4, 4), 4, num_prefix=1)
    table = jax.jit(functools.partial(ape.table, grid_shape=(6, 5)))
    chex.assert_shape(table(params), (31, 4))
    grads = jax.grad(lambda p: jnp.sum(table(p) ** 2))(params)
    chex.assert_tree_all_finite(grads)
    assert np.all(np.asarray(grads["prefix_PD"]) != 0.0)


def test_rank_mismatch_error():
    params = _random_params((4, 4), 4, num_prefix=0)
    with pytest.raises(ValueError, match=r"grid_shape=\(4, 4, 4\) has rank 3 .* \(4, 4\)"):
        ape.table(params, grid_shape=(4, 4, 4))


def test_table_argument_errors():
    params = _random_params((4, 4), 4, num_prefix=1)
    with pytest.raises(ValueError, match="width=8"):
        ape.table(params, grid_shape=(4, 4), width=8)
    with pytest.raises(ValueError, match="num_prefix=0"):
        ape.table(params, grid_shape=(4, 4), num_prefix=0)
    with pytest.raises(ValueError, match="method='nearest'"):
        ape.table(params, grid_shape=(5, 5), method="nearest")
    with pytest.raises(ValueError, match=r"grid_shape=\(4, 0\)"):
        ape.table(params, grid_shape=(4, 0))
    with pytest.raises(ValueError, match="grid_GD"):
        ape.table({"prefix_PD": params["prefix_PD"]}, grid_shape=(4, 4))


def test_init_errors():
    with pytest.raises(ValueError, match=r"grid_shape=\(2, 2, 2, 2\)"):
        ape.init(_KEY, grid_shape=(2, 2, 2, 2), width=4)
    with pytest.raises(ValueError, match="width=0"):
        ape.init(_KEY, grid_shape=(4, 4), width=0)
    with pytest.raises(ValueError, match="num_prefix=-1"):
        ape.init(_KEY, grid_shape=(4, 4), width=4, num_prefix=-1)
    with pytest.raises(ValueError, match="init_std=-1"):
        ape.init(_KEY, grid_shape=(4, 4), width=4, init_std=-1.0)
    with pytest.raises(TypeError):
        ape.init(_KEY, grid_shape=(4, 4), width=4, base=10.0)


@pytest.mark.parametrize(
    "stored, grids",
    [
        ((4, 4), [(3, 4), (5, 2), (4, 4), (8, 6)]),
        ((5,), [(2,), (5,), (9,)]),
        ((2, 3, 2), [(1, 3, 4), (2, 3, 2), (3, 1, 1)]),
    ],
)
def test_gather_is_each_examples_resized_table_at_its_tokens(stored, grids):
    """Per-example grids, traced: row index[b, t] of table(grid[b]), prefix rows first."""
    params = ape.init(_KEY, grid_shape=stored, width=6, num_prefix=1, init_std=1.0)
    length = max(np.prod(g) for g in grids)
    index, grid_BA = [], []
    for g in grids:
        index_TA = positions.grid_indices(g)[::-1]  # any token order
        index.append(np.pad(index_TA, ((0, length - len(index_TA)), (0, 0))))
        grid_BA.append(g)
    emb_BTD = jax.jit(ape.gather)(params, jnp.asarray(index), jnp.asarray(grid_BA))
    chex.assert_shape(emb_BTD, (len(grids), 1 + length, 6))
    for b, g in enumerate(grids):
        table_TD = np.asarray(ape.table(params, grid_shape=g))
        np.testing.assert_allclose(emb_BTD[b, 0], table_TD[0], rtol=0, atol=0)
        expected = table_TD[1:][::-1]  # the reversed token order
        np.testing.assert_allclose(emb_BTD[b, 1 : 1 + len(expected)], expected, atol=2e-6)


def test_gather_with_a_grid_per_token_is_each_tokens_own_grids_table():
    """A packed row: tokens of several grids in one row, each with its own grid (grid_BTA)."""
    params = ape.init(_KEY, grid_shape=(4, 4), width=6, num_prefix=1, init_std=1.0)
    grids = [(3, 4), (5, 2), (2, 2)]
    index = np.concatenate([positions.grid_indices(g) for g in grids])
    grid_TA = np.concatenate([np.tile(g, (int(np.prod(g)), 1)) for g in grids])
    emb_BTD = jax.jit(ape.gather)(params, jnp.asarray(index)[None], jnp.asarray(grid_TA)[None])
    expected = np.concatenate([np.asarray(ape.table(params, grid_shape=g))[1:] for g in grids])
    np.testing.assert_allclose(emb_BTD[0, 1:], expected, atol=2e-6)
    np.testing.assert_array_equal(emb_BTD[0, 0], np.asarray(params["prefix_PD"])[0])


def test_gather_errors():
    params = ape.init(_KEY, grid_shape=(4, 4), width=6)
    with pytest.raises(ValueError, match="index_BTA has shape"):
        ape.gather(params, jnp.zeros((2, 3, 3), jnp.int32), jnp.ones((2, 2), jnp.int32))
    with pytest.raises(ValueError, match="grid_BA has shape"):
        ape.gather(params, jnp.zeros((2, 3, 2), jnp.int32), jnp.ones((3, 2), jnp.int32))
    with pytest.raises(ValueError, match="width=5"):
        ape.gather(params, jnp.zeros((2, 3, 2), jnp.int32), jnp.ones((2, 2), jnp.int32), width=5)
    # coordinates between rows would be interpolated silently: table rows are integers
    for gather, p in ((ape.gather, params), (sincos.gather, {})):
        with pytest.raises(TypeError, match="integer grid coordinates, got dtype float32"):
            gather(p, jnp.full((2, 3, 2), 0.5), jnp.ones((2, 2), jnp.int32), width=8)
