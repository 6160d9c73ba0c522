"""ALiBi: float64 references (ALiBi's get_slopes, CROMA's 2D distance), prefix, learnable slopes."""

from __future__ import annotations

import itertools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie.encodings import alibi, positions

_KEY = jax.random.key(0)


def _reference_slopes(n: int) -> list[float]:
    """ALiBi's ``get_slopes`` for a power-of-two number of heads (Press et al., reference code)."""
    start = 2 ** (-(2 ** -(math.log2(n) - 3)))
    return [start * start**i for i in range(n)]


def _reference_bias(grid, num_heads: int) -> np.ndarray:
    """CROMA's ``get_2dalibi`` generalised to any rank: -slope * Euclidean distance, float64."""
    points = list(itertools.product(*[range(n) for n in grid]))  # row-major
    slope_N = np.array(_reference_slopes(num_heads))
    dist = np.array([[math.dist(p1, p2) for p2 in points] for p1 in points])
    return -slope_N[:, None, None] * dist[None]


def test_slopes_for_eight_heads():
    np.testing.assert_allclose(alibi.slopes(8), [2.0**-k for k in range(1, 9)], rtol=0)


@pytest.mark.parametrize("num_heads", [1, 2, 4, 16])
def test_slopes_match_alibi_reference_for_powers_of_two(num_heads):
    np.testing.assert_allclose(alibi.slopes(num_heads), _reference_slopes(num_heads), rtol=1e-12)


@pytest.mark.parametrize(
    "num_heads, exponents",
    [
        # ALiBi's get_slopes for non-powers of two, worked by hand: the sequence of the next
        # lower power of two P, then every other slope of the sequence for 2P.
        (3, [-4, -8, -2]),
        (6, [-2, -4, -6, -8, -1, -3]),
        (12, [-1, -2, -3, -4, -5, -6, -7, -8, -0.5, -1.5, -2.5, -3.5]),
    ],
)
def test_slopes_follow_the_alibi_reference_for_other_head_counts(num_heads, exponents):
    np.testing.assert_allclose(alibi.slopes(num_heads), 2.0 ** np.array(exponents), rtol=1e-12)


@pytest.mark.parametrize("grid", [(7,), (3, 4), (2, 3, 2)])
@pytest.mark.parametrize("num_heads", [2, 4])
def test_matches_float64_reference(grid, num_heads):
    pos_TA = positions.grid_positions(grid, "integer")
    params = alibi.init(_KEY, num_heads=num_heads, head_dim=8, num_axes=len(grid))
    out = alibi.bias(params, pos_TA, pos_TA, num_heads=num_heads)
    chex.assert_type(out, jnp.float32)
    np.testing.assert_allclose(np.asarray(out), _reference_bias(grid, num_heads), rtol=1e-6)


def test_one_axis_uses_absolute_difference():
    pos_TA = jnp.array([[0.0], [2.5], [-1.0]])
    out = alibi.bias({}, pos_TA, pos_TA, num_heads=2)
    diff = np.abs(np.array([0.0, 2.5, -1.0])[:, None] - np.array([0.0, 2.5, -1.0])[None, :])
    np.testing.assert_allclose(np.asarray(out), -np.array([1 / 16, 1 / 256])[:, None, None] * diff)


def test_symmetric_with_zero_diagonal_and_nonpositive():
    pos_TA = jnp.asarray(np.random.default_rng(0).uniform(-3, 3, (9, 2)), jnp.float32)
    out = np.asarray(alibi.bias({}, pos_TA, pos_TA, num_heads=3))
    np.testing.assert_allclose(out, np.swapaxes(out, -1, -2), rtol=0, atol=0)
    np.testing.assert_allclose(np.diagonal(out, axis1=-2, axis2=-1), 0.0, atol=0)
    assert np.all(out[:, ~np.eye(9, dtype=bool)] < 0)


