"""Tests for rope_lie/optim.py: weight-decay mask, schedule, optimizer choices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_lie import optim
from rope_lie.models.position_hook import PositionParam, pe_names
from rope_lie.models.variables import NoDecay
from rope_lie.models.vit import ViT


class Toy(nnx.Module):
    """Holds one parameter of every kind the mask must tell apart."""

    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(4, 6, rngs=rngs)  # kernel: decayed; bias: not
        self.norm = nnx.LayerNorm(6, rngs=rngs)  # scale and bias: not decayed
        self.freqs = PositionParam(jnp.ones((2, 3, 4)))  # position encoding: not decayed
        self.cls_1D = NoDecay(jnp.ones((1, 6)))  # class token: not decayed
        self.wq_DNH = nnx.Param(jnp.ones((6, 2, 3)))  # shape-suffixed weight: decayed
        self.bq_NH = NoDecay(jnp.ones((2, 3)))  # 2-D bias: not decayed, by its type
        self.bw_DE = nnx.Param(jnp.ones((6, 4)))  # a weight named like a bias: decayed
        self.scale_D = nnx.Param(jnp.ones((6,)))  # fewer than 2 dims: not decayed
        self.blocks = nnx.List([nnx.Linear(6, 6, rngs=rngs)])


def _params():
    return nnx.state(Toy(nnx.Rngs(0)), nnx.Param)


def test_decay_mask_selects_only_weight_matrices():
    mask = optim.decay_mask(_params())
    assert mask == {
        "dense": {"kernel": True, "bias": False},
        "norm": {"scale": False, "bias": False},
        "freqs": False,
        "cls_1D": False,
        "wq_DNH": True,
        "bq_NH": False,
        "bw_DE": True,
        "scale_D": False,
        "blocks": {0: {"kernel": True, "bias": False}},
    }


@pytest.mark.parametrize("pe", pe_names())
@pytest.mark.parametrize("kw", [{}, {"additive": "ape", "layer_scale": 0.1}])
def test_every_family_decays_exactly_the_weight_matrices(pe, kw):
    model = ViT(
        variant="pico/4",
        image_shape=(16,) if pe == "rope" else (8, 8),
        channels=1,
        num_classes=3,
        pe=pe,
        rngs=nnx.Rngs(0),
        **kw,
    )
    flat = nnx.traversals.flatten_mapping(optim.decay_mask(nnx.state(model, nnx.Param)))
    decayed = {"/".join(map(str, path)) for path, on in flat.items() if on}
    per_block = ["attn/wq_DNH", "attn/wk_DNH", "attn/wv_DNH", "attn/wo_NHD"]
    per_block += ["mlp/fc1/kernel", "mlp/fc2/kernel"]
    want = {"embed/kernel", "head/kernel"} | {f"blocks/{i}/{p}" for i in (0, 1) for p in per_block}
    assert decayed == want
    assert any("bq_NH" in "/".join(map(str, path)) for path in flat)  # the biases exist


def test_adamw_decays_only_masked_params():
    params_state = _params()
    params = nnx.to_pure_dict(params_state)
    cfg = dict(name="adamw", lr=0.1, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.5, grad_clip=0.0)
    tx, _ = optim.make_optimizer(cfg, params_state, total_steps=10)
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zero_grads, jax.jit(tx.init)(params), params)
    mask = optim.decay_mask(params_state)
    for decayed, upd, p in zip(
        jax.tree.leaves(mask), jax.tree.leaves(updates), jax.tree.leaves(params), strict=True
    ):
        if decayed:  # with zero gradients the update is the decay term, -lr * wd * p
            np.testing.assert_allclose(upd, -0.1 * 0.5 * p, rtol=1e-6)
        else:
            np.testing.assert_array_equal(upd, 0.0)


def test_schedule_warmup_then_cosine():
    cfg = dict(lr=1.0, warmup_steps=4, end_lr_ratio=0.1)
    schedule = optim.learning_rate_schedule(cfg, total_steps=12)
    np.testing.assert_allclose([schedule(i) for i in range(5)], [0, 0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(schedule(8), 0.1 + 0.9 * 0.5, rtol=1e-6)  # cosine half-way
    np.testing.assert_allclose(schedule(12), 0.1, rtol=1e-6)


def test_grad_clip_rescales_gradients_to_the_max_global_norm():
    params_state = _params()
    params = nnx.to_pure_dict(params_state)
    # b1 = b2 = 0: the Adam update is -lr * g / (|g| + eps), monotone in g, so clipping shows.
    cfg = dict(name="adam", lr=1.0, b1=0.0, b2=0.0, eps=10.0, grad_clip=1.0)
    tx, _ = optim.make_optimizer(cfg, params_state, total_steps=10)
    grads = jax.tree.map(lambda p: np.full(p.shape, 3.0, np.float32), params)
    updates, _ = jax.jit(tx.update)(grads, jax.jit(tx.init)(params), params)
    # The expected updates in numpy (in jnp, each leaf shape and operation compiles eagerly).
    leaves = jax.tree.leaves(grads)
    scale = 1.0 / np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in leaves))
    for g, u in zip(leaves, jax.tree.leaves(updates), strict=True):
        np.testing.assert_allclose(u, -(g * scale) / (np.abs(g * scale) + 10.0), rtol=1e-5)


@pytest.mark.parametrize(
    "cfg, match",
    [
        (dict(name="sgd"), "optim.name='sgd'"),
        (dict(name="adam", weight_decay=0.1), "use 'adamw'"),
        (dict(name="adamw", warmup_steps=20), "warmup_steps=20"),
    ],
)
def test_bad_optimizer_configs_fail_clearly(cfg, match):
    full = dict(name="adamw", lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0) | cfg
    with pytest.raises(ValueError, match=match):
        optim.make_optimizer(full, _params(), total_steps=10)
