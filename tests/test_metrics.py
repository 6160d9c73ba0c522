"""Tests for rope_lie/metrics.py: the JSON-lines and TensorBoard writers, the table."""

import numpy as np
import pytest

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


def test_metrics_writer_knows_the_steps_the_file_has(tmp_path):
    """``has``: the steps of the records kept on resume and of those written since."""
    writer = metrics.MetricsWriter(str(tmp_path), tensorboard=False)
    for step in (10, 20, 30):
        writer.write(step, {"loss": 0.5})
    writer.close()
    writer = metrics.MetricsWriter(str(tmp_path), start_step=20, tensorboard=False)
    assert [writer.has(s) for s in (10, 20, 30)] == [True, True, False]
    writer.write(30, {"loss": 0.25})
    assert writer.has(30)
    writer.close()


def test_a_torn_last_line_is_left_out_and_a_damaged_one_before_it_is_named(tmp_path):
    """A process killed while appending leaves half a line: the resumed run reads the records
    before it (before, a bare JSONDecodeError naming no file stopped every rerun). A damaged
    line anywhere else is an error naming the file and line."""
    writer = metrics.MetricsWriter(str(tmp_path), tensorboard=False)
    for step in (10, 20):
        writer.write(step, {"loss": 0.5})
    writer.close()
    path = tmp_path / metrics.JSONL_NAME
    with open(path, "a") as f:
        f.write('{"step": 30, "lo')
    assert [r["step"] for r in metrics.read_jsonl(path)] == [10, 20]
    metrics.MetricsWriter(str(tmp_path), start_step=20, tensorboard=False).close()
    assert path.read_text().count("\n") == 2 and not (tmp_path / "metrics.jsonl.tmp").exists()
    with open(path, "a") as f:
        f.write('{"step": 30, "lo\n{"step": 40}\n')
    with pytest.raises(ValueError, match="metrics.jsonl, line 3: not a JSON record"):
        metrics.read_jsonl(path)


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
