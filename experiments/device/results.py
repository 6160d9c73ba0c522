"""The run's results on disk.

``Results`` holds them as one dict and writes it, on every ``save`` (after every stage and every
timed row), as ``<device>-<date>.json`` and as Markdown tables (``markdown``) beside it, each
file replaced atomically, so that a run cut short keeps what it measured.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import threading


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "device"


class Results:
    """The run's results, written (JSON and Markdown, each replaced atomically) on every
    ``save``."""

    def __init__(self, out_dir: str, device_kind: str, data: dict):
        os.makedirs(out_dir, exist_ok=True)
        stem = f"{_safe_name(device_kind)}-{datetime.date.today().isoformat()}"
        path = os.path.join(out_dir, stem)
        n = 1
        while os.path.exists(f"{path}.json"):
            n += 1
            path = os.path.join(out_dir, f"{stem}-{n}")
        self.json_path, self.md_path = f"{path}.json", f"{path}.md"
        self.stem_path = path  # logs beside them: f"{stem_path}-<name>.log"
        self.data = data
        self.lock = threading.Lock()
        self.save()

    def save(self) -> None:
        with self.lock:
            for path, text in (
                (self.json_path, json.dumps(self.data, indent=1, default=str)),
                (self.md_path, markdown(self.data)),
            ):
                tmp = f"{path}.tmp"
                with open(tmp, "w") as f:
                    f.write(text + "\n")
                os.replace(tmp, path)


def _fmt(value, spec: str = ".1f", missing: str = "") -> str:
    return missing if value is None else format(value, spec)


def one_line(text: str, width: int = 240) -> str:
    """``text``'s non-blank lines joined by "; " and cut to ``width`` characters: a failure's
    message beside its test in the Markdown (the JSON has more, the log all of it)."""
    joined = "; ".join(" ".join(ln.split()) for ln in text.splitlines() if ln.strip())
    return joined if len(joined) <= width else joined[: width - 3] + "..."


def markdown(data: dict) -> str:
    """The results as Markdown tables."""
    lines = [
        f"# Device queue: {data.get('device')} (jax {data.get('jax')})",
        "",
        f"{data.get('date')}, `{' '.join(data.get('command', []))}`"
        + (" (dry run: tiny shapes)" if data.get("dry_run") else ""),
        f"peak {data.get('peak_tflops')} TFLOP/s bf16; model FLOPs per image per step "
        f"{_fmt(data.get('flops_per_image'), '.4g')} (matrix products by hand)",
        "",
        "| encoder | attention | batch | step ms (min / median) | images/s | MFU "
        "| back to back: step ms, MFU | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data.get("rows", []):
        note = r.get("error") or r.get("skipped") or ""
        if r.get("case") == "repeat":
            note = "timed again at the end of the stage" + (f"; {note}" if note else "")
        if r.get("variant") and not r.get("block_product"):
            note = f"variant {r['variant']}" + (f"; {note}" if note else "")
        if r.get("block_product"):
            choices = f"block product {r['block_product']}, layers {r.get('layer_plan')}"
            choices += f", squarings {r.get('squaring_loop')}"
            choices += f", small products {r.get('small_products')}"
            choices += f", backward {r.get('combination_backward')}"
            note = choices + (f"; {note}" if note else "")
        ms = (
            f"{r['step_ms']:.2f} / {r['step_ms_median']:.2f}"
            if r.get("step_ms") is not None
            else ""
        )
        mfu = "" if r.get("mfu") is None else f"{100 * r['mfu']:.1f} %"
        pipelined = _fmt(r.get("step_ms_pipelined"), ".2f")
        if r.get("mfu_pipelined") is not None:
            pipelined += f", {100 * r['mfu_pipelined']:.1f} %"
        lines.append(
            f"| {r['encoder']} | {r['attention']} | {r['batch']} | {ms} | "
            f"{_fmt(r.get('images_per_s'), ',.0f')} | {mfu} | {pipelined} | {note[:160]} |"
        )
    lines += variant_lines(data.get("rows", []))
    goal = data.get("goal") or {}
    if goal:
        lines += ["", "## Issue 47's goal figures (each encoder on its fastest backend)", ""]
        lines += [f"- {k}: {v}" for k, v in goal.items()]
    if data.get("chained_rotations"):
        lines += [
            "",
            "## A step's rotations of q and k alone (chained in one program, per rotation)",
            "",
            "| encoder | x (B, T, N, H) | forward us | forward + backward us | over RoPE-Mixed (forward / both) |",  # noqa: E501
            "|---|---|---|---|---|",
        ]
        for r in data["chained_rotations"]:
            shape = "x".join(map(str, r.get("shape_BTNH", [])))
            over = ""
            if r.get("forward_over_rope_mixed") is not None:
                over = f"{r['forward_over_rope_mixed']:.2f} / {r['forward_backward_over_rope_mixed']:.2f}"  # noqa: E501
            lines.append(
                f"| {r['encoder']} | {shape} | {_fmt(r.get('forward_us'), '.1f')} | "
                f"{_fmt(r.get('forward_backward_us'), '.1f')} | {over} |"
                + (f" {r['error'][:120]}" if r.get("error") else "")
            )
    if data.get("exponentials"):
        lines += [
            "",
            "## LieRE 8x8's exponentials alone (every layer, vmapped)",
            "",
            "| squarings | small products | backward | rotations | forward ms | forward + backward ms | max abs(R^T R - I) |",  # noqa: E501
            "|---|---|---|---|---|---|---|",
        ]
        for r in data["exponentials"]:
            shape = "x".join(map(str, r.get("shape", [])))
            lines.append(
                f"| {r['squarings']} | {r['small_products']} | {r.get('backward')} | {shape} | "
                f"{_fmt(r.get('forward_ms'), '.3f')} | {_fmt(r.get('forward_backward_ms'), '.3f')}"
                f" | {_fmt(r.get('orthogonality_error'), '.1e')} |"
                + (f" {r['error'][:120]}" if r.get("error") else "")
            )
    if data.get("rotations"):
        lines += [
            "",
            "## lie.apply_blocks's block products alone",
            "",
            "| blocks | product | forward ms | forward + backward ms | max error / max value vs float64 |",  # noqa: E501
            "|---|---|---|---|---|",
        ]
        for r in data["rotations"]:
            lines.append(
                f"| {r['blocks']} | {r['product']} | {_fmt(r.get('forward_ms'), '.3f')} | "
                f"{_fmt(r.get('forward_backward_ms'), '.3f')} | {_fmt(r.get('rel_err'), '.2e')} |"
                + (f" {r['error'][:120]}" if r.get("error") else "")
            )
    for name, prof in (data.get("profiles") or {}).items():
        lines += ["", f"## Profile: {name}", ""]
        if prof.get("error"):
            lines.append(f"error: {prof['error'][:300]}")
        trace = prof.get("trace") or {}
        if trace.get("top_ops"):
            lines += [
                f"{trace['source']}: {trace['total_ms']:.2f} ms of ops per step",
                "",
                "| ms per step | op | op_name |",
                "|---|---|---|",
            ]
            lines += [f"| {ms:.3f} | {op} | {name_[:100]} |" for op, name_, ms in trace["top_ops"]]
        elif trace:
            lines.append(f"trace: {trace.get('note', '')}")
        if prof.get("hlo_ops"):
            top = sorted(prof["hlo_ops"].items(), key=lambda kv: -kv[1])[:12]
            lines.append("")
            lines.append("compiled HLO instructions: " + ", ".join(f"{k} {v}" for k, v in top))
    if data.get("packing"):
        lines += [
            "",
            "## NaFlex batches: padded against packed (the same images)",
            "",
            "| encoder | case | images | rows x tokens | padding | step ms (min / median) | time / padded |",  # noqa: E501
            "|---|---|---|---|---|---|---|",
        ]
        for r in data["packing"]:
            ms = r.get("error") or r.get("skipped") or ""
            if r.get("step_ms") is not None:
                ms = f"{r['step_ms']:.2f} / {r['step_ms_median']:.2f}"
            lines.append(
                f"| {r['encoder']} | {r['case']} | {r['images']} | {r['rows']} x {r['tokens']} | "
                f"{100 * r['padding_fraction']:.1f} % | {ms[:160]} | "
                f"{_fmt(r.get('time_over_padded'), '.2f')} |"
            )
    tests = data.get("tests") or {}
    if tests:
        lines += ["", "## Tests", ""]
        for name, t in tests.items():
            counts = ", ".join(f"{k} {v}" for k, v in (t.get("counts") or {}).items())
            extra = t.get("error") or t.get("summary") or ""
            if t.get("timed_out"):
                extra += " (stopped at the stage's deadline)"
            log = f" (log: {t['log']})" if t.get("log") else ""
            lines.append(f"- {name}: {counts} {extra}{log}".rstrip())
            messages = t.get("failure_messages") or {}
            for f in t.get("failed", [])[:20]:
                why = one_line(messages.get(f, ""))
                lines.append(f"  - failed: {f}" + (f": {why}" if why else ""))
    inits = data.get("inits") or {}
    if inits:
        timed = ", ".join(
            f"{e} {_fmt(i['seconds'])} s (from {_fmt(i['started_s'], '.0f')} s)"
            for e, i in inits.items()
        )
        lines += ["", f"Initial states (each encoder's init, compiled on first call): {timed}"]
    lines += ["", "## Stages", "", "| stage | status | seconds | note |", "|---|---|---|---|"]
    for name, s in (data.get("stages") or {}).items():
        note = (s.get("error") or s.get("note") or "").splitlines()
        lines.append(
            f"| {name} | {s['status']} | {_fmt(s.get('seconds'))} | {(note[-1] if note else '')[:160]} |"  # noqa: E501
        )
    return "\n".join(lines)


def variant_lines(rows: list[dict]) -> list[str]:
    """A Markdown section: each timed variant's step against its encoder's defaults on the same
    backend and batch in the same pass (the first pass's rows, ``case`` "fixed_batch"), and
    against RoPE-Mixed's there: what a default's change would buy on this device."""

    def key(r):
        return r["encoder"], r["attention"], r["batch"]

    first = [r for r in rows if r.get("case") == "fixed_batch" and r.get("step_ms") is not None]
    defaults = {key(r): r for r in first if r.get("variant") is None}
    variants = [r for r in first if r.get("variant") is not None]
    if not variants:
        return []
    lines = [
        "",
        "## Variants against their encoder's defaults (same backend and batch, this run)",
        "",
        "| encoder | attention | variant | step ms | defaults' ms | over defaults | over RoPE-Mixed |",  # noqa: E501
        "|---|---|---|---|---|---|---|",
    ]
    for r in variants:
        base = defaults.get(key(r))
        rope = defaults.get(("rope_mixed", r["attention"], r["batch"]))
        over = "" if base is None else f"{r['step_ms'] / base['step_ms']:.3f}"
        over_rope = "" if rope is None else f"{r['step_ms'] / rope['step_ms']:.3f}"
        lines.append(
            f"| {r['encoder']} | {r['attention']} | {r['variant']} | {r['step_ms']:.2f} | "
            f"{_fmt(base and base['step_ms'], '.2f')} | {over} | {over_rope} |"
        )
    return lines


def empty_row(encoder: str, attention: str, batch: int, **note) -> dict:
    """A row of the step table with nothing timed, and why (``skipped=`` or ``error=``)."""
    timed = dict(step_ms=None, images_per_s=None, mfu=None)
    return dict(encoder=encoder, attention=attention, batch=batch, **timed, **note)
