"""A device run's files, copied into the repository under their committed names.

    python -m experiments.device.collect <folder the run wrote> [--tag full]

The queue writes ``<device>-<date>.json`` and ``.md``, and its tests' logs
``<device>-<date>-tests-gpu.log`` and ``-tests-encoders-cpu.log``, into ``--out``; the device
tool brings them back read-only, with the queue's own output where the command saved it
(``queue.log``). This copies them into ``experiments/benchmarks/device/`` as
``<device>-<date>-<n>-<tag>.json``, ``.md``, ``.log`` (the queue's output),
``-<tag>-tests-gpu.log`` and ``-<tag>-tests-encoders-cpu.log``, and draws ``.png`` (each
encoder's step, ``plot.py``; not for a run that timed none), n one more than the runs of
that device and date already there, writable, with the logs' names inside the JSON and the
Markdown rewritten to match. A folder with the seed-ensemble probe's ``ensemble.json`` (and
its ``probe.log``) instead, as its studies README command writes them, is copied as
``<device>-<date>-<n>-ensemble-probe.json`` and ``.log``. It refuses a folder with neither,
or with several queue runs, and never overwrites a file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import sys

from experiments.device.recipes import ROOT
from experiments.device.results import _safe_name

INTO = os.path.join(ROOT, "experiments", "benchmarks", "device")
LOGS = ("tests-gpu.log", "tests-encoders-cpu.log")
QUEUE_LOG = "queue.log"
PROBE_JSON, PROBE_LOG, PROBE_TAG = "ensemble.json", "probe.log", "ensemble-probe"


def queue_json(folder: str) -> str | None:
    """The one queue result in `folder` (a JSON with the queue's ``schema`` and ``rows``); None
    if there is none, ValueError if there are several."""
    found = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "schema" in data and "rows" in data:
            found.append(name)
    if len(found) > 1:
        raise ValueError(f"{folder}: expected one device queue JSON, found {found}")
    return found[0] if found else None


def next_number(into: str, stem: str) -> int:
    """One more than the largest n of ``<stem>-<n>-...`` files in `into` (1 if none)."""
    pattern = re.compile(rf"^{re.escape(stem)}-(\d+)-")
    numbers = [int(m.group(1)) for name in os.listdir(into) if (m := pattern.match(name))]
    return max(numbers, default=0) + 1


def _probe_stem(folder: str, date: str) -> str | None:
    """``<device>-<date>`` of the ensemble probe's result in `folder`, or None if none."""
    path = os.path.join(folder, PROBE_JSON)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        device = json.load(f).get("device")
    if not device:
        raise ValueError(f"{path}: no 'device' (a probe stopped before the backend started?)")
    return f"{_safe_name(device)}-{date}"


def collect(folder: str, tag: str = "full", into: str = INTO, date: str | None = None) -> list:
    """Copy the run in `folder` into `into` under its committed names; the paths written.
    `date`: the probe's (ISO; None: today), which its files do not carry in their names."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", tag):
        raise ValueError(f"tag={tag!r}: expected lower-case letters, digits and dashes")
    renames: dict[str, str] = {}
    name = queue_json(folder)
    if name is None:
        stem = _probe_stem(folder, date or datetime.date.today().isoformat())
        if stem is None:
            raise ValueError(
                f"{folder}: expected a device queue JSON (with 'schema' and 'rows') or the "
                f"ensemble probe's {PROBE_JSON}, found neither"
            )
        new = f"{stem}-{next_number(into, stem)}-{PROBE_TAG}"
        copies = {PROBE_JSON: f"{new}.json", PROBE_LOG: f"{new}.log"}
    else:
        stem = name[: -len(".json")]
        new = f"{stem}-{next_number(into, stem)}-{tag}"
        renames = {f"{stem}-{log}": f"{new}-{log}" for log in LOGS}
        copies = {name: f"{new}.json", f"{stem}.md": f"{new}.md", QUEUE_LOG: f"{new}.log"}
        copies |= renames
    present = {src: dst for src, dst in copies.items() if os.path.exists(os.path.join(folder, src))}
    clashes = [dst for dst in present.values() if os.path.exists(os.path.join(into, dst))]
    if clashes:
        raise FileExistsError(f"{into}: would overwrite {clashes}")
    written = []
    for src, dst in present.items():
        target = os.path.join(into, dst)
        if src.endswith((".json", ".md")):
            with open(os.path.join(folder, src)) as f:
                text = f.read()
            for old, renamed in renames.items():
                text = text.replace(old, renamed)
            with open(target, "w") as f:
                f.write(text)
        else:
            shutil.copyfile(os.path.join(folder, src), target)  # not its read-only mode
        written.append(target)
    if name is not None:
        written += _drawn(os.path.join(into, f"{new}.json"))
    return written


def _drawn(path: str) -> list[str]:
    """The run's picture beside its JSON (``plot.py``), [] where it timed no step to draw."""
    from experiments.device import plot

    with open(path) as f:
        data = json.load(f)
    if not plot.bars(data):
        return []
    return [plot.plot(data, path[: -len(".json")] + ".png")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the folder the run wrote (the device tool's files_at)")
    parser.add_argument("--tag", default="full", help="what the run was: full, tests, ...")
    parser.add_argument("--into", default=INTO, help="where the committed results are")
    args = parser.parse_args(argv)
    try:
        written = collect(args.folder, args.tag, args.into)
    except (ValueError, FileExistsError) as e:
        print(f"collect: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(os.path.relpath(path, ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
