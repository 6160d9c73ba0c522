"""bfloat16 activations, as accelerators train: every family's logits stay near float32's.

The model's ``dtype="bfloat16"`` puts the activations (projections, MLP, norms' outputs) in
bfloat16; parameters stay float32, and the encoders keep their own arithmetic in float32: the
states (angles, rotations, spectra, biases) are float32, ``rotate_pairs`` and the block
rotations cast to float32 before they rotate, the circulant FFT runs in float32, and the
attention's logits, softmax statistics and the "chunked" accumulators are float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rope_lie import encodings
from rope_lie.models import ViT, position_hook

# Each family's first example (its FAMILY): LieRE 4x4 blocks, Cayley-STRING with S != 0, ...
HPARAMS = {name: dict(f.examples[0][0]) for name, f in encodings.families().items()}
# (pe, additive): every rotary and bias family, and the two additive tables.
FAMILIES = [(pe, "none") for pe in position_hook.pe_names()] + [("nope", "ape"), ("nope", "sincos")]
# Measured relative distances ||l16 - l32|| / ||l32|| were 0.007-0.011 for every family (pico,
# 64 tokens, 2 layers); bfloat16's epsilon is 2^-8 = 0.0039.
MAX_RELATIVE_DISTANCE = 0.02


def _models(pe: str, additive: str, attention: str = "xla"):
    """The same float32 parameters in a float32 and a bfloat16 pico ViT, and an input batch."""
    one_d = pe == "rope"  # 1D RoPE takes 1D positions
    kwargs = dict(
        variant="pico/4",
        image_shape=(64,) if one_d else (32, 32),
        patch_size=(4,) if one_d else 4,
        num_classes=10,
        pe=pe,
        pe_hparams=HPARAMS.get(pe, {}),
        additive=additive,
        head_zero_init=False,
        attention=attention,
    )
    f32 = ViT(**kwargs, rngs=nnx.Rngs(0))
    bf16 = ViT(**kwargs, dtype="bfloat16", rngs=nnx.Rngs(1))
    nnx.update(bf16, nnx.state(f32, nnx.Param))
    shape = (4, 64, 3) if one_d else (4, 32, 32, 3)
    x = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)
    return f32, bf16, x


@jax.jit
def _logits_and_states(f32, bf16, x):
    return f32(x), bf16(x), bf16.precompute_pe(bf16.input_grid(x))


@pytest.mark.parametrize("pe, additive", FAMILIES)
def test_bfloat16_logits_near_float32(pe, additive):
    """The logits' distance is bounded, and the encoder states stay float32."""
    logits32, logits16, states = _logits_and_states(*_models(pe, additive))
    assert logits16.dtype == jnp.float32  # the head's output is cast back
    distance = float(jnp.linalg.norm(logits16 - logits32) / jnp.linalg.norm(logits32))
    assert 0 < distance < MAX_RELATIVE_DISTANCE, distance  # > 0: bfloat16 really was used
    for leaf in jax.tree.leaves(states):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32, (pe, leaf.dtype)


def test_bfloat16_chunked_attention_near_xla():
    """The "chunked" backend in a bfloat16 model: its float32 statistics keep the logits as
    near float32's as the "xla" backend's (ALiBi, whose bias it adds per key block)."""
    f32, bf16_xla, x = _models("alibi", "none")
    _, bf16_chunked, _ = _models("alibi", "none", attention="chunked")
    nnx.update(bf16_chunked, nnx.state(f32, nnx.Param))
    logits32, logits_xla, logits_chunked = jax.jit(lambda a, b, c, x: (a(x), b(x), c(x)))(
        f32, bf16_xla, bf16_chunked, x
    )
    for logits in (logits_xla, logits_chunked):
        distance = float(jnp.linalg.norm(logits - logits32) / jnp.linalg.norm(logits32))
        assert distance < MAX_RELATIVE_DISTANCE, distance
