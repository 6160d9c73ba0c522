"""The encoder contract (docs/encoders.md), checked for every rotary family in ROTARY.

One test per case (family, example settings, position rank) checks the properties together:
its transformations (jit, vmap, gradients, precompute) run in one jitted program, compiled
once, beside the user's eager calls, and each assertion names the property that failed.
Family-specific math (references, reductions, init) lives in the per-module test files.
"""

import functools
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
    pos_TA = np.asarray(positions.grid_positions(_grid(rank), "integer", num_prefix=1))
    # Inputs from numpy: the family's operations are what the test compiles, not the inputs'.
    x_BTNH = _normal((B, pos_TA.shape[0], N, H), seed + 1)
    apply_kw = {k: hparams[k] for k in module.APPLY_HPARAMS if k in hparams}
    return module, params, x_BTNH, pos_TA, apply_kw


def _normal(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


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


def _folded(pe, x_BTNH):
    """What the attention does with a state's fold_NHH: P x per head, before the rotation."""
    if pe.fold_NHH is None:
        return x_BTNH
    return jnp.einsum("NHG,BTNG->BTNH", pe.fold_NHH, x_BTNH)


def _at_zero(name, hparams, params, kw, x_BTNH):
    """R(0) x: x, except where R(0) is an orthogonal P != I, which it returns with P x."""
    if name == "cayley_string":  # R(0) = RoPE(0) P = P
        p_NHH = np.asarray(cayley_string.orthogonal(params, **kw))
        return np.einsum("NHG,BTNG->BTNH", p_NHH, x_BTNH)
    if name == "comrope" and hparams["block_size"] > 2:  # R'(0) = P, the eigenbases
        q_NKbb = np.asarray(comrope.spectra(params, **kw)[1])
        blocks = x_BTNH.reshape(*x_BTNH.shape[:3], -1, hparams["block_size"])
        return np.einsum("NKji,BTNKj->BTNKi", q_NKbb, blocks).reshape(x_BTNH.shape)
    return x_BTNH


def _scores(q_BTNH, k_BTNH):
    return np.einsum("BTNH,BSNH->BNTS", np.asarray(q_BTNH, np.float64), np.asarray(k_BTNH))


def _transformed(module, kw):
    """The case's transformed computations in one jitted program (one compilation, where eager
    transformations would compile every operation apart): apply under jit and vmap, each
    example alone (vmapped over examples and their positions), precompute under jit (the
    family's state and the model's, for shared and per-example positions), the gradients of a
    loss of the attention scores, and one head's parameters on every head."""
    apply = functools.partial(module.apply, **kw)

    def precompute(params, pos, num_heads=N):
        return module.precompute(params, pos, num_heads=num_heads, head_dim=H, num_prefix=1, **kw)

    def states(params, x_BTNH, pos):
        pe = precompute(params, pos)
        model_pe = pe.to_fold()  # P left to fold into the q/k projections, when there is one
        return pe, pe.rotate(x_BTNH), model_pe.rotate(_folded(model_pe, x_BTNH))

    def loss(params, q_BTNH, k_BTNH, pos_TA):
        # The model's path: one state rotates q and k; the scores are what attention sees.
        pe = precompute(params, pos_TA).to_fold()
        q, k = (pe.rotate(_folded(pe, v)) for v in (q_BTNH, k_BTNH))
        return jnp.sum(jnp.sin(jnp.einsum("BTNH,BSNH->BNTS", q, k)))

    def one_example(params, x_TNH, pos_TA):
        return apply(params, x_TNH[None], pos_TA)[0]

    @jax.jit
    def run(params, params_1, x_BTNH, k_BTNH, pos_TA, pos_BTA):
        got = {
            "vmap": jax.vmap(one_example, (None, 0, None))(params, x_BTNH, pos_TA),
            "alone": jax.vmap(one_example, (None, 0, 0))(params, x_BTNH, pos_BTA),
            "shared": states(params, x_BTNH, pos_TA),
            "per_example": states(params, x_BTNH, pos_BTA),
            "grads": jax.grad(loss)(params, x_BTNH, k_BTNH, pos_TA),
        }
        if params_1 is not None:
            pe_1 = precompute(params_1, pos_TA, num_heads=1)
            got["one_head"] = pe_1.rotate(_folded(pe_1, x_BTNH))
            # Each head alone: the heads as examples of one head, at the same positions.
            heads_XT1H = jnp.swapaxes(x_BTNH, 1, 2).reshape(B * N, -1, 1, H)
            alone_XT1H = apply(params_1, heads_XT1H, pos_TA)
            got["each_head"] = jnp.swapaxes(alone_XT1H.reshape(B, N, -1, H), 1, 2)
        return got

    return run


@pytest.mark.parametrize("name,hparams,rank", list(_each_rank()))
def test_the_contract(name, hparams, rank):
    """The contract for one case; each assertion names the property it checks."""
    module, params, x_BTNH, pos_TA, kw = _setup(name, hparams, rank)
    k_BTNH = _normal(x_BTNH.shape, 7)
    pos_BTA = np.stack([pos_TA + b for b in range(B)])  # example b at pos_TA + b
    params_1 = None  # one head's parameters for every head (heads sharing them), in 2D
    if rank == 2:
        params_1 = module.init(jax.random.key(5), num_heads=1, head_dim=H, num_axes=2, **hparams)
    got = _transformed(module, kw)(params, params_1, x_BTNH, k_BTNH, pos_TA, pos_BTA)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)

    # The user's path, eager: the shape and dtype kept, rotations that keep the norm of every
    # (token, head) vector, the same under jit and vmap.
    out = module.apply(params, x_BTNH, pos_TA, **kw)
    chex.assert_shape(out, x_BTNH.shape)
    chex.assert_type(out, jnp.float32)
    chex.assert_tree_all_finite(out)
    norm = functools.partial(np.linalg.norm, axis=-1)
    np.testing.assert_allclose(norm(out), norm(x_BTNH), rtol=2e-5, atol=1e-5, err_msg="norms")
    close(got["vmap"], out, err_msg="apply under jit and vmap")

    # bfloat16 in, bfloat16 out: only the input and output rounding (~4e-3 relative each)
    # shows, the phases staying in float32.
    bf16 = module.apply(params, x_BTNH.astype(jnp.bfloat16), pos_TA, **kw)
    chex.assert_type(bf16, jnp.bfloat16)
    np.testing.assert_allclose(bf16.astype(np.float32), out, rtol=0, atol=2e-2, err_msg="bf16")

    # R(0) = I, or the orthogonal P != I of Cayley-STRING and of ComRoPE's eigenbases.
    at_zero = _at_zero(name, hparams, params, kw, x_BTNH)
    if at_zero is not x_BTNH:
        assert not np.allclose(at_zero, x_BTNH, atol=1e-3), "P = I: init_std > 0 gives P != I"
    zero = module.apply(params, x_BTNH, np.zeros_like(pos_TA), **kw)
    close(zero, at_zero, err_msg="the rotation at position 0")

    # Translation invariance where the math gives it: not for 2D/3D LieRE with blocks larger
    # than 2, whose generators do not commute.
    shift_1A = np.asarray([[1.5, -2.0, 0.75][:rank]], np.float32)
    base = _scores(out, module.apply(params, k_BTNH, pos_TA, **kw))
    moved_pos = pos_TA + shift_1A
    moved = _scores(*(module.apply(params, v, moved_pos, **kw) for v in (x_BTNH, k_BTNH)))
    if name in RELATIVE or rank == 1 or hparams.get("block_size") == 2:
        np.testing.assert_allclose(moved, base, rtol=1e-4, atol=2e-4, err_msg="translation")
    else:
        assert float(np.max(np.abs(moved - base))) > 1e-2, "non-commuting, yet invariant"

    # The gradients of the attention scores reach every parameter.
    for path, g in jax.tree_util.tree_leaves_with_path(got["grads"]):
        chex.assert_tree_all_finite(g)
        assert np.max(np.abs(g)) > 0, f"zero gradient for {name} {path}"

    # The model's path (precompute once, fold, rotate q and k) and the user's (apply) agree, for
    # shared and per-example positions; the state is a pytree that crosses jit.
    pe = module.precompute(params, pos_TA, num_heads=N, head_dim=H, num_prefix=1, **kw)
    jitted, rotated, model_rotated = got["shared"]
    chex.assert_trees_all_close(jitted, pe, rtol=1e-5, atol=1e-5)
    close(rotated, out, err_msg="precompute then rotate, shared positions")
    close(model_rotated, out, err_msg="fold then rotate (the model's), shared positions")
    jitted, per_example, model_rotated = got["per_example"]
    close(per_example, got["alone"], err_msg="per-example positions: each example alone")
    close(model_rotated, got["alone"], err_msg="fold then rotate, per-example positions")
    for each in (pe, jitted):
        assert isinstance(each, state.State.__args__) and each.bias_BNTS is None
        assert each.fold_NHH is None, "the family's state is the whole encoding, P included"

    if params_1 is not None:
        close(got["one_head"], got["each_head"], err_msg="one head's state on every head")
        shared_heads = module.apply(params_1, x_BTNH, pos_TA, **kw)
        close(shared_heads, got["one_head"], err_msg="apply with one head's parameters")


