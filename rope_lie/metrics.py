"""Metric logging: ``metrics.jsonl`` (one JSON object per log step) and TensorBoard events.

Only process 0 writes. On resume from step s, lines of ``metrics.jsonl`` with a step > s are
dropped first (they were written after the checkpoint the run restarts from and will be
written again), so the file of a resumed run reads like that of an uninterrupted one.
TensorBoard event files are append-only; TensorBoard shows the latest value of a repeated step.

The events are written by TensorFlow itself (``tf.summary.write`` with the scalars plugin's
metadata, exactly what ``tf.summary.scalar`` records), because TensorFlow is already a core
dependency (TFDS reads through it) while ``tf.summary.scalar`` and ``clu`` would need the
``tensorboard`` package too. TensorFlow is imported only when TensorBoard output is on.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

JSONL_NAME = "metrics.jsonl"


def _to_python(value: Any) -> Any:
    """JSON-able python scalar from a numpy/jax scalar (non-finite floats become strings)."""
    if isinstance(value, (np.ndarray, jax.Array)):
        value = value.item()
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file ([] if it does not exist). A last line cut short
    (the process killed while appending it) is left out; a damaged line before it is an error
    naming the file and line."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines) and not line.endswith("\n"):
                break  # a torn append
            raise ValueError(f"{path}, line {number}: not a JSON record ({e})") from None
    return records


class _EventWriter:
    """TensorBoard scalar events through TensorFlow's own summary writer (eager, no graph)."""

    def __init__(self, logdir: str):
        import tensorflow as tf  # imported here: the core loop needs TF only for events and data

        self._tf = tf
        self._writer = tf.summary.create_file_writer(logdir)
        # What tensorboard.plugins.scalar.summary_v2.scalar attaches: the scalars plugin, with
        # an empty ScalarPluginData (version 0), so TensorBoard shows these as scalar charts.
        self._metadata = tf.compat.v1.SummaryMetadata(
            plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars")
        )

    def scalar(self, tag: str, value: float, step: int) -> None:
        tf = self._tf
        with self._writer.as_default():
            tf.summary.write(tag, tf.constant(value, tf.float32), step, metadata=self._metadata)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsWriter:
    """Writes scalars to `workdir/metrics.jsonl` and to TensorBoard under `workdir/tensorboard`."""

    def __init__(self, workdir: str, *, start_step: int = 0, tensorboard: bool = True):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, JSONL_NAME)
        self._tb = None
        self._steps: set[int] = set()  # the steps the file has a record of
        if not self.enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        kept = [r for r in read_jsonl(self.path) if r.get("step", 0) <= start_step]
        self._steps = {int(r.get("step", 0)) for r in kept}
        with open(self.path + ".tmp", "w") as f:  # replaced whole: a kill keeps the old file
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(self.path + ".tmp", self.path)
        if tensorboard:
            self._tb = _EventWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, scalars: Mapping[str, Any]) -> None:
        """One JSON line {"step": step, **scalars} and one TensorBoard scalar per entry."""
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _to_python(v) for k, v in scalars.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self._steps.add(int(step))
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.scalar(key, value, int(step))
            self._tb.flush()

    def has(self, step: int) -> bool:
        """Whether the file has a record of `step` (kept on resume, or written since)."""
        return int(step) in self._steps

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """A plain-text table of `rows` (dicts) with the given columns; floats with 4 decimals."""

    def cell(value):
        return f"{value:.4f}" if isinstance(value, float) else str(value)

    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    line = lambda items: "  ".join(s.ljust(w) for s, w in zip(items, widths, strict=True)).rstrip()
    out = [line(columns), line(["-" * w for w in widths])]
    out += [line(row) for row in cells]
    return "\n".join(out)


EXAMPLES_FILE = "eval_examples.npz"


def write_examples(workdir: str, correct: Mapping[str, Any]) -> None:
    """Write workdir/eval_examples.npz: per evaluation, whether each test example was right.

    Arrays are bool, in the order of the split as the evaluation reads it (the same for every
    run of a dataset, on any number of processes), so runs can be compared example by example.
    """
    if jax.process_index() == 0:
        path = os.path.join(workdir, EXAMPLES_FILE)
        np.savez_compressed(
            path + ".tmp.npz", **{k: np.asarray(v, bool) for k, v in correct.items()}
        )
        os.replace(path + ".tmp.npz", path)


def json_safe(value: Any, path: str = "", non_finite: dict[str, str] | None = None) -> Any:
    """`value` with numpy/jax scalars as python ones and non-finite floats as None.

    Standard JSON has no NaN or Infinity (``json.dump`` writes them as bare ``NaN``, which other
    readers reject); each one replaced is recorded in `non_finite` as path -> "nan", "inf"...
    """
    if isinstance(value, Mapping):
        return {k: json_safe(v, f"{path}/{k}".lstrip("/"), non_finite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, f"{path}/{i}", non_finite) for i, v in enumerate(value)]
    if isinstance(value, (np.ndarray, jax.Array)) and np.ndim(value) == 0:
        value = value.item()
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        if non_finite is not None:
            non_finite[path] = str(value)
        return None
    return value


def _write_json(path: str, content: Mapping[str, Any]) -> None:
    """`content` as strict JSON; non-finite numbers become null, listed under "non_finite"."""
    non_finite: dict[str, str] = {}
    safe = json_safe(content, "", non_finite)
    if non_finite:
        safe["non_finite"] = {
            "reason": "JSON has no NaN or Infinity: these values are written as null",
            "values": non_finite,
        }
    with open(path, "w") as f:
        json.dump(safe, f, indent=2, allow_nan=False)


def write_stopped(
    workdir: str, step: int, bad: Mapping[str, float], last_checkpoint: int | None
) -> None:
    """final.json of a run stopped by a non-finite loss or gradient: the step, the metrics that
    went bad, and the checkpoint it can be resumed from (process 0 only)."""
    if jax.process_index() == 0:
        final = {
            "step": step,
            "stopped": "non-finite",
            "metrics": dict(bad),
            "last_good_checkpoint": last_checkpoint,
        }
        _write_json(os.path.join(workdir, "final.json"), final)


def write_final(workdir: str, step: int, results: Mapping[str, Mapping[str, Any]]) -> dict:
    """Write workdir/final.json and print the table of evaluations (process 0 only).

    Returns:
      {"step": step, "evals": results}, the content of final.json.
    """
    final = {"step": step, "evals": dict(results)}
    if jax.process_index() == 0:
        _write_json(os.path.join(workdir, "final.json"), final)
        rows = [{"eval": name, **res} for name, res in results.items()]
        cols = ["eval", "resolution", "accuracy", "best_accuracy", "loss", "num_examples"]
        print(format_table(rows, cols), flush=True)
    return final
