"""Cayley-STRING: float64 references per generator, reduction to RoPE-Mixed at S = 0, closed
form, sparsity structure, relativity, the order of P and RoPE, folding, gradients and errors."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie.encodings import cayley_string, lie, rope_mixed, state

N, B, T, H = 2, 2, 6, 8
GENERATORS = ["dense", "block2x2", "banded", "topk"]
HPARAMS = {"dense": {}, "block2x2": {}, "banded": {"bandwidth": 2}, "topk": {"k": 12}}
KEYS = {
    "dense": "s_dense_NHH",
    "block2x2": "s_block2x2_NF",
    "banded": "s_banded_NWH",
    "topk": "s_topk_NHH",
}

# Jitted once per shape: eager op-by-op dispatch would compile every primitive separately.
_apply = jax.jit(cayley_string.apply, static_argnames="k")
_orthogonal = jax.jit(cayley_string.orthogonal, static_argnames="k")
_generator = jax.jit(cayley_string.generator, static_argnames="k")
_rope_apply = jax.jit(rope_mixed.apply)
_fold = jax.jit(cayley_string.fold, static_argnames="k")


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _x(seed: int, head_dim: int = H) -> np.ndarray:
    return _rng(seed).standard_normal((B, T, N, head_dim)).astype(np.float32)


def _pos(seed: int, shape=(T, 2), lo: float = -2.0, hi: float = 2.0) -> np.ndarray:
    return _rng(seed).uniform(lo, hi, shape).astype(np.float32)


def _init(seed: int, generator: str, init_std: float = 0.5, num_axes: int = 2, **extra):
    hparams = {**HPARAMS[generator], **extra}
    return cayley_string.init(
        jax.random.key(seed),
        num_heads=N,
        head_dim=H,
        num_axes=num_axes,
        generator=generator,
        init_std=init_std,
        **hparams,
    )


def _params(seed: int, generator: str, init_std: float = 0.5, num_axes: int = 2, bandwidth=2):
    """Parameters as ``init`` draws them, the generator from numpy: compiling the PRNG for every
    shape would dominate the run time; ``init`` itself is tested below."""
    freqs = rope_mixed.init(jax.random.key(seed), num_heads=N, head_dim=H, num_axes=num_axes)
    shape = {
        "dense": (N, H, H),
        "block2x2": (N, H // 2),
        "banded": (N, bandwidth, H),
        "topk": (N, H, H),
    }[generator]
    s = init_std * _rng(seed).standard_normal(shape)
    if generator == "banded":
        for d in range(1, bandwidth + 1):
            s[:, d - 1, H - d :] = 0.0  # A_{i, i+d} does not exist for i + d >= H
    return {**freqs, KEYS[generator]: jnp.asarray(s, jnp.float32)}


def _k(generator: str):
    return HPARAMS[generator].get("k")


def _skew_reference(params, generator: str) -> np.ndarray:
    """S per head in float64, written from the formulas (not from the code under test)."""
    if generator == "dense":
        upper = np.triu(np.asarray(params["s_dense_NHH"], np.float64), k=1)
        return upper - np.swapaxes(upper, -1, -2)
    if generator == "block2x2":
        a = np.asarray(params["s_block2x2_NF"], np.float64)
        half = a.shape[-1]
        s = np.zeros((a.shape[0], 2 * half, 2 * half))
        for j in range(half):  # plane (j, j + H/2)
            s[:, j, j + half], s[:, j + half, j] = a[:, j], -a[:, j]
        return s
    if generator == "banded":
        raw = np.asarray(params["s_banded_NWH"], np.float64)
        head_dim = raw.shape[-1]
        a = np.zeros((raw.shape[0], head_dim, head_dim))
        for d in range(1, raw.shape[1] + 1):
            for i in range(head_dim - d):
                a[:, i, i + d] = raw[:, d - 1, i]
        return a - np.swapaxes(a, -1, -2)
    return _topk_reference(np.asarray(params["s_topk_NHH"], np.float64), _k(generator))


def _topk_reference(a_NHH: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros_like(a_NHH)
    head_dim = a_NHH.shape[-1]
    off = [(i, j) for i in range(head_dim) for j in range(head_dim) if i != j]
    for n in range(a_NHH.shape[0]):
        ranked = sorted(off, key=lambda ij: -abs(a_NHH[n][ij]))[:k]
        mask = np.zeros((head_dim, head_dim), bool)
        for i, j in ranked:
            mask[i, j] = mask[j, i] = True
        masked = np.where(mask, a_NHH[n], 0.0)
        out[n] = masked - masked.T
    return out


def _cayley_reference(s_NHH: np.ndarray) -> np.ndarray:
    eye = np.eye(s_NHH.shape[-1])
    return (eye - s_NHH) @ np.linalg.inv(eye + s_NHH)


def _rope_reference(freqs_ANF, x_BTNH, pos) -> np.ndarray:
    """RoPE-Mixed in float64: pair (2j, 2j+1) turned by sum_a p_a f[a, n, j]."""
    f = np.asarray(freqs_ANF, np.float64)
    pos = np.asarray(pos, np.float64)
    spec = "ta,anf->tnf" if pos.ndim == 2 else "bta,anf->btnf"
    angle = np.einsum(spec, pos, f)
    x = np.asarray(x_BTNH, np.float64)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(angle) - b * np.sin(angle)
    out[..., 1::2] = a * np.sin(angle) + b * np.cos(angle)
    return out


def _qk(q_BTNH, k_BTNH) -> np.ndarray:
    return np.einsum("btnh,bsnh->bnts", np.asarray(q_BTNH, np.float64), np.asarray(k_BTNH))


@pytest.mark.parametrize("generator", GENERATORS)
@pytest.mark.parametrize("pos_shape", [(T, 2), (B, T, 3)])
def test_apply_matches_float64_reference(generator, pos_shape):
    params = _params(0, generator, num_axes=pos_shape[-1])
    pos, x = _pos(1, pos_shape), _x(2)
    p_NHH = _cayley_reference(_skew_reference(params, generator))
    want = _rope_reference(params["freqs_ANF"], np.einsum("nij,btnj->btni", p_NHH, x), pos)
    got = _apply(params, x, pos, k=_k(generator))
    np.testing.assert_allclose(got, want, atol=2e-5)
    np.testing.assert_allclose(_orthogonal(params, k=_k(generator)), p_NHH, atol=2e-6)
    assert np.max(np.abs(p_NHH - np.eye(H))) > 0.1  # the generator is really in play


@pytest.mark.parametrize("generator", GENERATORS)
def test_zero_generator_is_exactly_rope_mixed(generator):
    if generator == "topk":  # init refuses S = 0 for top-k (test_init_errors); set it here
        params = _init(3, generator, init_std=0.5)
        params[KEYS[generator]] = jnp.zeros_like(params[KEYS[generator]])
    else:
        params = _init(3, generator, init_std=0.0)
    ref_params = rope_mixed.init(
        jax.random.split(jax.random.key(3))[0], num_heads=N, head_dim=H, num_axes=2
    )
    np.testing.assert_array_equal(params["freqs_ANF"], ref_params["freqs_ANF"])
    s = params[KEYS[generator]]
    np.testing.assert_array_equal(s, 0.0)
    pos, x = _pos(4), _x(5)
    np.testing.assert_array_equal(
        _apply(params, x, pos, k=_k(generator)), _rope_apply(ref_params, x, pos)
    )


def test_block2x2_closed_form_equals_general_cayley():
    params = _params(6, "block2x2", init_std=1.0)
    s_ref = _skew_reference(params, "block2x2")
    closed = _orthogonal(params)
    np.testing.assert_allclose(_generator(params), s_ref, atol=0)
    np.testing.assert_allclose(closed, lie.cayley(jnp.asarray(s_ref, jnp.float32)), atol=1e-6)
    np.testing.assert_allclose(closed, _cayley_reference(s_ref), atol=1e-6)
    # The elementwise apply equals P applied as a matrix.
    pos, x = _pos(7), _x(8)
    want = _rope_apply(
        {"freqs_ANF": params["freqs_ANF"]}, jnp.einsum("nij,btnj->btni", closed, x), pos
    )
    np.testing.assert_allclose(_apply(params, x, pos), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("generator", GENERATORS)
def test_orthogonal(generator):
    p = np.asarray(_orthogonal(_params(9, generator, init_std=2.0), k=_k(generator)), np.float64)
    chex.assert_shape(p, (N, H, H))
    np.testing.assert_allclose(
        np.swapaxes(p, -1, -2) @ p, np.broadcast_to(np.eye(H), p.shape), atol=1e-5
    )


@pytest.mark.parametrize("bandwidth", [1, 2, 7])
def test_banded_structure(bandwidth):
    params = _params(10, "banded", init_std=1.0, bandwidth=bandwidth)
    raw = np.asarray(params["s_banded_NWH"])
    chex.assert_shape(raw, (N, bandwidth, H))
    s = np.asarray(_generator(params))
    i, j = np.indices((H, H))
    np.testing.assert_array_equal(s[:, np.abs(i - j) > bandwidth], 0.0)
    np.testing.assert_array_equal(s, _skew_reference(params, "banded"))
    assert np.count_nonzero(s[0]) == 2 * sum(H - d for d in range(1, bandwidth + 1))
    # P from a banded S is dense: the Cayley transform fills the band's complement.
    if bandwidth < H - 1:
        assert np.max(np.abs(np.asarray(_orthogonal(params))[:, np.abs(i - j) > bandwidth])) > 1e-3
    # Unused entries past the end of a diagonal have no effect.
    tail = np.zeros_like(raw)
    tail[:, bandwidth - 1, H - bandwidth :] = 5.0
    np.testing.assert_array_equal(_generator({**params, "s_banded_NWH": raw + tail}), s)


def _hand_made_a():
    a = np.array(
        [
            [9.0, 5.0, 0.1, 0.2],  # the diagonal (9, 8) is the largest and must be ignored
            [-4.0, 8.0, 0.3, 2.5],
            [0.4, 0.5, 0.0, 3.0],
            [0.6, 0.7, 1.0, 0.0],
        ]
    )
    return np.stack([a, -a.T])  # two heads


@pytest.mark.parametrize(
    "k, pairs",
    [
        (1, [(0, 1)]),  # |5|
        (2, [(0, 1)]),  # |5|, |-4| share the plane (0, 1): k' = 1
        (3, [(0, 1), (2, 3)]),  # + |3|
        (4, [(0, 1), (2, 3), (1, 3)]),  # + |2.5|
    ],
)
def test_topk_mask_hand_made(k, pairs):
    a = _hand_made_a()
    params = {"freqs_ANF": jnp.zeros((2, 2, 2)), "s_topk_NHH": jnp.asarray(a, jnp.float32)}
    s = np.asarray(_generator(params, k=k))
    for n in range(2):
        want = np.zeros((4, 4))
        for i, j in pairs:
            want[i, j] = a[n, i, j] - a[n, j, i]
            want[j, i] = -want[i, j]
        np.testing.assert_allclose(s[n], want, atol=1e-6)
        assert np.count_nonzero(s[n]) == 2 * len(pairs)
    np.testing.assert_allclose(s, _topk_reference(a, k), atol=1e-6)


def test_topk_with_every_entry_is_a_minus_a_transpose():
    params = _params(11, "topk", init_std=1.0)
    a = np.asarray(params["s_topk_NHH"])
    s = _generator(params, k=H * (H - 1))
    np.testing.assert_allclose(s, a - np.swapaxes(a, -1, -2), atol=0)


@pytest.mark.parametrize("generator", GENERATORS)
@pytest.mark.parametrize("num_axes", [2, 3])
def test_translation_invariant(generator, num_axes):
    params = _params(12, generator, num_axes=num_axes)
    pos, q, k = _pos(13, (T, num_axes)), _x(14), _x(15)
    shift = _rng(16).uniform(-3.0, 3.0, num_axes).astype(np.float32)
    kk = _k(generator)
    base = _qk(_apply(params, q, pos, k=kk), _apply(params, k, pos, k=kk))
    moved = _qk(_apply(params, q, pos + shift, k=kk), _apply(params, k, pos + shift, k=kk))
    np.testing.assert_allclose(moved, base, atol=2e-4)


@pytest.mark.parametrize("generator", GENERATORS)
def test_p_before_rope_does_not_cancel(generator):
    params = _params(17, generator, init_std=1.0)
    rope_params = {"freqs_ANF": params["freqs_ANF"]}
    pos, q, k = _pos(18), _x(19), _x(20)
    kk = _k(generator)
    rope_only = _qk(_rope_apply(rope_params, q, pos), _rope_apply(rope_params, k, pos))
    ours = _qk(_apply(params, q, pos, k=kk), _apply(params, k, pos, k=kk))
    assert np.max(np.abs(ours - rope_only)) > 1e-2
    # The other order, P RoPE(p) x, gives back RoPE-only scores: P^T P = I cancels.
    p_NHH = _orthogonal(params, k=kk)
    after = [jnp.einsum("nij,btnj->btni", p_NHH, _rope_apply(rope_params, v, pos)) for v in (q, k)]
    np.testing.assert_allclose(_qk(*after), rope_only, atol=1e-4)


def test_block2x2_on_rope_pairs_would_cancel():
    """Why block2x2 uses the half-split planes: on RoPE's own pairs P commutes with RoPE."""
    params = _params(21, "block2x2", init_std=1.0)
    rope_params = {"freqs_ANF": params["freqs_ANF"]}
    a = np.asarray(params["s_block2x2_NF"], np.float64)
    s = np.zeros((N, H, H))
    j = np.arange(H // 2)
    s[:, 2 * j, 2 * j + 1], s[:, 2 * j + 1, 2 * j] = a, -a
    p_rope_pairs = jnp.asarray(_cayley_reference(s), jnp.float32)
    pos, q, k = _pos(22), _x(23), _x(24)
    rope_only = _qk(_rope_apply(rope_params, q, pos), _rope_apply(rope_params, k, pos))
    before = [
        _rope_apply(rope_params, jnp.einsum("nij,btnj->btni", p_rope_pairs, v), pos) for v in (q, k)
    ]
    np.testing.assert_allclose(_qk(*before), rope_only, atol=1e-4)


@pytest.mark.parametrize("generator", GENERATORS)
def test_fold_reproduces_apply(generator):
    params = _params(25, generator, init_std=1.0)
    kk = _k(generator)
    x_BTD = _rng(26).standard_normal((B, T, 12)).astype(np.float32)
    w_DNH = _rng(27).standard_normal((12, N, H)).astype(np.float32)
    pos = _pos(28)
    want = _apply(params, jnp.einsum("btd,dnh->btnh", x_BTD, w_DNH), pos, k=kk)
    folded = _fold(params, w_DNH, k=kk)
    chex.assert_shape(folded, w_DNH.shape)
    q = jnp.einsum("btd,dnh->btnh", x_BTD, folded)
    np.testing.assert_allclose(
        _rope_apply({"freqs_ANF": params["freqs_ANF"]}, q, pos), want, atol=1e-5
    )


@pytest.mark.parametrize("generator", GENERATORS)
@pytest.mark.parametrize("pos_shape", [(T, 2), (B, T, 2)])
def test_precompute_with_folded_weights_equals_apply(generator, pos_shape):
    # What the ViT does every step: P into the q/k weights, RoPE from the remaining state.
    params = _params(60, generator, init_std=1.0)
    kk = _k(generator)
    x_BTD = _rng(61).standard_normal((B, T, 12)).astype(np.float32)
    w_DNH = _rng(62).standard_normal((12, N, H)).astype(np.float32)
    pos = _pos(63, pos_shape)
    whole = cayley_string.precompute(params, pos, num_heads=N, head_dim=H, k=kk)
    pre = whole.to_fold()  # what the model takes: P left to fold into the weights
    assert isinstance(pre, state.PairAnglesAfterFold)
    np.testing.assert_allclose(pre.fold_NHH, cayley_string.orthogonal(params, k=kk), atol=1e-6)
    q = jnp.einsum("btd,dnj,nij->btni", x_BTD, w_DNH, pre.fold_NHH)
    want = _apply(params, jnp.einsum("btd,dnh->btnh", x_BTD, w_DNH), pos, k=kk)
    np.testing.assert_allclose(pre.rotate(q), want, atol=1e-5)
    # Without the fold the RoPE-only rotation gives a different result: P matters here.
    unfolded = pre.rotate(jnp.einsum("btd,dnh->btnh", x_BTD, w_DNH))
    assert np.max(np.abs(np.asarray(unfolded) - np.asarray(want))) > 1e-2
    # The family's own state is the whole encoding: rotating q once per step needs no fold.
    q_unfolded = jnp.einsum("btd,dnh->btnh", x_BTD, w_DNH)
    np.testing.assert_allclose(whole.rotate(q_unfolded), want, atol=1e-5)
    # One P and one set of angles for every head (heads sharing parameters) broadcasts.
    one = state.PairAngles(whole.angle_TNF[..., :1, :], whole.mix_NHH[:1])
    np.testing.assert_allclose(
        one.rotate(q_unfolded)[:, :, 1:], one.rotate(q_unfolded[:, :, 1:]), atol=1e-6
    )


def _loss(params, x, w, pos, k):
    return jnp.sum(cayley_string.apply(params, x, pos, k=k) * w)


_grad_loss = jax.jit(jax.grad(_loss), static_argnums=4)


@pytest.mark.parametrize("generator", GENERATORS)
@pytest.mark.parametrize("init_std", [0.0, 0.5])
def test_gradients(generator, init_std):
    params = _params(29, generator, init_std=init_std)
    pos, x, w = _pos(30), _x(31), _x(32)
    kk = _k(generator)
    grads = _grad_loss(params, x, w, pos, kk)
    chex.assert_tree_all_finite(grads)
    key = KEYS[generator]
    assert np.max(np.abs(grads["freqs_ANF"])) > 1e-3
    assert np.max(np.abs(grads[key])) > 1e-3  # non-zero at S = 0 too
    if init_std == 0.0:
        return
    # Directional derivative against float64 central differences of the reference.
    direction = _rng(33).standard_normal(params[key].shape)
    if generator == "banded":
        direction[:, 1, H - 2 :] = direction[:, 0, H - 1 :] = 0.0  # unused entries

    def ref_loss(raw):
        p_NHH = _cayley_reference(_skew_reference({key: raw}, generator))
        mixed = np.einsum("nij,btnj->btni", p_NHH, x)
        return np.sum(_rope_reference(params["freqs_ANF"], mixed, pos) * w)

    raw, eps = np.asarray(params[key], np.float64), 1e-6
    fd = (ref_loss(raw + eps * direction) - ref_loss(raw - eps * direction)) / (2 * eps)
    np.testing.assert_allclose(np.sum(np.asarray(grads[key]) * direction), fd, rtol=1e-3)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"generator": "sparse"},
            ValueError,
            "unknown generator='sparse'; expected one of dense, block2x2, banded, topk",
        ),
        ({"generator": "banded"}, ValueError, "bandwidth=None must be an int in \\[1, head_dim"),
        ({"generator": "banded", "bandwidth": 0}, ValueError, "bandwidth=0"),
        (
            {"generator": "banded", "bandwidth": 8},
            ValueError,
            "bandwidth=8 .* \\[1, head_dim - 1=7\\]",
        ),
        ({"generator": "dense", "bandwidth": 2}, ValueError, "bandwidth=2 is only used by"),
        ({"generator": "topk"}, ValueError, "k=None must be an int in \\[1, H\\*\\(H-1\\)=56\\]"),
        ({"generator": "topk", "k": 0}, ValueError, "k=0 must be"),
        (
            {"generator": "topk", "k": 57},
            ValueError,
            "k=57 must be an int in \\[1, H\\*\\(H-1\\)=56\\]",
        ),
        ({"generator": "block2x2", "k": 3}, ValueError, "k=3 is only used by generator='topk'"),
        ({"init_std": -0.1}, ValueError, "init_std=-0.1"),
        (
            {"generator": "topk", "k": 4, "init_std": 0.0},
            ValueError,
            "generator='topk' needs init_std > 0, got init_std=0.0: .*first k entries",
        ),
        ({"head_dim": 2, "generator": "block2x2"}, ValueError, "head_dim=2"),
        ({"head_dim": 7}, ValueError, "head_dim=7 is not divisible by 2"),
        ({"block_size": 2}, TypeError, "block_size"),
    ],
)
def test_init_errors(kwargs, error, match):
    args = {"num_heads": N, "head_dim": H, "num_axes": 2, **kwargs}
    with pytest.raises(error, match=match):
        cayley_string.init(jax.random.key(0), **args)


