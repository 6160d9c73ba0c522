"""Every float32 contraction of every encoder runs at full float32 precision on every platform.

XLA:GPU contracts float32 in TF32 by default (10 mantissa bits: a LieRE block product's error
was 5e-4 of its largest value on an H100) and a TPU in one bfloat16 pass, unless the contraction
asks for ``Precision.HIGHEST``. A CPU computes float32 whatever the request, so the CPU's
results cannot show a missing request: the lowered programs can. Each family's precompute and
apply (and the bias families' bias) are lowered for CUDA, TPU and the CPU at once (each
platform's branch of ``lax.platform_dependent`` included), and every ``dot_general`` in them
must carry HIGHEST.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from rope_lie import encodings
from rope_lie.encodings import ape, positions

N, H = 2, 12

CASES = [
    pytest.param(name, dict(hparams), max(ranks), id=f"{name}-{i}")
    for kind in (encodings.ROTARY, encodings.BIAS)
    for name, module in kind.items()
    for i, (hparams, ranks) in enumerate(module.FAMILY.examples)
]


def _dots_without_highest(fn, *args) -> list[str]:
    export = jax.export.export(jax.jit(fn), platforms=["cuda", "tpu", "cpu"])
    text = export(*args).mlir_module()
    dots = [ln for ln in text.splitlines() if "stablehlo.dot_general" in ln]
    return [ln.strip() for ln in dots if not re.search(r"precision = \[HIGHEST, HIGHEST\]", ln)]


@pytest.mark.parametrize("name, hparams, rank", CASES)
def test_every_contraction_asks_for_float32(name, hparams, rank):
    enc = encodings.encoder(name, num_heads=N, head_dim=H, num_axes=rank, **hparams)
    params = enc.init(jax.random.key(0))
    pos_TA = positions.grid_positions({1: (5,), 2: (2, 3), 3: (2, 2, 2)}[rank], "integer")
    x_BTNH = jnp.ones((2, pos_TA.shape[0], N, H), jnp.float32)
    if enc.family.kind == "bias":
        loose = _dots_without_highest(enc.bias, params, pos_TA, pos_TA)
    else:
        loose = _dots_without_highest(enc.apply, params, x_BTNH, pos_TA)
        rotate = lambda p, x, pos: enc.precompute(p, pos).rotate(x)  # noqa: E731
        loose += _dots_without_highest(rotate, params, x_BTNH, pos_TA)
    assert not loose, "\n".join(loose[:3])


def test_ape_resizes_its_table_in_float32():
    params = ape.init(jax.random.key(0), grid_shape=(3, 4), width=8, num_prefix=1)
    index_BTA = jnp.zeros((2, 5, 2), jnp.int32)
    grid_BA = jnp.array([[4, 5], [3, 6]], jnp.int32)
    assert not _dots_without_highest(ape.gather, params, index_BTA, grid_BA)
