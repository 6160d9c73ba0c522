"""Run every benchmark, print the tables and write JSON.

    python -m experiments.benchmarks.run            # all six (``BENCHMARKS``)
    python -m experiments.benchmarks.run --quick    # smaller shapes, fewer repeats
    python -m experiments.benchmarks.run --only rotations,scaling --out /tmp/r.json

Every time is min / median over the repeats after a warm-up call; every figure in the tables
is a ratio against a baseline measured in the same run (see each module's docstring). The
machine (CPU model, cores, load average, thread counts, versions) is recorded with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from experiments.benchmarks import (
    attention_chunks,
    common,
    flops,
    model_steps,
    rotations,
    scaling,
    vs_pytorch,
)

BENCHMARKS = {
    "rotations": rotations,
    "model_steps": model_steps,
    "scaling": scaling,
    "flops": flops,
    "vs_pytorch": vs_pytorch,
    "attention_chunks": attention_chunks,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, 2 repeats")
    parser.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated subset")
    parser.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(__file__), "results.json"),
        help="JSON output path",
    )
    flags = parser.parse_args()
    names = [n for n in flags.only.split(",") if n]
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        raise SystemExit(f"unknown benchmarks {unknown}; expected some of {list(BENCHMARKS)}")
    results = {"machine": common.machine(), "quick": flags.quick, "seconds": {}}
    print("machine:", json.dumps(results["machine"]))
    for name in names:
        start = time.perf_counter()
        print(f"\n# {name}", flush=True)
        results[name] = BENCHMARKS[name].run(flags.quick)
        results["seconds"][name] = round(time.perf_counter() - start, 1)
    results["machine_after"] = common.machine()
    for name in names:
        BENCHMARKS[name].table(results[name])
    with open(flags.out, "w") as f:
        json.dump(results, f, indent=1, default=float)
    print(f"\nwrote {flags.out}; seconds per benchmark: {results['seconds']}")


if __name__ == "__main__":
    main()
