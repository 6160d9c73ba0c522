"""Damaged or missing TFRecord files: which one, and an error that says how to prepare again.

TensorFlow's error for a damaged record file names neither the dataset nor the file;
``naming_damage`` wraps a batch iterator so that such an error is raised as an OSError naming
the dataset, the split, the file (``damaged_record_file``) and the commands that prepare the
dataset again (``catalog.damaged_dataset_message``).
"""

import re
import struct
from collections.abc import Iterator, Sequence

import tensorflow as tf

from rope_lie.data import catalog


def naming_damage(iterator, builder, name: str, split_name: str, split) -> Iterator:
    """`iterator`, with TF's error for a damaged or missing record file (which names neither
    the dataset nor the file) raised as an OSError that names both and how to prepare again."""
    # Bound before iterating: a generator closed at interpreter exit evaluates its except
    # clause after TensorFlow's modules are torn down (tf.errors is None by then).
    damage = (tf.errors.DataLossError, tf.errors.NotFoundError)
    try:
        yield from iterator
    except damage as e:
        reason = re.sub(r"\{\{.*?\}\}\s*|\s*\[Op:.*$", "", e.message, flags=re.S)
        paths = [str(p) for p in builder.info.splits[split].filepaths]
        message = catalog.damaged_dataset_message(
            name,
            split_name,
            damaged_record_file(paths, reason),
            reason,
            str(builder.data_dir),
            str(builder.data_dir_root),
        )
        raise OSError(message) from e


def damaged_record_file(paths: Sequence[str], reason: str) -> str | None:
    """Which of the TFRecord files `paths` TF's `reason` is about, or None if none is found.

    A missing file, or one whose record lengths do not add up to its size (truncated, or
    overwritten in a length field), is found by reading 8 bytes per record. A record whose
    length or data fail their checksum ("corrupted record at <offset>", the offset of the
    record or of its data, 12 bytes on) is looked for by reading through the files that have a
    record there.
    """
    offset = re.search(r"record at (\d+)", reason)
    at_offset = []
    for path in paths:
        starts = _record_starts(path) if tf.io.gfile.exists(path) else None
        if starts is None:
            return path
        if offset and {int(offset.group(1)), int(offset.group(1)) - 12} & starts:
            at_offset.append(path)
    for path in at_offset:
        try:
            for _ in tf.data.TFRecordDataset(path):
                pass
        except tf.errors.DataLossError:
            return path
    return None


def _record_starts(path: str) -> set[int] | None:
    """Offsets of the records of a TFRecord file, None if their lengths overrun its size.

    A record is: length (uint64 little-endian), its CRC (4 bytes), data, the data's CRC.
    """
    size, position, starts = tf.io.gfile.stat(path).length, 0, set()
    with tf.io.gfile.GFile(path, "rb") as f:
        while position + 12 <= size:
            f.seek(position)
            starts.add(position)
            position += 16 + struct.unpack("<Q", f.read(8))[0]
    return starts if position == size else None