@pytest.mark.parametrize("name,hparams,ranks", CASES, ids=IDS)
def test_a_state_rotates_only_the_shape_it_was_computed_for(name, hparams, ranks):
    """Nothing is broadcast against a state: x of another T, B, N or H is an error naming both
    shapes, where broadcasting would have returned a rotation of the wrong tokens or heads."""
    module, params, x_BTNH, pos_TA, kw = _setup(name, hparams, ranks[0])
    pe = module.precompute(params, pos_TA, num_heads=N, head_dim=H, **kw)
    per_example = module.precompute(params, np.stack([pos_TA] * B), num_heads=N, head_dim=H, **kw)
    if isinstance(pe, state.Unrotated):  # NoPE: nothing to fit
        return
    wider = np.zeros((B, pos_TA.shape[0], N, H + 16), np.float32)  # past any block's remainder
    bad = [x_BTNH[:, 1:], x_BTNH[:, :1], wider, x_BTNH[..., : H // 2]]
    if params:  # per-head parameters: a state for N heads, not for one more
        bad.append(np.concatenate([x_BTNH, x_BTNH[:, :, :1]], axis=2))
    else:  # the angles are every head's: a state of one head fits any N
        np.testing.assert_allclose(pe.rotate(x_BTNH[:, :, :1]), pe.rotate(x_BTNH)[:, :, :1])
    for x in bad:
        with pytest.raises(ValueError, match=rf"rotate: x has shape \({x.shape[0]}, "):
            pe.rotate(x)
    with pytest.raises(ValueError, match=r"computed for x of shape \(B, T, N, H\) with B=2"):
        per_example.rotate(x_BTNH[:1])  # one example against a state of two
    chex.assert_shape(per_example.rotate(x_BTNH), x_BTNH.shape)


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
        # A key more is another family's parameter (Cayley-STRING's frequencies beside LieRE's
        # generators, Circulant-STRING's beside RoPE-Mixed's), which would be ignored: refused,
        # as plain dicts too.
        other = "c_ANH" if "freqs_ANF" in params else "freqs_ANF"
        extra = {**dict(params), other: jnp.zeros((rank, N, H))}
        with pytest.raises(ValueError, match="expects params"):
            module.apply(extra, x_BTNH, pos_TA, **kw)
    # init's parameters know their head_dim, even where H // b blocks would fit two more
    # channels (LieRE's partial blocks): they are not left unrotated.
    wide = np.concatenate([x_BTNH, x_BTNH[..., :2]], axis=-1)
    with pytest.raises(ValueError, match=f"head_dim={H + 2}|H\\)=\\({N}, {H + 2}\\)"):
        module.apply(params, wide, pos_TA, **kw)


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
