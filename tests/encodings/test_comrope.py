"""ComRoPE: the fast path against scipy's expm in float64 and against the per-token expm path,
commutation, the variants' structure, the reference's positions, init, gradients and errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from rope_lie.encodings import comrope, positions

N, B, T = 2, 1, 5

# (variant, block size, axes, head dim): b = 2 closed form, b > 2 through the eigenbases.
SHAPES = [("ld", 2, 2, 8), ("ld", 4, 2, 8), ("ld", 6, 3, 12), ("ap", 2, 3, 12), ("ap", 4, 2, 16)]


def _params(seed, variant, block, num_axes, head_dim, init_std=1.0):
    return comrope.init(
        jax.random.key(seed),
        num_heads=N,
        head_dim=head_dim,
        num_axes=num_axes,
        variant=variant,
        block_size=block,
        init_std=init_std,
    )


def _np_generators(params, variant, num_axes):
    """(A, N, K, b, b) float64 B_ank written from the paper's definitions, not from the code."""
    if variant == "ld":
        raw = np.asarray(params["gen_NKbb"], np.float64)
        skew = raw - np.swapaxes(raw, -1, -2)
        scale = np.asarray(params["scale_AK"], np.float64)
        return scale[:, None, :, None, None] * skew[None]
    raw = np.asarray(params["gen_ANMbb"], np.float64)  # axis a owns blocks k = m A + a
    num_heads, per_axis, block = raw.shape[1], raw.shape[2], raw.shape[-1]
    out = np.zeros((num_axes, num_heads, per_axis * num_axes, block, block))
    for a in range(num_axes):
        for m in range(per_axis):
            out[a, :, m * num_axes + a] = raw[a, :, m] - np.swapaxes(raw[a, :, m], -1, -2)
    return out


def _np_rotate(gen_ANKbb, pos_TA, x_BTNH):
    """x'_t = expm(sum_a p_a B_a) x_t block by block, float64 scipy."""
    block = gen_ANKbb.shape[-1]
    out = np.zeros(x_BTNH.shape)
    for t, p in enumerate(np.asarray(pos_TA, np.float64)):
        for n in range(gen_ANKbb.shape[1]):
            for k in range(gen_ANKbb.shape[2]):
                r = scipy.linalg.expm(np.einsum("a,aij->ij", p, gen_ANKbb[:, n, k]))
                sl = slice(k * block, (k + 1) * block)
                out[:, t, n, sl] = np.einsum("ij,bj->bi", r, x_BTNH[:, t, n, sl])
    return out


def _inputs(seed, num_axes, head_dim):
    rng = np.random.default_rng(seed)
    pos_TA = rng.uniform(-1.5, 1.5, (T, num_axes)).astype(np.float32)
    x_BTNH = rng.standard_normal((B, T, N, head_dim)).astype(np.float32)
    return pos_TA, x_BTNH


@pytest.mark.parametrize("variant,block,num_axes,head_dim", SHAPES)
def test_fast_path_is_expm_up_to_the_fixed_eigenbasis(variant, block, num_axes, head_dim):
    # P^T R'(p) x = expm(sum_a p_a A_a) x, against scipy in float64.
    params = _params(0, variant, block, num_axes, head_dim)
    pos_TA, x_BTNH = _inputs(1, num_axes, head_dim)
    out = np.asarray(comrope.apply(params, x_BTNH, pos_TA, variant=variant), np.float64)
    _, q_NKbb = comrope.spectra(params, variant=variant)
    q = np.asarray(q_NKbb, np.float64)
    back = np.einsum("nkij,btnkj->btnki", q, out.reshape(B, T, N, -1, block)).reshape(out.shape)
    want = _np_rotate(_np_generators(params, variant, num_axes), pos_TA, x_BTNH)
    np.testing.assert_allclose(back, want, rtol=0, atol=5e-5)
    # Q is orthogonal (to float32 eigenvector accuracy).
    qtq = np.einsum("nkji,nkjl->nkil", q, q)
    np.testing.assert_allclose(qtq, np.broadcast_to(np.eye(block), qtq.shape), atol=1e-5)


