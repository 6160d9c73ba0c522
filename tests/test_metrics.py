"""Tests for rope_lie/metrics.py: the JSON-lines and TensorBoard writers, the table."""

import numpy as np

from rope_lie import metrics


def test_metrics_writer_drops_lines_after_the_resume_step(tmp_path):
    writer = metrics.MetricsWriter(str(tmp_path), tensorboard=False)
    for step in (10, 20, 30):
        writer.write(step, {"loss": np.float32(0.5), "acc": float("nan")})
    writer.close()
    metrics.MetricsWriter(str(tmp_path), start_step=20, tensorboard=False).close()
    records = metrics.read_jsonl(tmp_path / metrics.JSONL_NAME)
    assert [r["step"] for r in records] == [10, 20]
    assert records[0] == {"step": 10, "loss": 0.5, "acc": "nan"}  # numpy -> JSON; nan as text


def test_metrics_writer_writes_tensorboard_scalar_events(tmp_path):
    import tensorflow as tf

    writer = metrics.MetricsWriter(str(tmp_path))
    writer.write(10, {"loss": np.float32(0.5), "eval/accuracy": 1, "note": "text"})
    writer.write(20, {"loss": 0.25, "bad": float("inf")})
    writer.close()
    (events_file,) = (tmp_path / "tensorboard").iterdir()
    scalars = []
    for record in tf.data.TFRecordDataset(str(events_file)):
        event = tf.compat.v1.Event.FromString(record.numpy())
        for value in event.summary.value:
            assert value.metadata.plugin_data.plugin_name == "scalars"  # what TensorBoard charts
            scalars.append((event.step, value.tag, float(tf.make_ndarray(value.tensor))))
    # Numbers only; text and non-finite values stay in metrics.jsonl.
    assert scalars == [(10, "loss", 0.5), (10, "eval/accuracy", 1.0), (20, "loss", 0.25)]


def test_format_table():
    table = metrics.format_table([{"eval": "g08", "accuracy": 0.5}], ["eval", "accuracy"])
    assert table.splitlines() == ["eval  accuracy", "----  --------", "g08   0.5000"]