def test_rectangular_queries_and_keys():
    pos_q = jnp.array([[0.0, 0.0], [1.0, 1.0]])
    pos_k = jnp.array([[3.0, 4.0], [1.0, 1.0], [0.0, 2.0]])
    out = alibi.bias({}, pos_q, pos_k, num_heads=1)
    dist = np.array([[5.0, math.sqrt(2), 2.0], [math.sqrt(13), 0.0, math.sqrt(2)]])
    np.testing.assert_allclose(np.asarray(out), -(2.0**-8) * dist[None], rtol=1e-6)


def test_prefix_rows_and_columns_are_zero():
    grid, num_prefix = (3, 3), 2
    pos_TA = positions.grid_positions(grid, "integer", num_prefix=num_prefix)
    out = np.asarray(alibi.bias({}, pos_TA, pos_TA, num_heads=4, num_prefix=num_prefix))
    chex.assert_shape(out, (4, 11, 11))
    np.testing.assert_array_equal(out[:, :num_prefix, :], 0.0)
    np.testing.assert_array_equal(out[:, :, :num_prefix], 0.0)
    np.testing.assert_allclose(
        out[:, num_prefix:, num_prefix:], _reference_bias(grid, 4), rtol=1e-6
    )


def test_without_prefix_argument_prefix_tokens_are_biased():
    """Guards the test above: prefix tokens at position 0 are not zero unless num_prefix says so."""
    pos_TA = positions.grid_positions((3, 3), "integer", num_prefix=1)
    out = np.asarray(alibi.bias({}, pos_TA, pos_TA, num_heads=2))
    assert np.any(out[:, 0, :] != 0.0)


def test_per_example_positions_give_bnts():
    rng = np.random.default_rng(1)
    pos_BTA = jnp.asarray(rng.uniform(0, 5, (3, 6, 2)), jnp.float32)
    pos_BSA = jnp.asarray(rng.uniform(0, 5, (3, 4, 2)), jnp.float32)
    out = alibi.bias({}, pos_BTA, pos_BSA, num_heads=2, num_prefix=1)
    chex.assert_shape(out, (3, 2, 6, 4))
    for b in range(3):
        single = alibi.bias({}, pos_BTA[b], pos_BSA[b], num_heads=2, num_prefix=1)
        np.testing.assert_allclose(np.asarray(out[b]), np.asarray(single), rtol=1e-6)


def test_translation_invariant():
    pos_TA = positions.grid_positions((3, 4), "integer")
    out = alibi.bias({}, pos_TA, pos_TA, num_heads=2)
    shifted = alibi.bias(
        {}, pos_TA + jnp.array([[2.0, -5.0]]), pos_TA + jnp.array([[2.0, -5.0]]), num_heads=2
    )
    np.testing.assert_allclose(np.asarray(shifted), np.asarray(out), atol=1e-5)


def test_learnable_init_and_gradients():
    params = alibi.init(_KEY, num_heads=4, head_dim=8, num_axes=2, learnable=True)
    assert set(params) == {"log_slopes_N"}
    chex.assert_type(params["log_slopes_N"], jnp.float32)
    np.testing.assert_allclose(
        np.exp(np.asarray(params["log_slopes_N"])), alibi.slopes(4), rtol=1e-6
    )
    pos_TA = positions.grid_positions((3, 3), "integer", num_prefix=1)
    fixed = alibi.bias({}, pos_TA, pos_TA, num_heads=4, num_prefix=1)
    learned = alibi.bias(params, pos_TA, pos_TA, num_heads=4, num_prefix=1)
    np.testing.assert_allclose(np.asarray(learned), np.asarray(fixed), rtol=1e-6)

    weights = jnp.asarray(np.random.default_rng(2).normal(size=fixed.shape), jnp.float32)

    def loss(p, pos):
        return jnp.sum(alibi.bias(p, pos, pos, num_heads=4, num_prefix=1) * weights)

    grad_params, grad_pos = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, pos_TA)
    grad_N = np.asarray(grad_params["log_slopes_N"])
    assert np.all(np.isfinite(grad_N)) and np.all(grad_N != 0.0)
    # d bias / d log_slope = bias, so the gradient is <bias_n, weights_n>.
    np.testing.assert_allclose(grad_N, np.sum(np.asarray(fixed * weights), axis=(1, 2)), rtol=1e-5)
    # Positions coincide on the diagonal, where sqrt is not differentiable: still finite.
    assert np.all(np.isfinite(np.asarray(grad_pos)))


