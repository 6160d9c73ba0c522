"""Extrapolation tools in the ViT (``ViT.precompute_pe(grid, extrapolation=...)``): the identity
at the training grid, PI equal to the conventions that interpolate by construction, the q/k
scale reaching the attention logits (folded P and ALiBi's bias included), shared layers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_lie.models.vit import ViT
from rope_lie.models.xla_attention import attention_probs


def _vit(pe, convention="integer", pe_hparams=None, **kw):
    return ViT(
        variant="pico/4",
        image_shape=(8, 12),
        channels=1,
        num_classes=5,
        pe=pe,
        pe_hparams=pe_hparams,
        position_convention=convention,
        head_zero_init=False,
        rngs=nnx.Rngs(0),
        **kw,
    )


CASES = [
    ("rope_axial", "integer", None, ("pi", "ntk", "yarn", "logit", "ntk+logit")),
    ("rope_mixed", "integer", None, ("pi", "yarn", "logit", "pi+logit")),
    ("liere", "sequential", {"block_size": 4}, ("pi", "logit")),
    ("cayley_string", "integer", None, ("pi", "logit")),
    ("alibi", "integer", None, ("pi", "logit")),
]


@pytest.mark.parametrize("pe, convention, hparams, tools", CASES)
def test_every_tool_is_the_identity_at_the_training_grid(pe, convention, hparams, tools):
    model = _vit(pe, convention, hparams)
    plain = model.precompute_pe(model.train_grid)
    for tool in tools:
        got = model.precompute_pe(model.train_grid, extrapolation=tool)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(plain), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "pe, convention, interpolating, hparams",
    [
        ("rope_mixed", "integer", "autoscale", {}),
        ("rope_axial", "integer", "autoscale", {}),
        ("liere", "sequential", "normalized", {"value_range": (0.0, 1.0)}),
    ],
)
def test_pi_is_the_convention_that_interpolates_by_construction(
    pe, convention, interpolating, hparams
):
    """Integer positions times n_train / n are autoscale's; sequential ones are [0, 1] at
    every grid. Same weights, so the same logits."""
    images = jax.random.normal(jax.random.key(1), (2, 16, 24, 1))
    model = _vit(pe, convention)
    other = _vit(pe, interpolating, position_hparams=hparams)
    nnx.update(other, nnx.state(model))
    got = model(images, pe_cache=model.precompute_pe((4, 6), extrapolation="pi"))
    np.testing.assert_allclose(got, other(images), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(got) - np.asarray(model(images))).max() > 1e-3


@pytest.mark.parametrize("pe", ["cayley_string", "alibi", "rope_axial"])
def test_logit_scaling_reaches_the_attention_logits(pe):
    """Through the attention's own path (P folded into the projections, ALiBi's bias): the
    probabilities are the softmax of the plain logits times log(T) / log(T_train)."""
    model = _vit(pe)
    grid = (4, 6)
    block = model.blocks[0]
    x = block.ln1(jax.random.normal(jax.random.key(2), (2, 25, model.embed.out_features)))
    plain_state = model.precompute_pe(grid)[0]
    scaled_state = model.precompute_pe(grid, extrapolation="logit")[0]
    q, k, _, bias = block.attn.qkv(x, None, pe_state=plain_state)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / math.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + bias
    ratio = math.log(25) / math.log(7)  # 4 x 6 + the class token, 2 x 3 + 1 in training
    want = jax.nn.softmax(ratio * logits, axis=-1)
    got = block.attn.probs(x, scaled_state)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert np.abs(np.asarray(got) - np.asarray(attention_probs(q, k, bias))).max() > 1e-3


def test_layers_sharing_parameters_share_the_scaled_state():
    model = _vit("rope_mixed", share_pe_layers=True)
    states = model.precompute_pe((4, 6), extrapolation="yarn")
    assert len(states) == len(model.blocks) and all(s is states[0] for s in states)
    assert float(states[0].qk_scale) == pytest.approx(0.1 * math.log(4.0) + 1.0)


def test_an_unsupported_tool_names_the_family_and_what_it_supports():
    model = _vit("rope_mixed")
    with pytest.raises(ValueError, match="pe='rope_mixed'.*supports \\('pi', 'yarn', 'logit'\\)"):
        model.precompute_pe((4, 6), extrapolation="ntk")
