"""position_hook.LAYER_PLANS: every layer's encoder state one by one ("each", the CPU's) or in
one vmapped precompute over the stacked layers ("batched", the accelerators'), equal to float32
rounding; the batched program holds one LieRE squaring loop where "each" holds one per layer."""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_lie import encodings
from rope_lie.encodings import expm, expm_combination, liere
from rope_lie.models import position_hook
from rope_lie.models.vit import ViT

DEPTH = 3
TINY = dict(variant="pico/4", dims={"depth": DEPTH}, image_shape=(8, 12), channels=3, num_classes=5)
HPARAMS = {name: dict(f.examples[0][0]) for name, f in encodings.families().items()}


def _model(pe: str, **overrides) -> ViT:
    config = dict(TINY, pe=pe, pe_hparams=HPARAMS.get(pe), head_zero_init=False)
    if pe == "rope":
        config.update(image_shape=(24,))
    return ViT(**{**config, **overrides}, rngs=nnx.Rngs(0))


def _states(model: ViT, plan: str):
    attn = model.blocks[0].attn
    pos = model.positions(model.input_grid(jnp.zeros((1, *model.image_shape, 3))))
    return position_hook.layer_states(
        attn.encoder,
        [block.attn.pe_arrays() for block in model.blocks],
        pos,
        num_prefix=attn.num_prefix,
        fold=attn.fold_mix,
        plan=plan,
    )


def _assert_close(a, b, tol):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@pytest.mark.parametrize("pe", sorted(encodings.ROTARY) + sorted(encodings.BIAS))
def test_batched_states_equal_each_layers_own(pe):
    model = _model(pe)
    each, batched = _states(model, "each"), _states(model, "batched")
    assert len(each) == len(batched) == DEPTH
    assert [type(s) for s in each] == [type(s) for s in batched]
    _assert_close(each, batched, 2e-6)


@pytest.mark.parametrize(
    "pe, tool", [("liere", "pi"), ("rope_mixed", "yarn"), ("comrope", "logit")]
)
def test_an_extrapolation_tool_gives_the_same_states_under_both_plans(pe, tool, monkeypatch):
    model = _model(pe)
    states = {}
    for plan in ("each", "batched"):
        monkeypatch.setitem(position_hook.LAYER_PLANS, "cpu", plan)
        states[plan] = model.precompute_pe((4, 6), tool)
    _assert_close(states["each"], states["batched"], 2e-6)


@pytest.mark.parametrize("pe", ["liere", "cayley_string", "comrope"])
def test_a_train_loss_and_its_gradients_are_the_same_under_both_plans(pe, monkeypatch):
    model = _model(pe, dropout=0.0)
    graphdef, params = nnx.split(model)
    images = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 12, 3)), jnp.float32)

    def loss(p):
        return jnp.mean(jnp.square(nnx.merge(graphdef, p)(images)))

    results = {}
    for plan in ("each", "batched"):
        monkeypatch.setitem(position_hook.LAYER_PLANS, "cpu", plan)
        results[plan] = jax.jit(jax.value_and_grad(loss))(params)
    _assert_close(results["each"], results["batched"], 2e-5)


@pytest.mark.parametrize("plan", ["each", "batched"])
def test_liere_s_squaring_loops_give_the_same_loss_and_gradients(plan, monkeypatch):
    # A GPU host's exponentials on this CPU, with its squarings in one data-dependent loop
    # ("while": every platform's) and with a loop of fixed length first ("fixed"), under both
    # plans ("batched" vmaps the loops). The recipe's generators (init_scale 2 pi) need up to 5
    # squarings at these positions: the fixed loop is cut to 2, so the loop after it runs too.
    monkeypatch.setattr(expm, "FIXED_SQUARINGS", 2)
    monkeypatch.setitem(position_hook.LAYER_PLANS, "cpu", plan)
    monkeypatch.setattr(expm, "this_host", lambda: expm.Host("gpu", 1))
    model = _model("liere", dropout=0.0, pe_hparams={"block_size": 8})
    graphdef, params = nnx.split(model)
    images = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 12, 3)), jnp.float32)

    def loss(p):
        return jnp.mean(jnp.square(nnx.merge(graphdef, p)(images)))

    # The host and its loop are read when a program is traced, and LieRE's jitted functions
    # keep their traces (a process has one host): traced afresh for each loop (the scans in the
    # gradient's jaxpr say which loop it holds), and once more after, for the tests that follow.
    jitted = (liere._rotations, expm_combination._combination_jit, expm._expm_skew_jit)
    results, scans = {}, {}
    try:
        for loop in ("while", "fixed"):
            monkeypatch.setitem(expm.SQUARING_LOOPS, "default", loop)
            for fn in jitted:
                fn.clear_cache()
            step = jax.value_and_grad(loss)
            scans[loop] = _count(jax.make_jaxpr(step)(params).jaxpr, "scan")
            results[loop] = jax.jit(step)(params)
    finally:
        for fn in jitted:
            fn.clear_cache()
    assert scans["while"] == 0 and scans["fixed"] > 0, scans
    # Equal to float32 rounding, judged per array by norm: the suite's fast-compile XLA flags
    # round single elements of these ill-conditioned gradients differently (up to 2e-4 of an
    # element, 3e-6 of the largest; the default flags give equal bits on this CPU).
    for a, b in zip(
        jax.tree.leaves(results["while"]), jax.tree.leaves(results["fixed"]), strict=True
    ):
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(a), (np.abs(a - b).max(), a.shape)


def _count(jaxpr: jax.extend.core.Jaxpr, primitive: str) -> int:
    """Equations of ``primitive`` in a jaxpr and every jaxpr it calls (each call counted)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == primitive
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += _count(sub, primitive)
    return total


def _while_loops(plan: str, monkeypatch) -> int:
    monkeypatch.setitem(position_hook.LAYER_PLANS, "cpu", plan)
    model = _model("liere", pe_hparams={"block_size": 8})
    graphdef, params = nnx.split(model)
    images = jnp.zeros((2, 8, 12, 3))

    def loss(p):
        return jnp.sum(nnx.merge(graphdef, p)(images))

    return _count(jax.make_jaxpr(jax.grad(loss))(params).jaxpr, "while")


def test_the_batched_plan_runs_one_squaring_loop_for_all_layers(monkeypatch):
    each, batched = _while_loops("each", monkeypatch), _while_loops("batched", monkeypatch)
    # expm_combination: one loop forward, two in the gradient (the row groups and the squarings)
    assert each == DEPTH * batched, (each, batched)


def test_plans_by_platform_and_a_wrong_plan_is_named(monkeypatch):
    assert position_hook.layer_plan("cpu") == "each"
    assert position_hook.layer_plan("gpu") == position_hook.layer_plan("tpu") == "batched"
    monkeypatch.setitem(position_hook.LAYER_PLANS, "gpu", "scan")
    with pytest.raises(ValueError, match=r"LAYER_PLANS\['gpu'\]='scan'.*'each', 'batched'"):
        position_hook.layer_plan("gpu")
    model = _model("liere")
    with pytest.raises(ValueError, match=r"plan='both'; expected one of \['each', 'batched'\]"):
        _states(model, "both")