def test_apply_errors():
    x, pos = _x(0), _pos(1)
    topk = _params(0, "topk")
    dense = _params(0, "dense")
    with pytest.raises(ValueError, match="top-k generator .* pass k="):
        cayley_string.apply(topk, x, pos)
    with pytest.raises(ValueError, match="k=57 must be an int in \\[1, H\\*\\(H-1\\)=56\\]"):
        cayley_string.apply(topk, x, pos, k=57)
    with pytest.raises(ValueError, match="k=3 is only used by the top-k generator"):
        cayley_string.apply(dense, x, pos, k=3)
    with pytest.raises(ValueError, match="k=0 must be an int"):
        cayley_string.orthogonal(topk, k=0)
    with pytest.raises(ValueError, match="exactly one of"):
        cayley_string.apply({**dense, "s_topk_NHH": topk["s_topk_NHH"]}, x, pos, k=12)
    with pytest.raises(ValueError, match="exactly one of"):
        cayley_string.apply({"freqs_ANF": dense["freqs_ANF"]}, x, pos)
    with pytest.raises(ValueError, match="s_dense_NHH has shape \\(2, 4, 4\\)"):
        cayley_string.apply({**dense, "s_dense_NHH": jnp.zeros((N, 4, 4))}, x, pos)
    with pytest.raises(ValueError, match="A=3 axes .* num_axes=2"):
        cayley_string.apply(dense, x, _pos(1, (T, 3)))
    with pytest.raises(ValueError, match="x has \\(N, H\\)=\\(2, 4\\)"):
        cayley_string.apply(dense, x[..., :4], pos)


