"""rope_lie.interop: PyTorch ViTs (timm's naver RoPE ViTs and DINOv3, the LieRE reference)
converted with the same logits, the convert command, load, and fine-tuning a converted model
with config.init_from.

The PyTorch half runs in its own process (``tests/interop_torch_side.py``: PyTorch's triton
crashes a process that has loaded TensorFlow, as this session has): it builds small models with
timm's own code and with the LieRE reference re-implemented module for module, saves their
weights as checkpoint files, converts them with the command's ``main`` and records PyTorch's
logits. This process loads the converted workdirs with ``interop.load`` (no PyTorch) and
compares, each side having changed resolution its own way (timm's ``dynamic_img_size``, the
reference's position grid), at the training resolution and at 1.5x. The models have 2 blocks
of width 64 (timm) or 128 (LieRE, whose reference fixes 64 channels per head), with weights
scaled so that every part moves the logits, which are O(10).
"""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds
from flax import nnx

import rope_lie
from rope_lie import checkpoint, config_lib, interop, train
from rope_lie.data.spatial_arrows import SpatialArrowsConfig
from rope_lie.interop import timm_eva

TOL = 1e-4  # |logit difference|, float32
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMM_SIDES = (32, 48)
LIERE_SIDES = (16, 24)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> str:
    """The torch side's output directory (one process for every case of this file)."""
    if importlib.util.find_spec("timm") is None or importlib.util.find_spec("torch") is None:
        pytest.skip('needs the interop extra: pip install -e ".[interop]"')
    out = str(tmp_path_factory.mktemp("interop"))
    script = os.path.join(REPO, "tests", "interop_torch_side.py")
    run = subprocess.run([sys.executable, script, out], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


def _max_diffs(directory: str, case: str, sides, model=None, what="logits") -> dict[int, float]:
    """max |difference| per side between the converted model's logits (or, ``what="features"``,
    what enters its classifier) and PyTorch's on the same images."""
    if model is None:
        model, _ = interop.load(os.path.join(directory, case))
    if what == "features":  # the classifier made the identity: the model returns its input
        width = model.head.in_features
        model.head = nnx.Linear(width, width, rngs=nnx.Rngs(0))
        model.head.kernel[...], model.head.bias[...] = jnp.eye(width), jnp.zeros(width)
    ref = np.load(os.path.join(directory, f"{case.removesuffix('_as_stored')}.npz"))
    diffs = {}
    for side in sides:
        expected = ref[f"{what}_{side}"]
        got = np.asarray(model(jnp.asarray(ref[f"images_{side}"].transpose(0, 2, 3, 1))))
        assert got.shape == expected.shape and np.abs(expected).max() > 1.0  # values that matter
        diffs[side] = float(np.abs(got - expected).max())
    return diffs


@pytest.mark.parametrize("case", ["rope_axial", "rope_mixed", "rope_mixed_ape"])
def test_timm_rope_vits_give_the_same_logits_at_two_resolutions(converted, case):
    """RoPE-Axial, RoPE-Mixed and RoPE-Mixed + APE (the classes and kwargs of timm's
    vit_small_patch16_rope{,_mixed}{,_ape}_224 at width 64), converted from a checkpoint file:
    equal logits at 32 px (the training resolution) and 48 px (timm resizes pos_embed and
    recomputes the rope grid, rope_lie too). The same model with its position axes swapped
    (timm's "xy" read as "ij") fails the check: the comparison sees the axis order."""
    model, config = interop.load(os.path.join(converted, case))
    assert config.model.layer_scale == 1e-5 and config.model.norm_eps == 1e-6
    diffs = _max_diffs(converted, case, TIMM_SIDES, model)
    assert max(diffs.values()) < TOL, diffs
    for block in model.blocks:  # swap the axes: halves of q/k channels, or the frequency rows
        attn = block.attn
        if config.model.pe == "rope_axial":
            h = attn.head_dim
            for w in (attn.wq_DNH, attn.wk_DNH):
                w[...] = jnp.roll(w[...], h // 2, axis=-1)
        else:
            freqs = attn.pe_params["freqs_ANF"]
            freqs[...] = freqs[...][::-1]
    assert min(_max_diffs(converted, case, TIMM_SIDES, model).values()) > 10 * TOL


def test_a_timm_checkpoint_with_another_class_count_converts(converted):
    """A fine-tuned timm checkpoint whose head has 10 classes, converted without saying so
    (timm's default head has 1000): the class count is read from the checkpoint, and the logits
    are the PyTorch model's."""
    model, config = interop.load(os.path.join(converted, "rope_mixed_head_read"))
    assert config.model.num_classes == 10
    diffs = _max_diffs(converted, "rope_mixed", TIMM_SIDES, model)
    assert max(diffs.values()) < TOL, diffs


@pytest.mark.parametrize("case, qkv_bias", [("dinov3", False), ("dinov3_qkvb", True)])
def test_timm_dinov3_vits_give_the_same_logits_at_two_resolutions(converted, case, qkv_bias):
    """timm's DINOv3 (vit_small_patch16_dinov3{,_qkvb} at width 64, class-token pooling, 4
    registers), converted from a checkpoint file: equal logits at 32 px and 48 px (timm
    recomputes the centred coordinates, rope_lie too). Each part of the conversion is seen by
    the check: timm's half-split channel order left as it is, the positions as patch indices
    instead of pixel centres, or the registers zeroed, each moves the logits."""
    model, config = interop.load(os.path.join(converted, case))
    assert (config.model.pe, config.model.position_convention) == ("dinov3", "centred")
    assert config.model.num_registers == 4 and config.model.qkv_bias is qkv_bias
    assert config.model.norm_eps == 1e-5 and config.model.layer_scale == 1e-5
    diffs = _max_diffs(converted, case, TIMM_SIDES, model)
    assert max(diffs.values()) < TOL, diffs
    model.position_convention = "integer"
    assert min(_max_diffs(converted, case, TIMM_SIDES, model).values()) > 10 * TOL
    model, _ = interop.load(os.path.join(converted, case))
    model.reg_RD[...] = jnp.zeros_like(model.reg_RD[...])
    assert min(_max_diffs(converted, case, TIMM_SIDES, model).values()) > 10 * TOL
    model, _ = interop.load(os.path.join(converted, case))
    h = model.blocks[0].attn.head_dim
    back_H = np.argsort(timm_eva.qk_permutation(h, half_split=True, column_first=False))
    for block in model.blocks:  # q and k channels back in timm's (j, j + H/2) order
        for w in (block.attn.wq_DNH, block.attn.wk_DNH):
            w[...] = w[...][..., back_H]
    assert min(_max_diffs(converted, case, TIMM_SIDES, model).values()) > 10 * TOL


@pytest.mark.parametrize("case", ["dinov3", "dinov3_qkvb"])
def test_features_equal_timms_forward_intermediates(converted, case):
    """``ViT.features`` of a converted timm DINOv3 (4 registers, the class token) against
    timm's ``forward_intermediates(indices=None, norm=..., output_fmt="NLC",
    return_prefix_tokens=True)``: every block's patch tokens and its prefix tokens apart, normed
    and not, at 32 px and 48 px, to float32 precision. Layer 0 is not layer 1: the check sees
    which layer is returned."""
    model, _ = interop.load(os.path.join(converted, case))
    ref = np.load(os.path.join(converted, f"{case}.npz"))
    for side in TIMM_SIDES:
        images = jnp.asarray(ref[f"images_{side}"].transpose(0, 2, 3, 1))
        for norm in (0, 1):
            feats = model.features(images, layers=2, norm=bool(norm))
            patch, prefix = ref[f"patch_{norm}_{side}"], ref[f"prefix_{norm}_{side}"]
            assert patch.shape == (2, 2, (side // 8) ** 2, 64) and prefix.shape == (2, 2, 5, 64)
            for layer in range(2):
                scale = np.abs(patch[layer]).max()
                np.testing.assert_allclose(feats.patch[layer], patch[layer], atol=1e-5 * scale)
                np.testing.assert_allclose(feats.prefix[layer], prefix[layer], atol=1e-5 * scale)
            assert np.abs(np.asarray(feats.patch[0]) - patch[1]).max() > 1e-2 * scale


@pytest.mark.parametrize(
    "case, final_norm, fc_norm",
    [
        ("dinov3_avg", True, False),
        ("dinov3_avg_fc_norm", False, True),
        ("rope_mixed_avg", False, True),
    ],
)
def test_timm_avg_pooling_gives_the_same_logits_at_two_resolutions(
    converted, case, final_norm, fc_norm
):
    """timm's global_pool="avg" (DINOv3's default in timm): the mean of the patch tokens, the
    class token and registers left out, with timm's final norm before it (DINOv3's
    use_fc_norm=False) or its fc_norm after it (use_fc_norm=True; a naver ViT with "avg"),
    converted from a checkpoint file: equal logits at 32 px and 48 px, and the workdir loads
    with rope_lie.load. Pooling the class token instead moves the logits: the check sees it."""
    model, config = rope_lie.load(os.path.join(converted, case))
    assert config.model.pool == "mean_with_cls"
    assert (config.model.final_norm, config.model.fc_norm) == (final_norm, fc_norm)
    assert (model.norm is not None, model.fc_norm is not None) == (final_norm, fc_norm)
    diffs = _max_diffs(converted, case, TIMM_SIDES, model)
    assert max(diffs.values()) < TOL, diffs
    model.pool = "cls"
    assert min(_max_diffs(converted, case, TIMM_SIDES, model).values()) > 10 * TOL


def test_timm_avg_pooling_without_a_class_token_is_the_mean_pool(converted):
    """class_token=False with global_pool="avg": rope_lie's pool="mean", no class token; equal
    logits at 32 px and 48 px."""
    model, config = rope_lie.load(os.path.join(converted, "rope_axial_avg_no_class_token"))
    assert config.model.pool == "mean" and model.cls_1D is None and model.num_prefix == 0
    diffs = _max_diffs(converted, "rope_axial_avg_no_class_token", TIMM_SIDES, model)
    assert max(diffs.values()) < TOL, diffs


def test_a_headless_dinov3_converts_with_an_identity_head(converted):
    """DINOv3's released weights have no classifier: converted without a class count, the model
    returns timm's pooled features (width 64), and the config says so. A pretrained tag's input
    normalisation is the one written (``.sat493m``: the satellite images' statistics)."""
    diffs = _max_diffs(converted, "dinov3_headless", TIMM_SIDES)
    assert max(diffs.values()) < TOL, diffs
    model, config = interop.load(os.path.join(converted, "dinov3_headless"))
    assert config.model.num_classes == 64
    np.testing.assert_array_equal(model.head.kernel[...], np.eye(64))
    assert any("identity" in note for note in config.interop.notes)
    assert config.dataset.mean == (0.485, 0.456, 0.406)  # DINOv3's lvd1689m: ImageNet's
    _, config = interop.load(os.path.join(converted, "dinov3_sat493m"))
    assert config.dataset.mean == (0.430, 0.411, 0.296) and config.model.num_registers == 4


def test_qk_permutation_is_the_naver_half_swap_and_dinov3s_pair_order():
    """RoPE-Axial under "xy" swaps the halves of the channels (the converter's earlier np.roll);
    DINOv3's half-split pair j, channels (j, j + H/2), becomes channels (2j, 2j + 1)."""
    np.testing.assert_array_equal(
        timm_eva.qk_permutation(16, half_split=False, column_first=True), np.roll(np.arange(16), -8)
    )
    np.testing.assert_array_equal(
        timm_eva.qk_permutation(8, half_split=True, column_first=False), [0, 4, 1, 5, 2, 6, 3, 7]
    )
    np.testing.assert_array_equal(
        timm_eva.qk_permutation(8, half_split=True, column_first=True), [2, 6, 3, 7, 0, 4, 1, 5]
    )


LIERE_CASES = [
    "liere_dense_per_layer_head",
    "liere_8x8_per_layer_head",
    "liere_dense_shared",
    "liere_8x8_shared",
]


@pytest.mark.parametrize("case", LIERE_CASES)
def test_liere_reference_checkpoints_give_the_same_logits_at_two_resolutions(converted, case):
    """LieRE dense and 8x8 blocks, generators per layer and head or shared by all, from a
    checkpoint in the reference's Lightning layout, architecture read from the shapes: equal
    logits at 16 px and 24 px (the reference's grid linspace(0, n / n_train, n)). With per-layer
    generators the reference uses layer 0's in every layer (its models/vit.py); the stored
    per-layer generators ("as_stored") then give other logits."""
    diffs = _max_diffs(converted, case, LIERE_SIDES)
    assert max(diffs.values()) < TOL, diffs
    _, config = interop.load(os.path.join(converted, case))
    assert config.model.share_pe_layers and config.model.qkv_bias is False
    assert config.model.share_pe_heads == ("shared" in case)
    assert any("pos_embedding" in note for note in config.interop.notes)
    if "per_layer" in case:
        assert any("layers 1..1" in note for note in config.interop.notes)
    if case == "liere_8x8_per_layer_head":
        stored = _max_diffs(converted, f"{case}_as_stored", LIERE_SIDES[:1])
        assert stored[LIERE_SIDES[0]] > 10 * TOL


def test_random_initialisations_convert_and_load(converted):
    """--checkpoint=none: timm's random init and the reference's (under --seed) load back with
    PyTorch's features (what enters the classifier: randomly initialised heads give logits of
    ~1e-3, too small to compare); the config says where they came from and how to normalise."""
    for case, side in (("arrows_source", 32), ("liere_random", 16)):
        assert _max_diffs(converted, case, (side,), what="features")[side] < TOL
    _, config = interop.load(os.path.join(converted, "arrows_source"))
    assert config.interop.source == "timm" and config.interop.checkpoint.startswith("none")
    assert config.dataset.mean == (0.5,) and config.dataset.name == "imagenet2012"
    _, config = interop.load(os.path.join(converted, "rope_mixed"))
    assert config.dataset.mean == (0.485, 0.456, 0.406) and config.model.additive == "none"
    _, config = interop.load(os.path.join(converted, "liere_random"))
    assert config.dataset.std == (0.2023, 0.1994, 0.2010) and config.model.pe == "liere"


def test_conversion_errors_name_the_problem(converted):
    with open(os.path.join(converted, "errors.json")) as f:
        errors = json.load(f)
    assert (
        "missing keys ['norm.bias'], unexpected keys ['blocks.0.attn.extra']" in errors["bad_keys"]
    )
    assert "'vit_small_patch16_224' is not supported" in errors["name"]
    assert "num_classes=7 (--overrides) but checkpoint" in errors["head_differs"]
    assert "head of 10 classes" in errors["head_differs"]
    assert "'blocks.0.attn.qkv.weight': ((192, 64), (96, 32))" in errors["width_differs"]
    assert "vit_large_patch16_rope_mixed_ape_224" in errors["name"]  # lists the supported
    assert "global_pool='max', expected one of ['token', 'avg']" in errors["max_pool"]
    assert (
        "global_pool='max', expected one of ['avg'] (without a class token"
        in errors["max_pool_without_a_class_token"]
    )
    assert "fc_norm=LayerNorm((64,), eps=1e-06" in errors["fc_norm_eps"]
    assert "expected Identity or a timm LayerNorm with eps=1e-05" in errors["fc_norm_eps"]
    assert "'vit_small_plus_patch16_dinov3' is not supported" in errors["dinov3_swiglu"]
    assert errors["not_empty"].startswith("FileExistsError") and "not empty" in errors["not_empty"]
    assert "'depth': (3, 2)" in errors["spec_differs"]
    with pytest.raises(
        FileNotFoundError, match="not a directory written by rope_lie.main or rope_lie.convert"
    ):
        interop.load(converted)


def test_a_converted_model_fine_tunes_with_init_from_on_arrows(converted, tmp_path):
    """A converted timm RoPE-Mixed ViT (1 channel, 4 classes, 32 px), trained 2 steps on a tiny
    local spatial_arrows (4x4 cells of 8 px) with the workdir's own config.py and init_from: it
    starts from the converted weights (every parameter within 1e-2 of them after 2 Adam steps
    at 1e-3, the head moved: neither a fresh init nor a frozen copy) and evaluates."""
    data_dir = str(tmp_path / "tfds")
    tfds.builder(
        "spatial_arrows",
        config=SpatialArrowsConfig(
            name="interop_g4",
            grid_size=4,
            num_train=16,
            num_test=8,
            num_distractor_arrows=2,
            num_letters=2,
        ),
        data_dir=data_dir,
    ).download_and_prepare()
    source = os.path.join(converted, "arrows_source")
    recipe = importlib.util.spec_from_file_location("converted_recipe", f"{source}/config.py")
    module = importlib.util.module_from_spec(recipe)
    recipe.loader.exec_module(module)  # what rope_lie.main's --config=DIR/config.py does
    config = module.get_config()
    config.dataset = config_lib.dataset_config(
        "spatial_arrows/interop_g4", data_dir=data_dir, mean=(0.5,), std=(0.5,)
    )
    config.update(
        dict(
            init_from=source,
            total_steps=2,
            batch_size=8,
            eval_batch_size=8,
            progress=False,
            tensorboard=False,
        )
    )
    config.optim.lr, config.checkpoint.every_steps = 1e-3, 2
    final = train.train_and_evaluate(config, str(tmp_path / "tuned"))
    assert final["step"] == 2 and final["evals"]["val"]["num_examples"] == 8
    _, before = checkpoint.load_state(os.path.join(source, "checkpoints"))
    _, after = checkpoint.load_state(str(tmp_path / "tuned" / "checkpoints"))
    after = {
        checkpoint.path_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(after["params"])
    }
    for path, value in jax.tree_util.tree_leaves_with_path(before["params"]):
        moved = np.abs(after[checkpoint.path_name(path)] - value).max()
        assert moved < 1e-2, (checkpoint.path_name(path), moved)
    assert not np.array_equal(after["head/kernel"], before["params"]["head"]["kernel"])
