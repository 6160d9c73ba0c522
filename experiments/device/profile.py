"""Stage 6, ``profile``: where the time of a LieRE 8x8 and a RoPE-Mixed step goes.

Each step of ``PROFILED`` (LieRE 8x8, RoPE-Mixed, dense LieRE), then LieRE 8x8's variants, on
its fastest backend and as the stage's deadline allows, traced by
``jax.profiler``: the top operations by device time per step, read from the trace's XSpace
(``op_times``) and named by the compiled program's ``op_name`` metadata (``kernel_op_names``),
beside the program's instruction counts (``hlo_op_counts``) and XLA's cost analysis.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile

from experiments.device.compile_stage import ATTENTIONS
from experiments.device.queue import Queue
from experiments.device.steps import best_rows, initial_state
from experiments.device.variants import liere_variants, variant_label

# Dense LieRE before LieRE 8x8's variants: 2.82x RoPE-Mixed's step on an H200 (its goal: 1.5x)
# and never profiled (the H200's stage ran out of time after the variants).
PROFILED = ("liere", "rope_mixed", "liere_dense")


# Host events in a CPU trace that are not XLA ops (profile_step.py's rule).
_NOT_OPS = ("$", "Thunk", "Pjit", "Parse", "Slinky", "end:", "Handle inputs")
# Lines of a device plane that summarise rather than time operations.
_NOT_OP_LINES = ("XLA Modules", "Steps", "Launch Stats", "Source", "TraceMe", "Framework")


def op_times(xplane_path: str, steps: int, names: dict[str, str], top: int = 20) -> dict:
    """The top operations by time per step in a ``jax.profiler`` trace (its XSpace).

    Device planes (``/device:GPU:0``, ``/device:TPU:0``): the "XLA Ops" line where there is one,
    else every line but the summaries. Without a device plane (XLA:CPU) the host threads' XLA op
    events. ``names`` maps HLO instruction names to their ``op_name`` metadata.
    """
    import jax

    profile = jax.profiler.ProfileData.from_file(xplane_path)
    planes = [p for p in profile.planes if p.name.startswith("/device:")]
    events, source = [], None
    for plane in planes:
        lines = list(plane.lines)
        chosen = [ln for ln in lines if ln.name == "XLA Ops"] or [
            ln for ln in lines if not ln.name.startswith(_NOT_OP_LINES)
        ]
        found = [(e.name, e.duration_ns) for ln in chosen for e in ln.events]
        if found:
            events += found
            source = f"{plane.name}: " + ", ".join(sorted({ln.name for ln in chosen}))[:200]
    if not events:
        for plane in profile.planes:
            if plane.name != "/host:CPU":
                continue
            for ln in plane.lines:
                if ln.name == "python":
                    continue
                events += [
                    (e.name, e.duration_ns)
                    for e in ln.events
                    if not e.name.startswith(_NOT_OPS) and "::" not in e.name
                ]
            source = "/host:CPU: XLA op events of the host threads"
    if not events:
        return {"source": None, "note": "no operation events in the trace"}
    per_op = collections.Counter()
    for name, ns in events:
        per_op[name] += ns / 1e6 / steps
    kinds = collections.Counter()
    for name, ms in per_op.items():
        kinds[re.sub(r"[.\d]+$", "", name)] += ms
    return {
        "source": source,
        "total_ms": round(sum(per_op.values()), 3),
        "top_ops": [[op, names.get(op, "?"), round(ms, 4)] for op, ms in per_op.most_common(top)],
        "kinds_ms": [[k, round(ms, 4)] for k, ms in kinds.most_common(top)],
    }


def kernel_op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its ``op_name`` (``profile_step.op_names``), also under the name
    of the kernel XLA:GPU emits for it (the instruction's name with every character other than
    a letter, digit or ``_`` made ``_``: ``gemm_fusion_dot.360`` runs as
    ``gemm_fusion_dot_360``, the name a GPU trace's events carry). A fusion without metadata
    takes the ``op_name`` most instructions of its fused computation carry."""
    from experiments.benchmarks.profile_step import op_names

    names = op_names(hlo_text)
    inside = collections.defaultdict(collections.Counter)  # computation: op_name counts
    calls = {}  # instruction: the computation it calls
    computation = None
    for line in hlo_text.splitlines():
        head = re.match(r"(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
        if head:
            computation = head.group(1)
            continue
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if not m:
            continue
        if computation and names.get(m.group(1)):
            inside[computation][names[m.group(1)]] += 1
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if called:
            calls[m.group(1)] = called.group(1)
    for name, computation in calls.items():
        if not names.get(name) and inside[computation]:
            names[name] = inside[computation].most_common(1)[0][0]
    for name, op in list(names.items()):
        names.setdefault(re.sub(r"\W", "_", name), op)
    return names


def hlo_op_counts(hlo_text: str) -> dict[str, int]:
    """Instructions per opcode in a compiled HLO module's text."""
    counts = collections.Counter()
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][\w\-]*)\(", line)
        if m:
            counts[m.group(1)] += 1
    return dict(counts)


def profile_case(q: Queue, key: tuple, case: dict) -> dict:
    import jax

    from experiments.benchmarks import device as bench

    compiled = case["compiled"]
    hlo = compiled.as_text()
    out = {"attention": key[1], "batch": key[2], "hlo_ops": hlo_op_counts(hlo)}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    out["cost_analysis"] = {
        k: float(v)
        for k, v in (cost or {}).items()
        if k in ("flops", "bytes accessed", "transcendentals")
    }
    state, other = initial_state(q, key[0])
    data = bench.random_batch(case["config"], key[2], case["mesh"])
    rng = jax.random.key(1)
    state, m = compiled(state, data, other, rng)
    jax.block_until_ready(m)
    steps = 3
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                state, m = compiled(state, data, other, rng)
            jax.block_until_ready(m)
        del state
        paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            out["trace"] = {"source": None, "note": "the profiler wrote no .xplane.pb"}
        else:
            out["trace"] = op_times(paths[0], steps, kernel_op_names(hlo))
    return out


def stage_profile(q: Queue) -> str:
    best = best_rows(q.data["rows"], q.shapes["batch"])
    q.data["profiles"] = {}
    targets = {}  # name: key of the compiled step
    for encoder in PROFILED:
        if encoder in best:
            row = best[encoder]
            targets[encoder] = (encoder, row["attention"], row["batch"], None)
    if "liere" in targets:  # LieRE 8x8's variants: on the same backend when compiled there,
        platform = q.data["platform"]  # else where they were
        every = getattr(q.args, "every_variant", False)
        for other in liere_variants(platform, every):
            for attention in (targets["liere"][1], *ATTENTIONS):
                key = ("liere", attention, q.shapes["batch"], other)
                if "compiled" in q.compiled.get(key, {}):
                    targets[f"liere ({variant_label(other)})"] = key
                    break
    for name, key in targets.items():
        if q.left("profile") <= 0:
            break
        try:
            q.data["profiles"][name] = profile_case(q, key, q.compiled[key])
        except Exception as e:
            q.data["profiles"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        q.results.save()
    return f"profiled {sorted(q.data['profiles'])}"
