"""An encoder is a value (encodings/family.py): what init is given is what apply uses, inputs are
validated where they enter, and every family describes itself."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie import encodings
from rope_lie.encodings import (
    alibi,
    comrope,
    dinov3,
    positions,
    rope_mixed,
)

N, H = 2, 16
GRID = (3, 4)


def _inputs(rank=2, seed=1):
    pos_TA = positions.grid_positions(
        GRID[:rank] if rank <= 2 else (2, 2, 3), "integer", num_prefix=1
    )
    x_BTNH = jax.random.normal(jax.random.key(seed), (2, pos_TA.shape[0], N, H))
    return x_BTNH, pos_TA


# A setting init and apply both take (``FAMILY.apply_defaults``) is carried by the parameters:
# apply without it must use init's value, not its own default. The cases come from every
# rotary family's examples, plus the settings no example changes (EXTRA), so a new family or a
# new setting is covered without editing this list; test_every_apply_setting_is_covered fails
# when one is not.
EXTRA = {
    "rope": (({"base": 1000.0}, (1,)),),
    "rope_axial": (({"base": 1000.0}, (2,)),),
    "visionllama": (({"base": 1000.0}, (2,)),),
    "dinov3": (({"base": 1000.0}, (2,)), ({"rotary_fraction": 0.5}, (2,))),
}
HEAD_DIM = 12  # divisible by every example's 2 * axes, block and sections; rope_axial needs 12


def _told(family, settings):
    """The settings that apply also takes, where they differ from apply's defaults."""
    return {
        k: v
        for k, v in settings.items()
        if k in family.apply_defaults and v != family.apply_defaults[k]
    }


def _silent_cases():
    cases = []
    for name, module in encodings.ROTARY.items():
        extra = EXTRA.get(name, ())
        for settings, ranks in (*module.FAMILY.examples, *extra):
            if _told(module.FAMILY, settings):
                cases.append(
                    pytest.param(module, dict(settings), ranks[0], id=f"{name}-{settings}")
                )
    return cases


SILENT = _silent_cases()


def _grid_inputs(rank):
    pos_TA = positions.grid_positions(
        {1: (5,), 2: GRID, 3: (2, 2, 3)}[rank], "integer", num_prefix=1
    )
    x_BTNH = jax.random.normal(jax.random.key(1), (2, pos_TA.shape[0], N, HEAD_DIM))
    return x_BTNH, pos_TA


def test_every_apply_setting_is_covered():
    for name, module in encodings.ROTARY.items():
        extra = EXTRA.get(name, ())
        changed = set()
        for settings, _ in (*module.FAMILY.examples, *extra):
            changed |= set(_told(module.FAMILY, settings))
        missing = set(module.FAMILY.apply_defaults) - changed
        assert not missing, f"{name}: no example or EXTRA entry changes {sorted(missing)}"


