"""LieRE: against scipy's expm in float64, group properties, reductions to RoPE-Mixed,
distinct-position rotations, leftover channels, init, gradients and errors. What every family
owes (translation invariance or its absence, per-example positions, precompute equal to apply)
is checked in test_contract.py."""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from rope_lie.encodings import expm, lie, liere, rope_mixed, state

N, B, T = 2, 2, 6

# Jitted once per shape: eager op-by-op dispatch would compile every primitive separately.
_apply = jax.jit(liere.apply)
_rotations = jax.jit(liere.rotations)
_rotations_and_apply = jax.jit(
    lambda params, x, pos: (liere.rotations(params, pos), liere.apply(params, x, pos))
)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _x(seed: int, head_dim: int, t: int = T) -> np.ndarray:
    return _rng(seed).standard_normal((B, t, N, head_dim)).astype(np.float32)


def _pos(seed: int, shape, lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return _rng(seed).uniform(lo, hi, shape).astype(np.float32)


def _init(seed: int, head_dim: int = 8, num_axes: int = 2, **hparams):
    return liere.init(
        jax.random.key(seed), num_heads=N, head_dim=head_dim, num_axes=num_axes, **hparams
    )


def _params(
    seed: int, head_dim: int = 8, num_axes: int = 2, block_size=None, init_scale=2 * math.pi
):
    """Parameters as ``init`` draws them (U[0, init_scale)), from numpy: compiling the PRNG for
    every shape would dominate the run time; ``init`` itself is tested below."""
    b = block_size or head_dim
    shape = (num_axes, N, head_dim // b, b, b)
    return {"gen_ANKbb": jnp.asarray(_rng(seed).uniform(0.0, init_scale, shape), jnp.float32)}


def _dense_generators(gen_ANKbb, head_dim: int) -> np.ndarray:
    """(A, N, H, H) float64 skew generators from raw blocks, written from the paper's formula."""
    gen = np.asarray(gen_ANKbb, np.float64)
    num_blocks, block = gen.shape[2], gen.shape[-1]
    out = np.zeros((*gen.shape[:2], head_dim, head_dim))
    for r in range(num_blocks):
        upper = np.triu(gen[:, :, r], k=1)
        out[:, :, r * block : (r + 1) * block, r * block : (r + 1) * block] = upper - np.swapaxes(
            upper, -1, -2
        )
    return out


def _reference_r(gen_ANKbb, head_dim: int, pos_TA) -> np.ndarray:
    """(T, N, H, H) float64 R(p) = expm(sum_a p_a G_a) by scipy."""
    g = _dense_generators(gen_ANKbb, head_dim)
    pos = np.asarray(pos_TA, np.float64)
    out = np.zeros((pos.shape[0], g.shape[1], head_dim, head_dim))
    for t in range(pos.shape[0]):
        for n in range(g.shape[1]):
            out[t, n] = scipy.linalg.expm(np.einsum("a,aij->ij", pos[t], g[:, n]))
    return out


def _dense_from_blocks(r_XNKbb, head_dim: int) -> np.ndarray:
    """Embed block rotations into (..., H, H) with identity on leftover channels."""
    r = np.asarray(r_XNKbb, np.float64)
    num_blocks, block = r.shape[-3], r.shape[-1]
    out = np.broadcast_to(np.eye(head_dim), (*r.shape[:-3], head_dim, head_dim)).copy()
    for k in range(num_blocks):
        out[..., k * block : (k + 1) * block, k * block : (k + 1) * block] = r[..., k, :, :]
    return out


@pytest.mark.parametrize(
    "head_dim, block_size, num_axes",
    [(8, None, 1), (8, None, 3), (8, 4, 2), (8, 3, 3), (10, 4, 1), (7, None, 2)],
)
def test_matches_scipy_expm(head_dim, block_size, num_axes):
    params = _params(0, head_dim, num_axes, block_size=block_size)
    pos_TA = _pos(1, (T, num_axes), -1.5, 1.5)
    ref_TNHH = _reference_r(params["gen_ANKbb"], head_dim, pos_TA)
    x = _x(2, head_dim)
    r, out = _rotations_and_apply(params, x, pos_TA)
    np.testing.assert_allclose(_dense_from_blocks(r, head_dim), ref_TNHH, atol=2e-4)
    ref_x = np.einsum("tnij,btnj->btni", ref_TNHH, x.astype(np.float64))
    np.testing.assert_allclose(out, ref_x, atol=5e-4)


# Per-example positions of 5 examples of 2 tokens: their exponentials run on 2, 8 or 10 rows
# (``liere._row_tiers``), the first count that holds the batch's distinct positions.
SHARED_B, SHARED_T = 5, 2


def _positions_with_distinct(count: int, seed: int) -> jax.Array:
    """(SHARED_B, SHARED_T, 2) positions that take exactly ``count`` distinct values."""
    rng = _rng(seed)
    points = rng.uniform(-2.0, 2.0, (count, 2))
    slots = SHARED_B * SHARED_T
    which = np.concatenate([np.arange(count), rng.integers(0, count, slots - count)])
    pos = points[rng.permutation(which)].reshape(SHARED_B, SHARED_T, 2)
    return jnp.asarray(pos, jnp.float32)


def test_row_tiers_are_t_times_powers_of_4_then_every_slot():
    assert liere._row_tiers(8, 5) == (5, 20, 40)
    assert liere._row_tiers(SHARED_B, SHARED_T) == (2, 8, 10)  # the tiers the test below hits
    assert liere._row_tiers(16, 101) == (101, 404, 1616)
    assert liere._row_tiers(4, 3) == (3, 12)
    assert liere._row_tiers(1, 7) == (7,)


def _shared_state(gen, pos):
    return liere.precompute({"gen_ANKbb": gen}, pos, num_heads=N, head_dim=8)


def _per_token_state(gen, pos):  # one exponential per token: the reference
    return state.BlockRotations(liere._rotations(gen, pos))


@functools.partial(jax.jit, static_argnums=0)
def _rotations_value_and_grad(state_fn, gen, pos, x, w):
    """The rotations ``state_fn(gen, pos)``, x rotated by them, and sum(w * that) with its
    gradient in gen: one program per state function and shape, shared by the cases."""

    def loss(g):
        return jnp.sum(w * state_fn(g, pos).rotate(x))

    pe = state_fn(gen, pos)
    return (pe.r_TNKbb, pe.rotate(x), *jax.value_and_grad(loss)(gen))


@pytest.mark.parametrize("block_size", [None, 4])
@pytest.mark.parametrize("distinct", [1, 2, 5, 10])  # the rows run on: 2, 2, 8, 10
def test_per_example_rotations_once_per_distinct_position_equal_per_token(block_size, distinct):
    """Rotations computed once per distinct position and gathered equal one exponential per
    token (``liere._rotations`` on every slot, the reference), to float32 rounding, in the
    rotations, the rotated q or k, and the generators' gradients, whichever row count holds
    the batch's distinct positions (a count equal to a tier's included)."""
    params = _params(3, block_size=block_size)
    gen = params["gen_ANKbb"]
    pos_BTA = _positions_with_distinct(distinct, seed=distinct)
    assert len(np.unique(np.asarray(pos_BTA).reshape(-1, 2), axis=0)) == distinct
    x = _rng(4).standard_normal((SHARED_B, SHARED_T, N, 8)).astype(np.float32)
    w = _rng(5).standard_normal(x.shape).astype(np.float32)
    r, out, value, grad = _rotations_value_and_grad(_shared_state, gen, pos_BTA, x, w)
    ref = _rotations_value_and_grad(_per_token_state, gen, pos_BTA, x, w)
    ref_r, ref_out, ref_value, ref_grad = ref
    np.testing.assert_allclose(r, ref_r, atol=2e-6)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_allclose(value, ref_value, atol=1e-4)  # a sum of 160 terms
    np.testing.assert_allclose(grad, ref_grad, atol=1e-4, rtol=1e-5)


def test_shared_positions_and_one_example_keep_the_per_token_path():
    """An image batch's positions pos_TA (and a single example's) are not deduplicated: the
    same jitted computation as before, so the same numbers."""
    params = _params(6, block_size=4)
    pos_TA = _pos(7, (T, 2), 0.0, 3.0)
    for pos in (pos_TA, pos_TA[None]):
        np.testing.assert_array_equal(
            liere.rotations(params, pos), liere._rotations(params["gen_ANKbb"], jnp.asarray(pos))
        )
        pe = liere.precompute(params, pos, num_heads=N, head_dim=8)
        assert type(pe) is state.BlockRotations  # blocks larger than 2: matrices


def test_per_example_positions_take_no_gradient():
    """Tokens at one position share one exponential: a position gradient is an error that
    says what to do instead, not a silently wrong one."""
    params = _params(8, block_size=4)
    pos_BTA = _positions_with_distinct(6, seed=9)
    # Under jit the error comes while tracing the gradient, before anything compiles.
    position_grad = jax.jit(jax.grad(lambda pos: jnp.sum(liere.rotations(params, pos))))
    with pytest.raises(ValueError, match="per-example positions pos_BTA .* take no gradient"):
        position_grad(pos_BTA)
    assert np.isfinite(position_grad(pos_BTA[0])).all()  # pos_TA


@pytest.mark.parametrize("block_size", [None, 4, 2])
def test_group_properties(block_size):
    params = _params(3, block_size=block_size)
    pos_TA = _pos(4, (T, 2))
    r = np.asarray(_rotations(params, pos_TA), np.float64)
    r2 = _rotations(params, 2 * pos_TA)
    r_neg = _rotations(params, -pos_TA)
    eye = np.broadcast_to(np.eye(r.shape[-1]), r.shape)
    np.testing.assert_allclose(r2, r @ r, atol=1e-4)
    np.testing.assert_allclose(r @ r_neg, eye, atol=1e-4)
    np.testing.assert_allclose(np.swapaxes(r, -1, -2) @ r, eye, atol=1e-5)
    np.testing.assert_allclose(_rotations(params, np.zeros((T, 2), np.float32)), eye, atol=1e-6)


def _block2_generators(g_ANF) -> np.ndarray:
    """(A, N, H, H) block-diagonal generators with [[0, g], [-g, 0]] on pairs (2j, 2j+1)."""
    g = np.asarray(g_ANF, np.float64)
    num_pairs = g.shape[-1]
    out = np.zeros((*g.shape[:2], 2 * num_pairs, 2 * num_pairs))
    j = np.arange(num_pairs)
    out[:, :, 2 * j, 2 * j + 1] = g
    out[:, :, 2 * j + 1, 2 * j] = -g
    return out


@pytest.mark.parametrize("num_axes", [1, 2, 3])
def test_block2_is_rope_mixed(num_axes):
    g_ANF = 2.0 * _rng(5).standard_normal((num_axes, N, 4))
    params = liere.params_from_generators(_block2_generators(g_ANF), block_size=2)
    # Upper entry g rotates pair (2j, 2j+1) by -g*t: RoPE-Mixed frequency -g.
    mixed = rope_mixed.params_from_freqs(-g_ANF)
    pos_TA = _pos(6, (T, num_axes), 0.0, 4.0)
    x = _x(7, 8)
    got = _apply(params, x, pos_TA)
    np.testing.assert_allclose(got, rope_mixed.apply(mixed, x, pos_TA), atol=1e-5)
    # The same frequencies with the other sign differ: the test sees the sign.
    wrong = rope_mixed.apply(rope_mixed.params_from_freqs(g_ANF), x, pos_TA)
    assert np.max(np.abs(got - wrong)) > 1e-2


@pytest.mark.parametrize("pos_shape", [(T, 2), (B, T, 2)])
def test_block2_closed_form_equals_expm(pos_shape):
    params = _params(8, block_size=2)
    pos = _pos(9, pos_shape, -3.0, 3.0)
    skew = lie.skew_from_upper(params["gen_ANKbb"])
    spec = "TA,ANKij->TNKij" if len(pos_shape) == 2 else "BTA,ANKij->BTNKij"
    r_expm = expm.expm_skew(jnp.einsum(spec, pos, skew, precision="highest"))
    np.testing.assert_allclose(_rotations(params, pos), r_expm, atol=2e-5)
    x = _x(10, 8)
    np.testing.assert_allclose(_apply(params, x, pos), lie.apply_blocks(x, r_expm), atol=5e-5)
    # The state of the closed form is its pair angles, not 2 x 2 matrices.
    assert type(liere.precompute(params, pos, num_heads=N, head_dim=8)) is state.PairAngles


@pytest.mark.parametrize("head_dim, block_size", [(8, 3), (10, 4), (9, 2), (7, 5)])
def test_leftover_channels_unchanged(head_dim, block_size):
    params = _params(16, head_dim, block_size=block_size)
    used = (head_dim // block_size) * block_size
    x = _x(18, head_dim)
    out = np.asarray(_apply(params, x, _pos(17, (T, 2), 0.0, 3.0)))
    np.testing.assert_array_equal(out[..., used:], x[..., used:])
    assert np.max(np.abs(out[..., :used] - x[..., :used])) > 1e-2


@pytest.mark.parametrize("init_scale", [2 * math.pi, 1.0])
def test_init_distribution(init_scale):
    params = liere.init(
        jax.random.key(19),
        num_heads=4,
        head_dim=16,
        num_axes=3,
        block_size=8,
        init_scale=init_scale,
    )
    gen = np.asarray(params["gen_ANKbb"])
    chex.assert_shape(gen, (3, 4, 2, 8, 8))
    assert gen.dtype == np.float32
    assert gen.min() >= 0.0 and gen.max() < init_scale
    # U[0, s): mean s/2, std s/sqrt(12), over 1536 draws.
    np.testing.assert_allclose(gen.mean(), init_scale / 2, rtol=0.05)
    np.testing.assert_allclose(gen.std(), init_scale / math.sqrt(12), rtol=0.05)
    other = liere.init(jax.random.key(20), num_heads=4, head_dim=16, num_axes=3, block_size=8)
    assert not np.allclose(other["gen_ANKbb"], gen)


def test_only_strict_upper_triangle_matters():
    params = _params(21, block_size=4)
    noise = _rng(22).standard_normal(params["gen_ANKbb"].shape).astype(np.float32)
    pos_TA = _pos(23, (T, 2), 0.0, 2.0)
    x = _x(24, 8)
    ref = _apply(params, x, pos_TA)
    changed = {"gen_ANKbb": params["gen_ANKbb"] + np.tril(noise)}  # diagonal and below
    np.testing.assert_array_equal(_apply(changed, x, pos_TA), ref)
    upper = {"gen_ANKbb": params["gen_ANKbb"] + np.triu(noise, 1)}
    assert np.max(np.abs(_apply(upper, x, pos_TA) - ref)) > 1e-2


def test_params_from_generators_round_trip():
    params = _params(25, block_size=4)
    dense = _dense_generators(params["gen_ANKbb"], 8)
    rebuilt = liere.params_from_generators(dense, block_size=4)
    chex.assert_shape(rebuilt["gen_ANKbb"], (2, N, 2, 4, 4))
    pos_TA = _pos(26, (T, 2))
    np.testing.assert_allclose(_rotations(rebuilt, pos_TA), _rotations(params, pos_TA), atol=1e-6)
    dense_params = liere.params_from_generators(dense)
    chex.assert_shape(dense_params["gen_ANKbb"], (2, N, 1, 8, 8))
    np.testing.assert_allclose(
        _dense_from_blocks(_rotations(dense_params, pos_TA), 8),
        _dense_from_blocks(_rotations(params, pos_TA), 8),
        atol=1e-5,
    )


@pytest.mark.parametrize("block_size", [None, 4, 2])
def test_large_generators_stay_finite_and_orthogonal(block_size):
    params = _params(27, block_size=block_size, init_scale=1e3)
    pos_TA = _pos(28, (T, 2), -4.0, 4.0)
    gen_TNHH = np.einsum("ta,anij->tnij", pos_TA, _dense_generators(params["gen_ANKbb"], 8))
    assert np.linalg.norm(gen_TNHH, axis=(-2, -1)).max() > 1e4  # the regime under test
    r = np.asarray(_rotations(params, pos_TA), np.float64)
    chex.assert_tree_all_finite(r)
    eye = np.broadcast_to(np.eye(r.shape[-1]), r.shape)
    np.testing.assert_allclose(np.swapaxes(r, -1, -2) @ r, eye, atol=1e-3)
    x = _x(29, 8)
    out = _apply(params, x, pos_TA)
    chex.assert_tree_all_finite(out)
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-3)
    grad = _grad_loss(params, x, x, pos_TA)
    chex.assert_tree_all_finite(grad)


def _loss(params, x, w, pos_TA):
    return jnp.sum(liere.apply(params, x, pos_TA) * w)


_grad_loss = jax.jit(jax.grad(_loss))


def _loss_ref(gen_ANKbb, x, w, pos_TA) -> float:
    r = _reference_r(gen_ANKbb, x.shape[-1], pos_TA)
    return float(np.sum(np.einsum("tnij,btnj->btni", r, x) * w))


@pytest.mark.parametrize("block_size", [None, 4, 2])
def test_gradient_matches_float64_finite_differences(block_size):
    params = _params(30, block_size=block_size, init_scale=1.0)
    pos_TA = _pos(31, (T, 2))
    x, w = _x(32, 8), _x(33, 8)
    grad = np.asarray(_grad_loss(params, x, w, pos_TA)["gen_ANKbb"], np.float64)
    chex.assert_tree_all_finite(grad)
    upper = np.triu(np.ones(grad.shape[-2:]), k=1)
    assert np.max(np.abs(grad * upper)) > 1e-3
    # Entries that the skew part ignores get no gradient.
    np.testing.assert_array_equal(grad * (1 - upper), 0.0)
    gen64 = np.asarray(params["gen_ANKbb"], np.float64)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    direction = _rng(34).standard_normal(gen64.shape) * upper
    eps = 1e-6
    fd = (
        _loss_ref(gen64 + eps * direction, x64, w64, pos_TA)
        - _loss_ref(gen64 - eps * direction, x64, w64, pos_TA)
    ) / (2 * eps)
    np.testing.assert_allclose(np.sum(grad * direction), fd, rtol=2e-3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"block_size": 1}, "block_size=1 must be in \\[2, head_dim=8\\]"),
        ({"block_size": 0}, "block_size=0"),
        ({"block_size": 9}, "block_size=9 must be in \\[2, head_dim=8\\]"),
        ({"block_size": 4.0}, "block_size=4.0"),
        ({"block_size": True}, "block_size=True"),
        ({"init_scale": -1.0}, "init_scale=-1.0"),
        ({"init_scale": float("nan")}, "init_scale=nan"),
        ({"num_heads": 0}, "num_heads=0"),
        ({"block_size": 3}, "head_dim=8 is not divisible by block_size=3: the last 2 channels"),
        ({"block_size": 5, "partial_blocks": False}, "or set partial_blocks=True"),
    ],
)
def test_init_errors(kwargs, match):
    args = {"num_heads": N, "head_dim": 8, "num_axes": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        liere.init(jax.random.key(0), **args)


def test_partial_blocks_leave_the_remainder_unrotated_when_asked():
    params = liere.init(
        jax.random.key(0), num_heads=N, head_dim=10, num_axes=2, block_size=4, partial_blocks=True
    )
    assert params["gen_ANKbb"].shape == (2, N, 2, 4, 4)
    x_BTNH = _rng(1).standard_normal((1, T, N, 10)).astype(np.float32)
    pos_TA = _pos(2, (T, 2), -1.5, 1.5)
    out = np.asarray(liere.apply(params, jnp.asarray(x_BTNH), pos_TA))
    np.testing.assert_array_equal(out[..., 8:], x_BTNH[..., 8:])  # the 2 leftover channels
    assert np.max(np.abs(out[..., :8] - x_BTNH[..., :8])) > 1e-3


def test_init_errors_head_dim_one_dense():
    with pytest.raises(ValueError, match="head_dim=1"):
        liere.init(jax.random.key(0), num_heads=N, head_dim=1, num_axes=2)


@pytest.mark.parametrize("block_size, shape", [(None, (2, N, 1, 8, 8)), (3, (2, N, 2, 3, 3))])
def test_init_shapes_dense_and_odd_block(block_size, shape):
    partial = {"partial_blocks": True} if block_size == 3 else {}  # 3 leaves 2 of 8 channels
    gen = _init(0, block_size=block_size, **partial)["gen_ANKbb"]
    chex.assert_shape(gen, shape)
    assert gen.dtype == jnp.float32


def test_params_from_generators_errors():
    skew = _dense_generators(_rng(0).uniform(size=(2, N, 1, 8, 8)), 8)
    not_skew = skew.copy()
    not_skew[0, 0, 1, 2] += 0.5
    with pytest.raises(ValueError, match="not skew-symmetric: max \\|G \\+ G\\^T\\| = 0.5"):
        liere.params_from_generators(not_skew)
    with pytest.raises(ValueError, match="outside the diagonal 4x4 blocks"):
        liere.params_from_generators(skew, block_size=4)
    with pytest.raises(ValueError, match="got shape \\(2, 8, 8\\)"):
        liere.params_from_generators(skew[0])
    with pytest.raises(ValueError, match="got shape \\(2, 2, 8, 7\\)"):
        liere.params_from_generators(skew[..., :7])
    with pytest.raises(ValueError, match="block_size=1"):
        liere.params_from_generators(skew, block_size=1)
    # Leftover channels (8 = 2*3 + 2) must carry no generator entries.
    dense3 = _dense_generators(_params(1, block_size=3)["gen_ANKbb"], 8)
    chex.assert_shape(
        liere.params_from_generators(dense3, block_size=3)["gen_ANKbb"], (2, N, 2, 3, 3)
    )
    dense3[..., 6, 7], dense3[..., 7, 6] = 1.0, -1.0
    with pytest.raises(ValueError, match="outside the diagonal 3x3 blocks"):
        liere.params_from_generators(dense3, block_size=3)


def test_apply_errors():
    params = _params(0, block_size=4)
    x = _x(1, 8)
    with pytest.raises(ValueError, match="A=3 axes .* num_axes=2"):
        liere.apply(params, x, np.zeros((T, 3), np.float32))
    with pytest.raises(ValueError, match="T=5 tokens but x has T=6"):
        liere.apply(params, x, np.zeros((5, 2), np.float32))
    with pytest.raises(ValueError, match="x has \\(N, H\\)=\\(2, 12\\)"):
        liere.apply(params, _x(1, 12), np.zeros((T, 2), np.float32))
    with pytest.raises(ValueError, match="x has \\(N, H\\)=\\(3, 8\\)"):
        liere.apply(params, np.zeros((B, T, 3, 8), np.float32), np.zeros((T, 2), np.float32))
    with pytest.raises(ValueError, match="rank 4"):
        liere.apply(params, x[0], np.zeros((T, 2), np.float32))


def test_precompute_errors():
    params, pos = _params(46, block_size=4), _pos(47, (T, 2))
    for heads, head_dim in [(N + 1, 8), (N, 4), (N, 12)]:
        with pytest.raises(ValueError, match=f"num_heads={heads}, head_dim={head_dim} do not fit"):
            liere.precompute(params, pos, num_heads=heads, head_dim=head_dim)
    with pytest.raises(ValueError, match="positions have A=3 axes but .* num_axes=2"):
        liere.precompute(params, _pos(47, (T, 3)), num_heads=N, head_dim=8)


@pytest.mark.parametrize("norm", [1e-3, 1.0, 1e2, 1e3])
def test_dense_64_rotations_accurate_over_norms(norm):
    # ViT-B head size: max |R - R_f64| and max |R^T R - I| within 1e-4 up to norm 1e3.
    rng = _rng(49)
    gen = rng.uniform(0.0, 2 * math.pi, (2, 1, 1, 64, 64))
    skew = _dense_generators(gen, 64)
    gen = gen / np.linalg.norm(skew[:, 0], axis=(-2, -1)).max() * norm
    params = {"gen_ANKbb": jnp.asarray(gen, jnp.float32)}
    pos_TA = np.array([[0.0, 0.0], [1.0, 0.0], [0.3, 0.9], [1.0, 1.0]], np.float32)
    r = np.asarray(_rotations(params, pos_TA), np.float64)[:, 0, 0]
    ref = _reference_r(params["gen_ANKbb"], 64, pos_TA)[:, 0]
    np.testing.assert_allclose(r, ref, rtol=0, atol=1e-4)
    np.testing.assert_allclose(
        np.swapaxes(r, -1, -2) @ r, np.broadcast_to(np.eye(64), r.shape), atol=1e-4
    )