@pytest.mark.parametrize(
    "generator, hparams, shape",
    [
        ("dense", {}, (16, H, H)),
        ("block2x2", {}, (16, H // 2)),
        ("banded", {"bandwidth": 2}, (16, 2, H)),
        ("topk", {"k": 5}, (16, H, H)),
    ],
)
def test_param_names_shapes_and_init_std(generator, hparams, shape):
    params = cayley_string.init(
        jax.random.key(34),
        num_heads=16,
        head_dim=H,
        num_axes=3,
        generator=generator,
        init_std=0.1,
        **hparams,
    )
    assert set(params) == {"freqs_ANF", KEYS[generator]}
    chex.assert_shape(params["freqs_ANF"], (3, 16, H // 2))
    chex.assert_shape(params[KEYS[generator]], shape)
    s = np.asarray(params[KEYS[generator]])
    assert s.dtype == np.float32
    if generator == "banded":  # the unused tails of the diagonals are zero, the rest drawn
        valid = np.arange(H)[None, :] + np.arange(1, 3)[:, None] < H
        np.testing.assert_array_equal(s[:, ~valid], 0.0)
        s = s[:, valid]
    used = s.ravel()
    assert np.all(used != 0.0)
    # N(0, 0.1): sample mean and std within ~4 standard errors.
    assert abs(used.mean()) < 4 * 0.1 / np.sqrt(used.size)
    np.testing.assert_allclose(used.std(), 0.1, rtol=4 / np.sqrt(2 * used.size))