@pytest.mark.parametrize("module,settings,rank", SILENT)
def test_apply_uses_what_init_was_given(module, settings, rank):
    told = _told(module.FAMILY, settings)
    kw = {"num_heads": N, "head_dim": HEAD_DIM}
    params = module.init(jax.random.key(0), num_axes=rank, **kw, **settings)
    x_BTNH, pos_TA = _grid_inputs(rank)
    want = module.apply(dict(params), x_BTNH, pos_TA, **told)  # a plain dict, told explicitly
    try:
        default = module.apply(dict(params), x_BTNH, pos_TA)
    except ValueError:
        pass  # a plain dict whose parameters do not fit the defaults is refused: loud, fine
    else:
        assert float(jnp.max(jnp.abs(want - default))) > 1e-3  # the setting matters here
    np.testing.assert_allclose(module.apply(params, x_BTNH, pos_TA), want, rtol=1e-6, atol=1e-6)
    jitted = jax.jit(module.apply)(params, x_BTNH, pos_TA)  # the tag crosses jit as static data
    np.testing.assert_allclose(jitted, want, rtol=1e-5, atol=1e-5)
    state = module.precompute(params, pos_TA, **kw)
    np.testing.assert_allclose(state.rotate(x_BTNH), want, rtol=1e-6, atol=1e-6)
    enc = encodings.encoder(module.FAMILY.name, num_axes=rank, **kw, **settings)
    np.testing.assert_allclose(
        enc.apply(enc.init(jax.random.key(0)), x_BTNH, pos_TA), want, rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("module,settings,rank", SILENT)
def test_a_setting_other_than_inits_is_an_error_and_the_same_one_is_not(module, settings, rank):
    kw = {"num_heads": N, "head_dim": HEAD_DIM}
    params = module.init(jax.random.key(0), num_axes=rank, **kw, **settings)
    x_BTNH, pos_TA = _grid_inputs(rank)
    told = _told(module.FAMILY, settings)
    for name in told:
        default = module.FAMILY.apply_defaults[name]
        with pytest.raises(ValueError, match=f"{name}={default!r} was passed, but init was given"):
            module.apply(params, x_BTNH, pos_TA, **{name: default})
        with pytest.raises(ValueError, match="was passed, but init was given"):
            module.precompute(params, pos_TA, **kw, **{name: default})
    module.apply(params, x_BTNH, pos_TA, **told)  # the same values: fine


def test_parameters_of_another_family_are_named():
    params = rope_mixed.init(jax.random.key(0), num_heads=N, head_dim=H, num_axes=2)
    x_BTNH, pos_TA = _inputs()
    for name in ("liere", "cayley_string", "rope_axial", "circulant_string", "comrope"):
        with pytest.raises(ValueError, match=f"made by rope_mixed.init, not {name}.init"):
            encodings.ROTARY[name].apply(params, x_BTNH, pos_TA)


def test_init_shapes_are_checked_for_parameter_free_families():
    params = dinov3.init(jax.random.key(0), num_heads=N, head_dim=H, num_axes=2)
    x_BTNH, pos_TA = _inputs()
    with pytest.raises(ValueError, match="head_dim=8 here, but init was given head_dim=16"):
        dinov3.apply(params, x_BTNH[..., :8], pos_TA)
    slopes = alibi.init(jax.random.key(0), num_heads=4, head_dim=H, num_axes=2)
    with pytest.raises(ValueError, match="num_heads=2 here, but init was given num_heads=4"):
        alibi.bias(slopes, pos_TA, pos_TA, num_heads=2)


@pytest.mark.parametrize("name", sorted(encodings.families()))
def test_an_encoder_checks_a_plain_dict_against_its_own_settings(name):
    """``Encoder.init`` gives a plain dict (what frameworks store); the encoder's own methods
    hold the call to its settings all the same."""
    family = encodings.family_of(name)
    settings, ranks = family.examples[0]
    enc = encodings.encoder(name, num_heads=N, head_dim=H, num_axes=ranks[0], **settings)
    params = enc.init(jax.random.key(0))
    assert type(params) is dict
    x_BTNH, pos_TA = _inputs(rank=ranks[0])
    more_axes = jnp.concatenate([pos_TA, pos_TA[:, :1]], axis=-1)
    with pytest.raises(ValueError, match=f"A={ranks[0] + 1}|num_axes={ranks[0] + 1} here"):
        enc.precompute(params, more_axes)
    if family.kind == "rotary":
        with pytest.raises(ValueError, match=f"head_dim={2 * H}|{2 * H}\\)"):
            enc.apply(params, jnp.concatenate([x_BTNH, x_BTNH], axis=-1), pos_TA)
        assert enc.apply(params, x_BTNH, pos_TA).shape == x_BTNH.shape
    shape = dict(num_heads=N + 1, head_dim=H, num_axes=ranks[0])
    others = family.module.init(jax.random.key(0), **shape, **settings)  # tagged, 3 heads
    with pytest.raises(ValueError, match="made by Encoder.*not by this Encoder"):
        enc.precompute(others, pos_TA)


def test_tagged_parameters_survive_vmap_grad_tree_map_pickle_and_export():
    keys = jax.random.split(jax.random.key(0), 3)
    ensemble = jax.vmap(
        lambda k: rope_mixed.init(k, num_heads=N, head_dim=H, num_axes=2, rotary_fraction=0.5)
    )(keys)
    assert isinstance(ensemble, encodings.Params) and ensemble["freqs_ANF"].shape[0] == 3
    x_BTNH, pos_TA = _inputs()
    out = jax.vmap(lambda p: rope_mixed.apply(p, x_BTNH, pos_TA))(ensemble)
    member = jax.tree.map(lambda a: a[1], ensemble)
    assert member.encoder == ensemble.encoder
    want = rope_mixed.apply(dict(member), x_BTNH, pos_TA, rotary_fraction=0.5)
    np.testing.assert_allclose(out[1], want, rtol=1e-5, atol=1e-5)
    grads = jax.grad(lambda p: jnp.sum(rope_mixed.apply(p, x_BTNH, pos_TA) ** 3))(member)
    assert grads.encoder == member.encoder
    assert pickle.loads(pickle.dumps(member)).encoder == member.encoder
    exported = jax.export.export(jax.jit(rope_mixed.apply))(member, x_BTNH, pos_TA)
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_allclose(restored.call(member, x_BTNH, pos_TA), want, rtol=1e-5, atol=1e-5)


def test_an_encoder_is_a_hashable_value_that_checks_its_settings_at_once():
    enc = encodings.encoder(
        "comrope", num_heads=N, head_dim=H, num_axes=2, variant="AP", block_size=4
    )
    assert enc.hparams == {"variant": "ap", "block_size": 4, "init_std": 1.0}  # normalised
    assert hash(enc) == hash(
        encodings.encoder(
            "comrope", num_heads=N, head_dim=H, num_axes=2, variant="ap", block_size=4
        )
    )
    assert enc.convention == "unit_centred" and type(enc.init(jax.random.key(0))) is dict
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['bloc_size'\]"):
        encodings.encoder("liere", num_heads=N, head_dim=H, num_axes=2, bloc_size=4)
    with pytest.raises(ValueError, match="block_size=5"):
        encodings.encoder("liere", num_heads=N, head_dim=H, num_axes=2, block_size=5)
    with pytest.raises(ValueError, match="additive table"):
        encodings.encoder("ape", num_heads=N, head_dim=H, num_axes=2)
    with pytest.raises(ValueError, match="unknown family 'lire'"):
        encodings.encoder("lire", num_heads=N, head_dim=H, num_axes=2)


def test_precompute_once_rotates_q_and_k_as_apply_does():
    enc = encodings.encoder("liere", num_heads=N, head_dim=H, num_axes=2, block_size=4)
    params = enc.init(jax.random.key(0))
    q_BTNH, pos_TA = _inputs(seed=1)
    k_BTNH, _ = _inputs(seed=2)
    state = enc.precompute(params, pos_TA, num_prefix=1)
    np.testing.assert_allclose(state.rotate(q_BTNH), enc.apply(params, q_BTNH, pos_TA), atol=1e-6)
    np.testing.assert_allclose(state.rotate(k_BTNH), enc.apply(params, k_BTNH, pos_TA), atol=1e-6)


def test_comrope_takes_the_papers_upper_case_variants():
    x_BTNH, pos_TA = _inputs()
    for variant in ("LD", "AP"):
        params = comrope.init(
            jax.random.key(0), num_heads=N, head_dim=H, num_axes=2, variant=variant, block_size=4
        )
        lower = comrope.apply(dict(params), x_BTNH, pos_TA, variant=variant.lower())
        np.testing.assert_allclose(comrope.apply(params, x_BTNH, pos_TA, variant=variant), lower)


def _every_family():
    for name, module in {**encodings.ROTARY, **encodings.BIAS}.items():
        hparams, ranks = module.FAMILY.examples[0]
        yield pytest.param(name, dict(hparams), ranks[-1] if name != "rope" else 1, id=name)


def _call(name, params, x_BTNH, pos):
    module = encodings.ROTARY.get(name) or encodings.BIAS[name]
    if name == "alibi":
        return module.bias(params, pos, pos, num_heads=N)
    return module.apply(params, x_BTNH, pos)


def _setup(name, hparams, rank):
    module = encodings.ROTARY.get(name) or encodings.BIAS[name]
    params = module.init(jax.random.key(0), num_heads=N, head_dim=12, num_axes=rank, **hparams)
    grid = {1: (5,), 2: (2, 3), 3: (1, 2, 3)}[rank]
    pos_TA = positions.grid_positions(grid, "integer", num_prefix=1)
    x_BTNH = jax.random.normal(jax.random.key(1), (2, pos_TA.shape[0], N, 12))
    return params, x_BTNH, pos_TA


@pytest.mark.parametrize("name,hparams,rank", list(_every_family()))
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_positions_name_the_token(name, hparams, rank, bad):
    params, x_BTNH, pos_TA = _setup(name, hparams, rank)
    with pytest.raises(
        ValueError, match=rf"token t=3 is \[.*{'nan' if bad != bad else 'inf'}.*\], not finite"
    ):
        _call(name, params, x_BTNH, pos_TA.at[3, 0].set(bad))
    pos_BTA = jnp.stack([pos_TA, pos_TA.at[2, -1].set(bad)])
    with pytest.raises(ValueError, match=r"token b=1, t=2 is .* not finite"):
        _call(name, params, x_BTNH, pos_BTA)


@pytest.mark.parametrize("name,hparams,rank", list(_every_family()))
def test_traced_nan_positions_propagate_and_never_become_finite(name, hparams, rank):
    params, x_BTNH, pos_TA = _setup(name, hparams, rank)
    out = jax.jit(lambda p: _call(name, params, x_BTNH, p))(pos_TA.at[3, 0].set(jnp.nan))
    if name == "nope":
        assert bool(jnp.all(jnp.isfinite(out)))  # nothing reads the positions
    elif name == "alibi":  # the query's row and the key's column, not -0
        assert bool(jnp.all(jnp.isnan(out[:, 3, 1:]))) and bool(jnp.all(jnp.isnan(out[:, 1:, 3])))
    else:  # that token's rotation is NaN, the others are not
        assert bool(jnp.any(jnp.isnan(out[:, 3]))) and bool(jnp.all(jnp.isfinite(out[:, 4:])))


@pytest.mark.parametrize("name,hparams,rank", list(_every_family()))
def test_boolean_positions_and_four_axes_are_refused(name, hparams, rank):
    params, x_BTNH, pos_TA = _setup(name, hparams, rank)
    with pytest.raises(TypeError, match="positions must be real numbers .* got dtype bool"):
        _call(name, params, x_BTNH, pos_TA > 0)
    with pytest.raises(ValueError, match="num_axes=4; positions have 1 to 3 axes"):
        (encodings.ROTARY.get(name) or encodings.BIAS[name]).init(
            jax.random.key(0), num_heads=N, head_dim=12, num_axes=4, **hparams
        )


@pytest.mark.parametrize("name,hparams,rank", list(_every_family()))
def test_a_missing_parameter_key_is_named(name, hparams, rank):
    params, x_BTNH, pos_TA = _setup(name, hparams, rank)
    for key in sorted(params):
        partial = encodings.Params({k: v for k, v in params.items() if k != key}, params.encoder)
        with pytest.raises(ValueError, match=f"{key}|{name}"):
            _call(name, partial, x_BTNH, pos_TA)


@pytest.mark.parametrize("name", sorted(encodings.families()))
def test_every_example_stores_what_its_formula_says(name):
    for hparams, ranks in encodings.family_of(name).examples:
        for rank in ranks:
            enc = encodings.encoder(name, num_heads=N, head_dim=12, num_axes=rank, **hparams)
            stored = sum(a.size for a in jax.tree.leaves(enc.init(jax.random.key(0))))
            assert stored == enc.param_count(), (name, hparams, rank)
