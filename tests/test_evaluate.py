"""Tests for rope_lie/evaluate.py and rope_lie/metrics.py (host-side helpers)."""

import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie import evaluate, metrics
from rope_lie.models.vit import patchify


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
    np.testing.assert_allclose(
        evaluate.cross_entropy(logits, labels), evaluate.cross_entropy(logits, soft), rtol=1e-6
    )


def test_metrics_writer_drops_lines_after_the_resume_step(tmp_path):
    writer = metrics.MetricsWriter(str(tmp_path), tensorboard=False)
    for step in (10, 20, 30):
        writer.write(step, {"loss": np.float32(0.5), "acc": float("nan")})
    writer.close()
    metrics.MetricsWriter(str(tmp_path), start_step=20, tensorboard=False).close()
    records = metrics.read_jsonl(tmp_path / metrics.JSONL_NAME)
    assert [r["step"] for r in records] == [10, 20]
    assert records[0] == {"step": 10, "loss": 0.5, "acc": "nan"}  # numpy -> JSON; nan as text


def test_format_table():
    table = metrics.format_table([{"eval": "g08", "accuracy": 0.5}], ["eval", "accuracy"])
    assert table.splitlines() == ["eval  accuracy", "----  --------", "g08   0.5000"]
