"""Tests for rope_lie.models.params: stored counts match the formulas, by hand and by reference."""

from __future__ import annotations

import pytest
from flax import nnx

from rope_lie import encodings
from rope_lie.models.params import count_params, pe_param_count
from rope_lie.models.vit import ViT

# pico: width 32, depth 2, heads 2 -> head_dim 16.
TINY = dict(variant="pico/4", image_shape=(8, 12), channels=3, num_classes=5)
# hparams valid at head_dim 16 that exercise the non-default structure.
# Each family's first example (its FAMILY), e.g. ALiBi's learnable slopes.
HPARAMS = {name: dict(f.examples[0][0]) for name, f in encodings.families().items()}


def _config_for(pe, **overrides):
    """A tiny config for ``pe``; 1D RoPE needs 1D inputs."""
    config = dict(TINY, pe=pe, pe_hparams=HPARAMS.get(pe))
    if pe == "rope":
        config.update(image_shape=(24,))
    return {**config, **overrides}


def _families():
    return sorted(encodings.ROTARY) + sorted(encodings.BIAS)


def _sharing_modes():
    return [(h, layer) for h in (False, True) for layer in (False, True)]


@pytest.mark.parametrize("share_heads, share_layers", _sharing_modes())
@pytest.mark.parametrize("pe", _families())
def test_pe_param_count_matches_formula(pe, share_heads, share_layers):
    config = _config_for(pe, share_pe_heads=share_heads, share_pe_layers=share_layers)
    model = nnx.eval_shape(lambda: ViT(**config, rngs=nnx.Rngs(0)))
    num_axes = len(config["image_shape"])
    expected = pe_param_count(
        pe,
        num_heads=2,
        head_dim=16,
        num_axes=num_axes,
        depth=2,
        share_pe_heads=share_heads,
        share_pe_layers=share_layers,
        hparams=config["pe_hparams"],
    )
    counts = count_params(model)
    assert counts["by_family"] == {pe: expected}
    assert counts["position"] == expected


CAYLEY_GENERATORS = [
    {"generator": "dense"},
    {"generator": "block2x2"},
    {"generator": "banded", "bandwidth": 3},
    {"generator": "topk", "k": 10, "init_std": 0.1},
]


@pytest.mark.parametrize("share_heads, share_layers", _sharing_modes())
@pytest.mark.parametrize("hparams", CAYLEY_GENERATORS)
def test_cayley_generators_param_count_matches_formula(hparams, share_heads, share_layers):
    model = nnx.eval_shape(
        lambda: ViT(
            **TINY,
            pe="cayley_string",
            pe_hparams=hparams,
            share_pe_heads=share_heads,
            share_pe_layers=share_layers,
            rngs=nnx.Rngs(0),
        )
    )
    expected = pe_param_count(
        "cayley_string",
        num_heads=2,
        head_dim=16,
        num_axes=2,
        depth=2,
        share_pe_heads=share_heads,
        share_pe_layers=share_layers,
        hparams=hparams,
    )
    assert count_params(model)["by_family"] == {"cayley_string": expected}


@pytest.mark.parametrize(
    "pe, hparams, share_heads, share_layers, expected",
    [
        # A * N * H/2 * L RoPE-Mixed frequencies + N * H * H * L dense generators.
        ("cayley_string", None, False, False, 2 * 2 * 8 * 2 + 2 * 16 * 16 * 2),
        ("cayley_string", {"generator": "block2x2"}, True, True, 2 * 8 + 8),
        ("cayley_string", {"generator": "banded", "bandwidth": 2}, False, False, 2 * (32 + 64)),
        ("rope_mixed", None, False, False, 2 * 2 * 8 * 2),  # A * N * H/2 * L
        ("rope_mixed", None, True, True, 2 * 8),
        ("liere", {"block_size": 4}, False, True, 2 * 2 * 4 * 16),  # A * N * K * b * b
        ("liere", None, True, False, 2 * 16 * 16 * 2),  # dense: A * H * H * L
        ("circulant_string", None, False, False, 2 * 2 * 16 * 2),  # A * N * H * L
        ("comrope", {"block_size": 4}, False, False, (2 * 16 * 4 + 2 * 4) * 2),  # (NHb + AK) L
        ("comrope", {"variant": "ap", "block_size": 4}, True, True, 16 * 4),  # H b
        ("alibi", {"learnable": True}, False, False, 2 * 2),  # N * L
        ("alibi", None, False, False, 0),
        ("visionllama", None, False, False, 0),
    ],
)
def test_pe_param_count_by_hand(pe, hparams, share_heads, share_layers, expected):
    model = ViT(
        **TINY,
        pe=pe,
        pe_hparams=hparams,
        share_pe_heads=share_heads,
        share_pe_layers=share_layers,
        rngs=nnx.Rngs(0),
    )
    assert count_params(model)["by_family"][pe] == expected


@pytest.mark.parametrize(
    "pe, hparams, expected",
    [
        ("nope", None, 116_074),
        ("cayley_string", {"generator": "block2x2"}, 116_362),
        ("cayley_string", {"generator": "dense"}, 118_570),
    ],
)
def test_sparse_cayley_string_study_model(pe, hparams, expected):
    # The study's table: 0.116 M (block 2x2) and 0.118 M (dense) on CIFAR-10. Our Cayley-STRING
    # adds learnable RoPE-Mixed frequencies (192 here), hence 118_570 for dense.
    model = nnx.eval_shape(
        lambda: ViT(
            variant="string/4",
            image_shape=(32, 32),
            num_classes=10,
            pe=pe,
            pe_hparams=hparams,
            rngs=nnx.Rngs(0),
        )
    )
    assert count_params(model)["total"] == expected


@pytest.mark.parametrize(
    "variant, image_shape, classes, expected",
    [
        # timm's vit_tiny_patch16_224 / vit_base_patch16_224 (cls token, learned APE).
        ("Ti/16", (224, 224), 1000, 5_717_416),
        ("B/16", (224, 224), 1000, 86_567_656),
    ],
)
def test_reference_parameter_counts(variant, image_shape, classes, expected):
    model = nnx.eval_shape(
        lambda: ViT(
            variant=variant,
            image_shape=image_shape,
            num_classes=classes,
            additive="ape",
            rngs=nnx.Rngs(0),
        )
    )
    assert count_params(model)["total"] == expected
