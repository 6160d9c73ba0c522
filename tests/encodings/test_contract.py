"""The encoder contract (docs/encoders.md), checked for every rotary family in ROTARY.

Family-specific math (references, reductions, init) lives in the per-module test files.
"""

import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie import encodings
from rope_lie.encodings import cayley_string, comrope, positions, state

# (family, settings, supported position ranks): every example each rotary family declares in
# its FAMILY (one per code path, encodings/family.py).
CASES = [
    (name, dict(hparams), ranks)
    for name, module in encodings.ROTARY.items()
    for hparams, ranks in module.FAMILY.examples
]
IDS = [f"{name}-{'-'.join(f'{k}{v}' for k, v in hp.items())}" for name, hp, _ in CASES]
# Families whose R(p)^T R(p') depends on p' - p only (their generators commute), as they declare.
RELATIVE = {name for name, f in encodings.families().items() if f.relative}

B, N, H = 2, 3, 12


def _grid(rank):
    return {1: (7,), 2: (3, 4), 3: (2, 2, 3)}[rank]


def _setup(name, hparams, rank, seed=0):
    module = encodings.ROTARY[name]
    params = module.init(jax.random.key(seed), num_heads=N, head_dim=H, num_axes=rank, **hparams)
    pos_TA = positions.grid_positions(_grid(rank), "integer", num_prefix=1)
    x_BTNH = jax.random.normal(jax.random.key(seed + 1), (B, pos_TA.shape[0], N, H))
    apply_kw = {k: hparams[k] for k in module.APPLY_HPARAMS if k in hparams}
    return module, params, x_BTNH, pos_TA, apply_kw


def _each_rank():
    for (name, hp, ranks), case_id in zip(CASES, IDS, strict=True):
        for rank in ranks:
            yield pytest.param(name, hp, rank, id=f"{case_id}-{rank}d")


def test_every_family_module_is_registered_under_its_own_name_and_kind():
    # A module of encodings/ that declares a FAMILY must be in ROTARY or BIAS (by its kind) under
    # its name; forgetting the one line in encodings/__init__.py fails here.
    package = pathlib.Path(encodings.__file__).parent
    declared = {
        path.stem
        for path in package.glob("*.py")
        if "\nFAMILY = family.Family(" in path.read_text()
    }
    assert declared == set(encodings.ROTARY) | set(encodings.BIAS)
    for kind, table in (("rotary", encodings.ROTARY), ("bias", encodings.BIAS)):
        for name, module in table.items():
            assert module.FAMILY.name == name and module.FAMILY.kind == kind, name
            assert module.APPLY_HPARAMS == tuple(module.FAMILY.apply_defaults)
            assert callable(module.init) and callable(module.precompute)
            assert callable(module.apply if kind == "rotary" else module.bias)
    assert set(encodings.ADDITIVE) == {"ape", "sincos"}
    assert RELATIVE == set(encodings.families()) - {"liere"}  # dense 2D/3D LieRE does not commute


@pytest.mark.parametrize("name", sorted(encodings.families()))
def test_apply_defaults_are_the_defaults_of_init(name):
    # What a plain dict falls back to is what init would have been given.
    family = encodings.family_of(name)
    init_defaults = family.settings_of_init()
    for setting, default in family.apply_defaults.items():
        assert init_defaults[setting] == default, (name, setting)