def test_fixed_params_are_empty():
    assert alibi.init(_KEY, num_heads=4, head_dim=8, num_axes=2) == {}


def test_init_s_axes_and_head_dim_are_checked():
    params = alibi.init(_KEY, num_heads=4, head_dim=8, num_axes=2)
    pos_TA = jnp.zeros((5, 2))
    with pytest.raises(ValueError, match="num_axes=1 here, but init was given num_axes=2"):
        alibi.bias(params, pos_TA[:, :1], pos_TA[:, :1], num_heads=4)
    with pytest.raises(ValueError, match="head_dim=16 here, but init was given head_dim=8"):
        alibi.precompute(params, pos_TA, num_heads=4, head_dim=16)
    assert alibi.bias(dict(params), pos_TA[:, :1], pos_TA[:, :1], num_heads=4).shape == (4, 5, 5)


def test_learnable_heads_must_match():
    params = alibi.init(_KEY, num_heads=4, head_dim=8, num_axes=2, learnable=True)
    pos_TA = jnp.zeros((5, 2))
    with pytest.raises(ValueError, match="num_heads=6"):
        alibi.bias(params, pos_TA, pos_TA, num_heads=6)


@pytest.mark.parametrize(
    "pos_q, pos_k, match",
    [
        (jnp.zeros((5, 2)), jnp.zeros((5, 3)), "A=2 .* A=3"),
        (jnp.zeros((5,)), jnp.zeros((5,)), r"\(T, A\) or \(B, T, A\), got shape \(5,\)"),
        (jnp.zeros((5, 2)), jnp.zeros((1, 5, 2)), r"shapes \(5, 2\) and \(1, 5, 2\)"),
        (jnp.zeros((2, 5, 2)), jnp.zeros((3, 5, 2)), "B=2 .* B=3"),
        (jnp.zeros((1, 1, 5, 2)), jnp.zeros((1, 1, 5, 2)), r"got shape \(1, 1, 5, 2\)"),
        (jnp.zeros((5, 4)), jnp.zeros((5, 4)), r"A=4 axes .* expected 1 to 3"),
    ],
)
def test_position_errors(pos_q, pos_k, match):
    with pytest.raises(ValueError, match=match):
        alibi.bias({}, pos_q, pos_k, num_heads=2)


@pytest.mark.parametrize("num_prefix, match", [(-1, "num_prefix=-1"), (6, "num_prefix=6")])
def test_bad_num_prefix(num_prefix, match):
    with pytest.raises(ValueError, match=match):
        alibi.bias({}, jnp.zeros((5, 2)), jnp.zeros((5, 2)), num_heads=2, num_prefix=num_prefix)


def test_config_errors():
    with pytest.raises(ValueError, match="num_heads=0"):
        alibi.init(_KEY, num_heads=0, head_dim=8, num_axes=2)
    with pytest.raises(ValueError, match="learnable='yes'"):
        alibi.init(_KEY, num_heads=2, head_dim=8, num_axes=2, learnable="yes")
    with pytest.raises(TypeError):
        alibi.init(_KEY, num_heads=2, head_dim=8, num_axes=2, base=10.0)
    with pytest.raises(ValueError, match="log_slopes_N"):
        alibi.bias({"c_ANH": jnp.zeros(2)}, jnp.zeros((5, 2)), jnp.zeros((5, 2)), num_heads=2)