@pytest.mark.parametrize("variant,block,num_axes,head_dim", SHAPES)
def test_logits_equal_the_per_token_expm_logits(variant, block, num_axes, head_dim):
    # What attention sees: <R(p) q, R(p') k> from the fast path and from scipy's expm.
    params = _params(2, variant, block, num_axes, head_dim)
    pos_TA, q_BTNH = _inputs(3, num_axes, head_dim)
    _, k_BTNH = _inputs(4, num_axes, head_dim)
    fast = jnp.einsum(
        "BTNH,BSNH->BNTS",
        comrope.apply(params, q_BTNH, pos_TA, variant=variant),
        comrope.apply(params, k_BTNH, pos_TA, variant=variant),
    )
    gen = _np_generators(params, variant, num_axes)
    want = np.einsum(
        "btnh,bsnh->bnts", _np_rotate(gen, pos_TA, q_BTNH), _np_rotate(gen, pos_TA, k_BTNH)
    )
    np.testing.assert_allclose(fast, want, rtol=0, atol=2e-4)


@pytest.mark.parametrize("variant", ["ld", "ap"])
def test_the_expm_path_is_the_reference_rotation(variant):
    params = _params(5, variant, 4, 2, 8)
    pos_TA, _ = _inputs(6, 2, 8)
    r = np.asarray(comrope.rotations_expm(params, pos_TA, variant=variant), np.float64)
    gen = _np_generators(params, variant, 2)
    want = np.stack(
        [
            [
                [scipy.linalg.expm(np.einsum("a,aij->ij", p, gen[:, n, k])) for k in range(2)]
                for n in range(N)
            ]
            for p in pos_TA.astype(np.float64)
        ]
    )
    np.testing.assert_allclose(r, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", ["ld", "ap"])
def test_generators_commute_within_each_block_and_not_across_random_blocks(variant):
    gen = _np_generators(_params(7, variant, 4, 3, 24), variant, 3)
    for a in range(3):
        for c in range(3):
            np.testing.assert_allclose(gen[a] @ gen[c], gen[c] @ gen[a], atol=1e-9)
    # The commutation is the construction's: two random skew blocks do not commute.
    s0, s1 = gen[0, 0, 0], gen[1, 0, 0] if variant == "ld" else gen[1, 0, 1]
    if variant == "ld":
        s1 = np.asarray(_params(8, variant, 4, 3, 24)["gen_NKbb"][0, 0], np.float64)
        s1 = s1 - s1.T
    assert np.abs(s0 @ s1 - s1 @ s0).max() > 1e-2


def test_ap_blocks_see_only_their_axis():
    # Moving along axis 1 changes only the blocks k = 1 (mod 2) of ComRoPE-AP.
    params = _params(9, "ap", 4, 2, 16)
    pos_TA, x_BTNH = _inputs(10, 2, 16)
    moved = pos_TA + np.array([0.0, 0.7], np.float32)
    a = comrope.apply(params, x_BTNH, pos_TA, variant="ap").reshape(B, T, N, 4, 4)
    b = comrope.apply(params, x_BTNH, moved, variant="ap").reshape(B, T, N, 4, 4)
    np.testing.assert_allclose(a[..., 0::2, :], b[..., 0::2, :], atol=1e-6)
    assert float(jnp.max(jnp.abs(a[..., 1::2, :] - b[..., 1::2, :]))) > 1e-2


def test_ld_with_one_axis_scale_is_an_axis_aligned_rotation():
    # LD with scale (1, 0): axis 1 does nothing.
    params = _params(11, "ld", 4, 2, 8)
    params["scale_AK"] = jnp.asarray([[1.0, -0.5], [0.0, 0.0]])
    pos_TA, x_BTNH = _inputs(12, 2, 8)
    moved = pos_TA + np.array([0.0, 3.0], np.float32)
    np.testing.assert_allclose(
        comrope.apply(params, x_BTNH, moved),
        comrope.apply(params, x_BTNH, pos_TA),
        rtol=1e-5,
        atol=1e-6,
    )


def test_reference_positions_give_the_unit_centred_logits():
    # The reference's (i + 0.5) / n with the class token at 0.5 = "unit_centred" + 1/2: equal
    # logits, the common shift cancelling.
    grid = (3, 4)
    ours = positions.grid_positions(grid, "unit_centred", num_prefix=1)
    ii, jj = np.meshgrid(np.arange(3), np.arange(4), indexing="ij")
    ref = np.stack([(ii.ravel() + 0.5) / 3, (jj.ravel() + 0.5) / 4], -1)
    ref = np.concatenate([[[0.5, 0.5]], ref]).astype(np.float32)
    np.testing.assert_allclose(np.asarray(ours) + 0.5, ref, atol=1e-7)
    params = _params(13, "ld", 4, 2, 8)
    rng = np.random.default_rng(14)
    q, k = (rng.standard_normal((B, 13, N, 8)).astype(np.float32) for _ in range(2))

    def logits(pos):
        return jnp.einsum(
            "BTNH,BSNH->BNTS", comrope.apply(params, q, pos), comrope.apply(params, k, pos)
        )

    np.testing.assert_allclose(logits(ours), logits(ref), atol=2e-5)


def test_init_follows_the_reference():
    params = comrope.init(
        jax.random.key(0),
        num_heads=64,
        head_dim=32,
        num_axes=2,
        variant="ld",
        block_size=8,
        init_std=0.5,
    )
    assert params["gen_NKbb"].shape == (64, 4, 8, 8) and params["scale_AK"].shape == (2, 4)
    assert abs(float(jnp.std(params["gen_NKbb"])) - 0.5) < 0.02
    ap = comrope.init(
        jax.random.key(0), num_heads=3, head_dim=24, num_axes=3, variant="ap", block_size=4
    )
    assert set(ap) == {"gen_ANMbb"} and ap["gen_ANMbb"].shape == (3, 3, 2, 4, 4)


def test_fast_and_expm_paths_have_the_same_gradients():
    params = _params(15, "ld", 4, 2, 8, init_std=0.5)
    pos_TA, q_BTNH = _inputs(16, 2, 8)
    _, k_BTNH = _inputs(17, 2, 8)

    def loss_fast(p):
        q = comrope.apply(p, q_BTNH, pos_TA)
        k = comrope.apply(p, k_BTNH, pos_TA)
        return jnp.sum(jnp.sin(jnp.einsum("BTNH,BSNH->BNTS", q, k)))

    def loss_expm(p):
        r = comrope.rotations_expm(p, pos_TA)

        def rot(x):
            xb = x.reshape(*x.shape[:3], -1, 4)
            return jnp.einsum("TNKij,BTNKj->BTNKi", r, xb).reshape(x.shape)

        return jnp.sum(jnp.sin(jnp.einsum("BTNH,BSNH->BNTS", rot(q_BTNH), rot(k_BTNH))))

    # One program, not the two gradients op by op.
    fast, slow = jax.jit(lambda p: (jax.grad(loss_fast)(p), jax.grad(loss_expm)(p)))(params)
    for key in params:
        assert np.all(np.isfinite(fast[key]))
        np.testing.assert_allclose(
            fast[key], slow[key], rtol=2e-3, atol=2e-3 * float(jnp.max(jnp.abs(slow[key])))
        )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_size=3, head_dim=12), "block_size=3 must be even"),
        (dict(block_size=4, head_dim=12, variant="ap"), "num_axes\\*block_size=8"),
        (dict(block_size=4, head_dim=12, variant="xy"), "variant='xy'"),
        (dict(block_size=4, head_dim=8, init_std=-1.0), "init_std=-1.0"),
    ],
)
def test_bad_configurations_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        comrope.init(jax.random.key(0), num_heads=1, num_axes=2, **kwargs)


def test_params_of_the_other_variant_are_named():
    params = _params(0, "ap", 2, 2, 8)
    with pytest.raises(
        ValueError, match="variant='ld' was passed, but init was given variant='ap'"
    ):
        comrope.precompute(params, np.zeros((3, 2)), num_heads=N, head_dim=8, variant="ld")
    with pytest.raises(ValueError, match="variant='ld' expects params"):  # a plain dict
        comrope.precompute(dict(params), np.zeros((3, 2)), num_heads=N, head_dim=8, variant="ld")