@pytest.mark.parametrize("name,hparams,rank", list(_each_rank()))
def test_shapes_norms_jit(name, hparams, rank):
    module, params, x_BTNH, pos_TA, kw = _setup(name, hparams, rank)
    out = module.apply(params, x_BTNH, pos_TA, **kw)
    chex.assert_shape(out, x_BTNH.shape)
    chex.assert_type(out, jnp.float32)
    chex.assert_tree_all_finite(out)
    # Rotations preserve the norm of every (token, head) vector.
    np.testing.assert_allclose(
        jnp.linalg.norm(out, axis=-1), jnp.linalg.norm(x_BTNH, axis=-1), rtol=2e-5, atol=1e-5
    )
    jitted = jax.jit(lambda p, x, q: module.apply(p, x, q, **kw))(params, x_BTNH, pos_TA)
    np.testing.assert_allclose(jitted, out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,hparams,rank", list(_each_rank()))
def test_vmap_and_per_example_positions(name, hparams, rank):
    module, params, x_BTNH, pos_TA, kw = _setup(name, hparams, rank)
    shared = module.apply(params, x_BTNH, pos_TA, **kw)
    one = jax.vmap(lambda x: module.apply(params, x[None], pos_TA, **kw)[0])(x_BTNH)
    np.testing.assert_allclose(one, shared, rtol=1e-5, atol=1e-5)
    # Per-example positions: example b at pos_TA + b must equal applying it alone.
    pos_BTA = jnp.stack([pos_TA + b for b in range(B)])
    per_example = module.apply(params, x_BTNH, pos_BTA, **kw)
    for b in range(B):
        alone = module.apply(params, x_BTNH[b : b + 1], pos_BTA[b], **kw)
        np.testing.assert_allclose(per_example[b : b + 1], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,hparams,rank", list(_each_rank()))
def test_bfloat16_in_bfloat16_out(name, hparams, rank):
    module, params, x_BTNH, pos_TA, kw = _setup(name, hparams, rank)
    ref = module.apply(params, x_BTNH, pos_TA, **kw)
    out = module.apply(params, x_BTNH.astype(jnp.bfloat16), pos_TA, **kw)
    chex.assert_type(out, jnp.bfloat16)
    # Only the input and output rounding (~4e-3 relative each) shows: phases stay in float32.
    np.testing.assert_allclose(out.astype(jnp.float32), ref, rtol=0, atol=2e-2)


@pytest.mark.parametrize("name,hparams,rank", list(_each_rank()))
def test_zero_position_is_identity_or_p(name, hparams, rank):
    module, params, x_BTNH, _, kw = _setup(name, hparams, rank)
    zeros_TA = jnp.zeros((x_BTNH.shape[1], rank))
    out = module.apply(params, x_BTNH, zeros_TA, **kw)
    if name == "cayley_string":  # R(0) = RoPE(0) P = P
        p_NHH = cayley_string.orthogonal(params, **kw)
        expected = jnp.einsum("NHG,BTNG->BTNH", p_NHH, x_BTNH)
        assert not np.allclose(expected, x_BTNH, atol=1e-3)  # P != I with init_std > 0
    elif name == "comrope" and hparams["block_size"] > 2:  # R'(0) = P, the eigenbases
        _, q_NKbb = comrope.spectra(params, **kw)
        expected = jnp.einsum(
            "NKji,BTNKj->BTNKi",
            q_NKbb,
            x_BTNH.reshape(*x_BTNH.shape[:3], -1, hparams["block_size"]),
        ).reshape(x_BTNH.shape)
        assert not np.allclose(expected, x_BTNH, atol=1e-3)
    else:
        expected = x_BTNH
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def _scores(module, params, kw, q_BTNH, k_BTNH, pos_q_TA, pos_k_TA):
    q = module.apply(params, q_BTNH, pos_q_TA, **kw)
    k = module.apply(params, k_BTNH, pos_k_TA, **kw)
    return jnp.einsum("BTNH,BSNH->BNTS", q, k)


@pytest.mark.parametrize("name,hparams,rank", list(_each_rank()))
def test_translation_invariance_where_the_math_gives_it(name, hparams, rank):
    module, params, x_BTNH, pos_TA, kw = _setup(name, hparams, rank)
    k_BTNH = jax.random.normal(jax.random.key(7), x_BTNH.shape)
    shift_1A = jnp.asarray([[1.5, -2.0, 0.75][:rank]])
    base = _scores(module, params, kw, x_BTNH, k_BTNH, pos_TA, pos_TA)
    moved = _scores(module, params, kw, x_BTNH, k_BTNH, pos_TA + shift_1A, pos_TA + shift_1A)
    commuting = name in RELATIVE or rank == 1 or hparams.get("block_size") == 2
    if commuting:
        np.testing.assert_allclose(moved, base, rtol=1e-4, atol=2e-4)
    else:  # 2D/3D LieRE with blocks > 2: generators do not commute, so no invariance.
        assert float(jnp.max(jnp.abs(moved - base))) > 1e-2


@pytest.mark.parametrize("name,hparams,rank", [c for c in _each_rank() if c.values[0] != "nope"])
def test_gradients_reach_every_parameter(name, hparams, rank):
    module, params, x_BTNH, pos_TA, kw = _setup(name, hparams, rank)
    if not params:
        pytest.skip(f"{name} has no learnable parameters")
    k_BTNH = jax.random.normal(jax.random.key(3), x_BTNH.shape)

    def loss(p):
        return jnp.sum(jnp.sin(_scores(module, p, kw, x_BTNH, k_BTNH, pos_TA, pos_TA)))

    grads = jax.grad(loss)(params)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        chex.assert_tree_all_finite(g)
        assert float(jnp.max(jnp.abs(g))) > 0, f"zero gradient for {name} {path}"


@pytest.mark.parametrize("name,hparams,ranks", CASES, ids=IDS)
def test_bad_inputs_name_the_value(name, hparams, ranks):
    rank = ranks[0]
    module, params, x_BTNH, pos_TA, kw = _setup(name, hparams, rank)
    with pytest.raises(ValueError, match=r"rank 4|\(B, T, N, H\)"):
        module.apply(params, x_BTNH[0], pos_TA, **kw)
    with pytest.raises(ValueError, match=r"\(T, A\)"):
        module.apply(params, x_BTNH, pos_TA[0], **kw)
    with pytest.raises(ValueError, match=f"T={pos_TA.shape[0] - 1}"):
        module.apply(params, x_BTNH, pos_TA[1:], **kw)
    with pytest.raises(TypeError, match="not_an_hparam"):
        module.init(jax.random.key(0), num_heads=N, head_dim=H, num_axes=rank, not_an_hparam=1)
    with pytest.raises(ValueError, match="head_dim"):
        module.init(jax.random.key(0), num_heads=N, head_dim=0, num_axes=rank, **hparams)
    if params:  # learned families know their number of axes
        wrong = jnp.concatenate([pos_TA, pos_TA[:, :1]], axis=-1)
        with pytest.raises(ValueError, match=f"A={rank + 1}"):
            module.apply(params, x_BTNH, wrong, **kw)


def _folded(pe, x_BTNH):
    """What the attention does with a state's fold_NHH: P x per head, before the rotation."""
    if pe.fold_NHH is None:
        return x_BTNH
    return jnp.einsum("NHG,BTNG->BTNH", pe.fold_NHH, x_BTNH)


@pytest.mark.parametrize("name,hparams,rank", list(_each_rank()))
def test_precompute_then_rotate_equals_apply(name, hparams, rank):
    # The model's path (precompute once, fold, rotate q and k) and the user's (apply) agree, for
    # shared and per-example positions, and the state is a pytree that crosses jit.
    module, params, x_BTNH, pos_TA, kw = _setup(name, hparams, rank)
    pos_BTA = jnp.stack([pos_TA + b for b in range(B)])
    for pos in (pos_TA, pos_BTA):
        pe = module.precompute(params, pos, num_heads=N, head_dim=H, num_prefix=1, **kw)
        assert isinstance(pe, state.State.__args__) and pe.bias_BNTS is None
        want = module.apply(params, x_BTNH, pos, **kw)
        # The family's state is the whole encoding (Cayley-STRING's P included) ...
        assert pe.fold_NHH is None
        np.testing.assert_allclose(pe.rotate(x_BTNH), want, rtol=1e-5, atol=1e-5)
        # ... and the model's (P left to fold, when there is one) gives the same.
        model_pe = pe.to_fold()
        got = model_pe.rotate(_folded(model_pe, x_BTNH))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        jitted = jax.jit(lambda p, q: module.precompute(p, q, num_heads=N, head_dim=H, **kw))
        chex.assert_trees_all_close(jitted(params, pos), pe, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,hparams,rank", [c for c in _each_rank() if c.values[2] == 2])
def test_a_one_head_state_rotates_every_head_alike(name, hparams, rank):
    # Heads sharing parameters: one head's state broadcasts over the N heads of q and k.
    module = encodings.ROTARY[name]
    params = module.init(jax.random.key(5), num_heads=1, head_dim=H, num_axes=rank, **hparams)
    _, _, x_BTNH, pos_TA, kw = _setup(name, hparams, rank)
    pe = module.precompute(params, pos_TA, num_heads=1, head_dim=H, **kw)
    out = pe.rotate(_folded(pe, x_BTNH))
    for n in range(N):
        alone = module.apply(params, x_BTNH[:, :, n : n + 1], pos_TA, **kw)
        np.testing.assert_allclose(out[:, :, n : n + 1], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,hparams,ranks", CASES, ids=IDS)
def test_precompute_names_a_context_that_does_not_fit(name, hparams, ranks):
    module, params, _, pos_TA, kw = _setup(name, hparams, ranks[0])
    with pytest.raises(ValueError, match="num_heads=0"):
        module.precompute(params, pos_TA, num_heads=0, head_dim=H, **kw)
    with pytest.raises(ValueError, match=r"\(T, A\)"):
        module.precompute(params, pos_TA[0], num_heads=N, head_dim=H, **kw)
    if params:  # learned families know their head count and size
        with pytest.raises(ValueError, match=f"num_heads={N + 1}"):
            module.precompute(params, pos_TA, num_heads=N + 1, head_dim=H, **kw)


@pytest.mark.parametrize("per_example", [False, True])
def test_the_bias_state_is_the_bias_with_a_batch_axis(per_example):
    alibi = encodings.BIAS["alibi"]
    params = alibi.init(jax.random.key(0), num_heads=N, head_dim=H, num_axes=2, learnable=True)
    pos_TA = positions.grid_positions((3, 4), "integer", num_prefix=1)
    pos = jnp.stack([pos_TA, 2.0 * pos_TA]) if per_example else pos_TA
    pe = alibi.precompute(params, pos, num_heads=N, head_dim=H, num_prefix=1)
    assert isinstance(pe, state.LogitBias) and pe.fold_NHH is None
    want = alibi.bias(params, pos, pos, num_heads=N, num_prefix=1)
    np.testing.assert_allclose(pe.bias_BNTS, want if per_example else want[None])
    x_BTNH = jax.random.normal(jax.random.key(1), (B, pos_TA.shape[0], N, H))
    np.testing.assert_array_equal(pe.rotate(x_BTNH), x_BTNH)
