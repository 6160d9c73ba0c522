"""Tests for rope_lie/evaluate.py: patch shuffling, cross-entropy, cached evaluation steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie import evaluate
from rope_lie.models.tokens import patchify


@pytest.mark.parametrize(
    "shape, patch", [((3, 8, 12, 2), (4, 4)), ((2, 4, 6, 6, 1), (2, 3, 3)), ((1, 4, 4, 1), (1, 1))]
)
def test_shuffle_patches_permutes_whole_patches(shape, patch):
    images = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    shuffled = evaluate.shuffle_patches(images, patch, np.random.default_rng(1))
    assert shuffled.shape == images.shape and shuffled.dtype == images.dtype
    tokens = np.asarray(patchify(jnp.asarray(images), patch))  # (B, T, P)
    tokens_shuffled = np.asarray(patchify(jnp.asarray(shuffled), patch))
    assert not np.array_equal(tokens, tokens_shuffled)
    for b in range(shape[0]):  # same patches per example, in another order
        order = lambda t: t[np.lexsort(t.T[::-1])]
        np.testing.assert_array_equal(order(tokens[b]), order(tokens_shuffled[b]))


def test_shuffle_patches_rejects_indivisible_images():
    with pytest.raises(ValueError, match="not divisible by patch"):
        evaluate.shuffle_patches(np.zeros((1, 6, 6, 1)), (4, 4), np.random.default_rng(0))


def test_cross_entropy_integer_and_one_hot_labels_agree():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 5)), jnp.float32)
    labels = jnp.asarray([0, 3, 4, 1])
    soft = jnp.eye(5)[labels]
    cross_entropy = jax.jit(evaluate.cross_entropy)  # a program per label kind, not per op
    np.testing.assert_allclose(
        cross_entropy(logits, labels), cross_entropy(logits, soft), rtol=1e-6
    )


def _liere_eval_steps():
    """(cached EvalStep, uncached EvalStep, params, graphdef) for a tiny LieRE ViT."""
    from flax import nnx

    from rope_lie.models.vit import ViT

    model = ViT(
        variant="pico/4",
        image_shape=(8, 12),
        channels=3,
        num_classes=5,
        pe="liere",
        pe_hparams={"block_size": 4},
        position_convention="sequential",
        head_zero_init=False,
        rngs=nnx.Rngs(0),
    )
    graphdef, state = nnx.split(model)

    def apply_fn(params, images, cache):
        return nnx.merge(graphdef, params)(images, pe_cache=cache)

    def precompute_fn(params, spatial_shape):
        merged = nnx.merge(graphdef, params)
        return merged.precompute_pe(merged.grid_of(spatial_shape))

    cached = evaluate.make_eval_step(apply_fn, precompute_fn)
    return cached, evaluate.make_eval_step(apply_fn), state, graphdef


def test_evaluate_caches_encoder_states_once_per_resolution():
    from flax import nnx

    from rope_lie import sharding

    cached, uncached, params, graphdef = _liere_eval_steps()
    calls = []

    def counting(p, spatial):
        calls.append(spatial)
        return cached.precompute(p, spatial)

    counted = evaluate.EvalStep(cached.step, counting)
    mesh = sharding.make_mesh({"data": -1})
    rng = np.random.default_rng(0)
    for size in [(8, 12), (12, 16)]:  # the training resolution, then a larger one
        batches = [
            {
                "image": rng.normal(size=(2, *size, 3)).astype(np.float32),
                "label": rng.integers(0, 5, size=(2,)),
            }
            for _ in range(3)
        ]
        got = evaluate.evaluate(counted, params, batches, mesh)
        expected = evaluate.evaluate(uncached, params, batches, mesh)
        assert got["num_examples"] == expected["num_examples"] == 6
        assert got["accuracy"] == expected["accuracy"]
        np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-6)
        # Per example, in reading order: the same as argmax of the logits here.
        images = np.concatenate([b["image"] for b in batches])
        labels = np.concatenate([b["label"] for b in batches])
        logits = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, jnp.asarray(images))
        np.testing.assert_array_equal(got["correct"], np.argmax(logits, -1) == labels)
        assert got["correct"].dtype == bool and got["correct"].mean() == got["accuracy"]
    assert calls == [(8, 12), (12, 16)]  # once per resolution, not once per batch


def test_an_evaluation_with_a_tool_computes_its_states_with_it():
    """``evaluate(..., extrapolation=tool)``: the logits of ``precompute_pe(grid, tool)``; at the
    training size the tool changes nothing, above it the loss moves; a precompute without the
    keyword, or NaFlex tokens, are errors."""
    from flax import nnx

    from rope_lie import sharding

    _, uncached, params, graphdef = _liere_eval_steps()

    def apply_fn(p, images, cache):
        return nnx.merge(graphdef, p)(images, pe_cache=cache)

    def precompute_fn(p, spatial_shape, extrapolation=None):
        merged = nnx.merge(graphdef, p)
        return merged.precompute_pe(merged.grid_of(spatial_shape), extrapolation)

    step = evaluate.make_eval_step(apply_fn, precompute_fn)
    mesh = sharding.make_mesh({"data": -1})
    rng = np.random.default_rng(0)

    @jax.jit
    def reference_loss(p, images, labels):  # the model called directly, one program per size
        model = nnx.merge(graphdef, p)
        cache = model.precompute_pe(model.input_grid(images), "pi+logit")
        return evaluate.cross_entropy(model(images, pe_cache=cache), labels).mean()

    for size in [(8, 12), (16, 24)]:
        images = rng.normal(size=(4, *size, 3)).astype(np.float32)
        batches = [{"image": images, "label": rng.integers(0, 5, size=(4,))}]
        plain = evaluate.evaluate(step, params, batches, mesh)
        with_pi = evaluate.evaluate(step, params, batches, mesh, extrapolation="pi+logit")
        loss = reference_loss(params, jnp.asarray(images), jnp.asarray(batches[0]["label"]))
        np.testing.assert_allclose(with_pi["loss"], loss, rtol=1e-5)
        if size == (8, 12):
            assert with_pi["loss"] == plain["loss"]
        else:
            assert abs(with_pi["loss"] - plain["loss"]) > 1e-4
    with pytest.raises(ValueError, match="needs an eval step with precompute"):
        evaluate.evaluate(uncached, params, batches, mesh, extrapolation="pi")
    tokens = {
        "patches": np.zeros((1, 2, 3)),
        "index": np.zeros((1, 2, 2), np.int32),
        "grid": np.ones((1, 2), np.int32),
        "token_mask": np.ones((1, 2)),
        "label": np.zeros((1,), np.int32),
    }
    with pytest.raises(ValueError, match="needs fixed-size images, not NaFlex tokens"):
        evaluate.evaluate(step, params, [tokens], mesh, extrapolation="pi")


def test_check_extrapolation_names_the_entry_before_training():
    import ml_collections as mc
    from flax import nnx

    from rope_lie.models.vit import ViT

    model = nnx.eval_shape(
        lambda: ViT(
            variant="pico/4",
            image_shape=(8, 8),
            channels=1,
            num_classes=2,
            pe="rope_mixed",
            rngs=nnx.Rngs(0),
        )
    )
    ok = mc.ConfigDict({"test": {"split": "test"}, "px16_yarn": {"extrapolation": "yarn"}})
    evaluate.check_extrapolation(model, ok)
    for tool, match in [
        ("ntk", "evals.bad.extrapolation='ntk'.*supports"),
        ("pi+yarn", "evals.bad.extrapolation='pi\\+yarn'.*expected one of"),
    ]:
        with pytest.raises(ValueError, match=match):
            evaluate.check_extrapolation(model, mc.ConfigDict({"bad": {"extrapolation": tool}}))
    naflex = mc.ConfigDict({"bad": {"extrapolation": "pi", "naflex_side": 7}})
    with pytest.raises(ValueError, match="not NaFlex tokens"):
        evaluate.check_extrapolation(model, naflex)


def test_shuffled_patches_follow_the_split_on_any_number_of_processes():
    """Process p's part of the split starts at its batches' ``first_example``: its examples get
    the permutations one process gives them, however the parts are batched (shuffled-patch
    accuracy was another number on two processes). The model reads one corner pixel."""
    from rope_lie import sharding

    step = evaluate.make_eval_step(
        lambda p, x, cache: jnp.stack([-x[:, 0, 0, 0], x[:, 0, 0, 0]], axis=-1)
    )
    mesh = sharding.make_mesh({"data": -1})
    rng = np.random.default_rng(0)
    images = rng.normal(size=(6, 8, 12, 1)).astype(np.float32)
    labels = rng.integers(0, 2, size=(6,))

    def batches(start, size, first=None):
        out = []
        for i in range(start, 6, size):
            batch = {"image": images[i : i + size], "label": labels[i : i + size]}
            out.append(batch if first is None else {**batch, "first_example": np.asarray(first)})
        return out

    def correct(batch_list):
        return evaluate.evaluate(step, None, batch_list, mesh, shuffle_patch=(4, 4), seed=3)[
            "correct"
        ]

    whole = correct(batches(0, 2))
    np.testing.assert_array_equal(correct(batches(3, 3, first=3)), whole[3:])
    np.testing.assert_array_equal(correct(batches(2, 1, first=2)), whole[2:])
    assert not np.array_equal(correct(batches(3, 3)), whole[3:])  # restarting at draw 0


def test_an_evaluation_that_sees_no_example_names_its_entry_and_split():
    import ml_collections as mc

    from rope_lie import sharding

    step = evaluate.make_eval_step(lambda p, x, cache: jnp.zeros((x.shape[0], 2)))
    entry = mc.ConfigDict(dict(name="fashion_mnist_idx/canvas44", split="test[:0]"))
    entry.shuffle_patches = False
    with pytest.raises(
        ValueError,
        match=r"evals.big \(fashion_mnist_idx/canvas44 test\[:0\]\): "
        "Evaluation saw no examples",
    ):
        evaluate.evaluate_all(
            {"big": entry},
            lambda e: [],
            step,
            None,
            sharding.make_mesh({"data": -1}),
            patch=(4, 4),
            step=0,
            best={},
            seed=0,
        )
