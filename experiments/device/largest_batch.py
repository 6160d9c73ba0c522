"""Stage 7, ``largest_batch``: the largest batch whose step fits the device's memory.

For each encoder in ``ENCODERS`` order, on its fastest backend: the largest power-of-two batch
whose peak memory, predicted from batch 64's buffer sizes, fits (``batch_candidates``), and its
half, compiled and the first that fits timed as in stage 4; issue 47's MFU goal is read at it.
"""

from __future__ import annotations

import math

from experiments.device.compile_stage import _compile, lower_case
from experiments.device.queue import Queue
from experiments.device.recipes import ENCODERS
from experiments.device.results import empty_row
from experiments.device.steps import best_rows, goal_figures, time_case

# A batch whose predicted peak memory fits this share of the device's limit is a candidate.
MEMORY_SHARE = 0.92


def batch_candidates(
    memory: dict | None, batch: int, limit: int | None, max_batch: int, in_use: int = 0
) -> list:
    """Batches to try, largest first: the largest power of two whose predicted peak fits
    ``MEMORY_SHARE`` of ``limit`` beside the ``in_use`` bytes the device already holds (the
    other encoders' initial states), and its half (at least ``2 batch``; ``max_batch`` at most).

    The prediction is linear in the batch from one compile at ``batch``: the arguments (train
    state and images) stay, everything else (activations, gradients' temporaries) scales.
    Without a device limit (XLA:CPU) the candidates are ``max_batch`` and its half. The half is
    there because the prediction can still fail at run time: on an H100 a
    predicted fit at batch 512 could not allocate one 41 GiB buffer.
    """
    if limit is None or memory is None:
        top = max_batch
    else:
        per_image = max(1.0, (memory["peak"] - memory["argument"]) / batch)
        fits = (MEMORY_SHARE * limit - in_use - memory["argument"]) / per_image
        top = min(max_batch, 2 ** int(math.floor(math.log2(max(fits, 1.0)))))
    return [b for b in (top, top // 2) if b >= 2 * batch] or []


def bytes_in_use() -> int:
    """The bytes the first device holds now (0 where it does not say: XLA:CPU)."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # a backend without memory statistics
        return 0
    return int((stats or {}).get("bytes_in_use", 0))


def stage_largest_batch(q: Queue) -> str:
    best = best_rows(q.data["rows"], q.shapes["batch"])
    limit = q.data.get("memory_bytes_limit")
    found = []
    for encoder in [e for e in ENCODERS if e in best][: q.shapes["largest_encoders"]]:
        if q.left("largest_batch") <= 0:
            break
        row = best[encoder]
        case64 = q.compiled[(encoder, row["attention"], row["batch"], None)]
        in_use = bytes_in_use()
        candidates = batch_candidates(
            case64.get("memory"), row["batch"], limit, q.shapes["max_batch"], in_use
        )
        if not candidates:
            continue
        lowered = {
            b: q.pool.submit(_compile, lower_case(q, encoder, row["attention"], b))
            for b in candidates
        }
        result = None
        for b in candidates:
            key = (encoder, row["attention"], b, None)
            try:
                case = lowered[b].result()
            except Exception as e:
                result = empty_row(
                    encoder, row["attention"], b, error=f"compile: {type(e).__name__}: {e}"[:1000]
                )
                continue
            if limit and case["memory"] and case["memory"]["peak"] > limit:
                result = empty_row(
                    encoder,
                    row["attention"],
                    b,
                    skipped=f"peak {case['memory']['peak']} B > {limit} B",
                )
                continue
            q.compiled[key] = case
            try:
                result = time_case(q, key, case, "largest_batch")
            except Exception as e:  # out of memory at run time: try the half
                result = empty_row(
                    encoder, row["attention"], b, error=f"{type(e).__name__}: {e}"[:1000]
                )
                continue
            finally:
                q.compiled.pop(key, None)
            if result.get("step_ms") is not None:
                break
        if result is not None:
            result["case"] = "largest_batch"
            result["candidates"] = candidates
            result["bytes_in_use"] = in_use
            q.data["rows"].append(result)
            found.append(f"{encoder} {result['batch']}")
            q.data["goal"] = goal_figures(q.data["rows"], q.shapes["batch"])
            q.results.save()
    return ", ".join(found)
