"""The train and eval steps lower for TPU and CUDA with each attention backend (``jax.export``).

Nothing here runs on an accelerator: ``jax.export`` lowers the jitted steps of
``rope_lie/train.py`` (with their shardings and donation) for another platform, so a backend
that cannot be lowered for its device fails here, on CPU. The model is quickstart's smoke run
shrunk to the pico ViT with ALiBi, so that every backend also lowers its bias input; the train
step on padded token batches (NaFlex) also lowers each backend's key mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from configs import quickstart
from rope_lie import sharding, train
from rope_lie.models import options

BATCH, SIDE = 8, 64
# Padded token batches (NaFlex): 64 slots of 8 x 8 x 1 patches, mixed grids up to 8 x 8.
LENGTH, PATCH_VALUES = 64, 64
# The key mask as a logit bias (``xla_attention.MASKED_KEY_LOGIT``) in StableHLO text.
MASK_LOGIT_TEXT = "-1.000000e+09"


def _setup(backend: str, platform: str, **model: str):
    """Quickstart's smoke run as the pico ViT with ALiBi, checked for ``platform``: (setup,
    abstract train state, the model's other state, an abstract key)."""
    config = quickstart.get_config("smoke,pe=alibi")
    config.model.variant = "pico/8"  # 2 layers of width 32, H = 16; 8x8 grid + class token
    config.model.attention = backend
    config.model.update(model)
    options.check_model_attention(config.model, platform)
    mesh = sharding.make_mesh(config.mesh)
    model = nnx.eval_shape(lambda: train.build_model(config.model, jax.random.key(0)))
    setup, abstract_state, _, _ = train.create_setup_and_state(
        config, mesh, 4, abstract_model=model
    )
    other = nnx.split(model, nnx.Param, ...)[2]
    return setup, abstract_state, other, jax.eval_shape(lambda: jax.random.key(1))


def _export_steps(backend: str, platform: str, **model: str) -> tuple[str, str]:
    """(train step, eval step) StableHLO text exported for ``platform``; ``model``: more
    ``config.model`` fields."""
    setup, abstract_state, other, key = _setup(backend, platform, **model)
    image = jax.ShapeDtypeStruct((BATCH, SIDE, SIDE, 1), jnp.float32)
    label = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
    train_step = train.make_train_step(setup)
    exported_train = jax.export.export(train_step, platforms=(platform,))(
        abstract_state, {"image": image, "label": label}, other, key
    )
    evaluation = train.make_eval_fn(setup, other, platform)
    params = abstract_state["params"]
    cache = jax.eval_shape(lambda p: evaluation.precompute(p, (SIDE, SIDE)), params)
    batch = {"image": image, "label": label, "mask": jax.ShapeDtypeStruct((BATCH,), bool)}
    exported_eval = jax.export.export(evaluation.step, platforms=(platform,))(params, batch, cache)
    assert exported_train.platforms == exported_eval.platforms == (platform,)
    return exported_train.mlir_module(), exported_eval.mlir_module()


def _export_token_train_step(backend: str, platform: str, **model: str) -> str:
    """The train step on padded token batches (patches, grid coordinates, grids, a key mask:
    ``ViT.classify_tokens``) as StableHLO text exported for ``platform``."""
    setup, abstract_state, other, key = _setup(backend, platform, **model)
    shape = lambda dtype, *dims: jax.ShapeDtypeStruct((BATCH, *dims), dtype)  # noqa: E731
    batch = {
        "patches": shape(jnp.float32, LENGTH, PATCH_VALUES),
        "index": shape(jnp.int32, LENGTH, 2),
        "grid": shape(jnp.int32, 2),
        "token_mask": shape(jnp.float32, LENGTH),
        "label": shape(jnp.int32),
    }
    train_step = train.make_train_step(setup)
    exported = jax.export.export(train_step, platforms=(platform,))(
        abstract_state, batch, other, key
    )
    assert exported.platforms == (platform,)
    return exported.mlir_module()


@pytest.mark.parametrize(
    "backend, platform",
    [("xla", "tpu"), ("chunked", "tpu"), ("pallas", "tpu"), ("xla", "cuda"), ("chunked", "cuda")],
)
def test_steps_export(backend, platform):
    train_text, eval_text = _export_steps(backend, platform)
    for text in (train_text, eval_text):
        if backend == "pallas":  # the Mosaic kernel, forward and backward in the train step
            assert "tpu_custom_call" in text
        if backend == "chunked":  # the key-block loop
            assert "stablehlo.while" in text
    if backend == "pallas":
        assert train_text.count("tpu_custom_call") > eval_text.count("tpu_custom_call")


def test_cudnn_export_needs_cudnn_installed():
    """cuDNN's attention cannot be lowered away from a CUDA install: jax's wrapper asks the
    installed cuDNN for its version while tracing (``check_cudnn_version``), so on a machine
    without jax's CUDA plugin the export stops there. On a GPU machine the export (and the
    training) runs; ``experiments/benchmarks/device.py`` runs it there."""
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("jax's CUDA plugin is installed: cuDNN lowers here")
    with pytest.raises(RuntimeError, match="cuDNN is not detected"):
        _export_steps("cudnn", "cuda", dtype="bfloat16")  # 65 tokens: padded to 66


@pytest.mark.parametrize(
    "backend, platform",
    [("xla", "tpu"), ("pallas", "tpu"), ("xla", "cuda"), ("chunked", "cuda")],
)
def test_token_batch_train_step_exports_with_its_key_mask(backend, platform):
    """The NaFlex train step lowers with the key mask for each backend: as a logit bias of
    ``MASKED_KEY_LOGIT`` for "xla" and "chunked", as the kernel's segment ids for "pallas"
    (no mask bias in its program)."""
    text = _export_token_train_step(backend, platform)
    if backend == "pallas":
        assert "tpu_custom_call" in text and MASK_LOGIT_TEXT not in text
    else:
        assert MASK_LOGIT_TEXT in text


def test_cudnn_token_batch_export_needs_cudnn_installed():
    """cuDNN's key mask (sequence lengths) cannot be lowered here either: the same version
    check as above stops the export before cuDNN sees it (``device.py`` runs on a GPU)."""
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("jax's CUDA plugin is installed: cuDNN lowers here")
    with pytest.raises(RuntimeError, match="cuDNN is not detected"):
        _export_token_train_step("cudnn", "cuda", dtype="bfloat16", pool="mean")


def test_export_checks_the_backend_first():
    with pytest.raises(ValueError, match="model.attention='pallas' needs platform"):
        _export_steps("pallas", "cuda")
