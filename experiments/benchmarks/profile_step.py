"""Where a ViT train step's time goes on XLA:CPU: a ``jax.profiler`` trace, summed per op.

Traces ``steps`` calls of the same train step as ``vs_pytorch.py`` (forward, backward, AdamW;
float32) after warm-up, reads the trace's per-op events (one per executed HLO instruction:
fusions, dots, copies) and prints the time per step:

- per XLA thread (two threads whose op times add up to the step's wall time take turns; at
  once they would each take about half of it);
- per kind of op (``ynn_fusion``: YNNPACK dot or reduction fusions; ``wrapped_broadcast``:
  a broadcast materialised for one of them; ``transpose_copy_fusion``: a layout change);
- per ``op_name`` from the HLO metadata, which names the JAX operation (``jvp(...)``: forward,
  ``transpose(jvp(...))``: backward; einsum specs such as ``BTNH,BSNH->BNTS`` name the
  attention's products), with layer indices folded together.

    python -m experiments.benchmarks.profile_step --model "mu/8 @ 64x64x1" --encoder none
    python -m experiments.benchmarks.profile_step --hlo /tmp/step.hlo   # also write the HLO

The profiler's own overhead makes the traced step slower than an untraced one; compare
entries with each other, not with other benchmarks' times.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax

from experiments.benchmarks import vs_pytorch

_NOT_OPS = ("$", "Thunk", "Pjit", "Parse", "Slinky", "end:", "Handle inputs")


def op_events(trace_dir: str) -> list[dict]:
    """The trace's complete events that are XLA ops (not Python, runtime or host events)."""
    (path,) = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    return [
        e
        for e in events
        if e.get("ph") == "X" and not e["name"].startswith(_NOT_OPS) and "::" not in e["name"]
    ]


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its ``op_name`` metadata, layer indices folded to ``#``."""
    names = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if m:
            op = re.search(r'op_name="([^"]*)"', line)
            text = re.sub(r"^jit\([^)]*\)/", "", op.group(1)) if op else ""
            names[m.group(1)] = re.sub(r"\d+", "#", text)
    return names


def summarise(events: list[dict], names: dict[str, str], steps: int, top: int = 25) -> dict:
    """ms per step: per thread, per kind of op and per op_name (the ``top`` largest)."""
    per_thread, per_kind, per_name = (collections.Counter() for _ in range(3))
    for e in events:
        ms = e["dur"] / 1000 / steps
        per_thread[e["tid"]] += ms
        per_kind[re.sub(r"[.\d]+$", "", e["name"])] += ms
        per_name[names.get(e["name"], "?")] += ms
    return {
        "threads_ms": sorted((round(v, 1) for v in per_thread.values() if v >= 0.5), reverse=True),
        "total_ms": round(sum(per_thread.values()), 1),
        "kinds_ms": [(k, round(v, 2)) for k, v in per_kind.most_common(top)],
        "op_names_ms": [(k, round(v, 2)) for k, v in per_name.most_common(top)],
    }


def profile(model: str, encoder: str, steps: int = 5, hlo_path: str | None = None) -> dict:
    model_kw, batch = vs_pytorch.MODELS[model]
    call, _, _ = vs_pytorch.ours_step(model_kw, batch, encoder)
    for _ in range(3):
        jax.block_until_ready(call())
    hlo = call.compiled.as_text()
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(hlo)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                jax.block_until_ready(call())
        events = op_events(trace_dir)
    return summarise(events, op_names(hlo), steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mu/8 @ 64x64x1", choices=list(vs_pytorch.MODELS))
    parser.add_argument("--encoder", default="none", choices=list(vs_pytorch.ENCODERS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hlo", default=None, help="write the compiled step's HLO here")
    flags = parser.parse_args()
    out = profile(flags.model, flags.encoder, flags.steps, flags.hlo)
    print(f"{flags.model}, {flags.encoder}: op time per step {out['total_ms']} ms")
    print("per XLA thread (ms):", out["threads_ms"])
    for title, key in (("kind of op", "kinds_ms"), ("op_name", "op_names_ms")):
        print(f"\nms per step by {title}:")
        for name, ms in out[key]:
            print(f"  {ms:8.2f}  {name[:110]}")


if __name__ == "__main__":
    main()
