r"""YaRN on RoPE-Axial with transformers' correction range and without its clip.

    python -m experiments.studies.yarn_ramp                 # fashion_extrapolation's runs
    python -m experiments.studies.yarn_ramp --seeds 0,1

``fashion_extrapolation`` found YaRN leaving RoPE-Axial where it was without a tool, while
position interpolation rescues it. transformers clips YaRN's correction range at pair 0, so an
axis whose fastest pair turns fewer than 32 times over the training extent keeps that pair's
frequency (``rope_lie/encodings/extrapolation.py``, "YaRN on short axes"). This evaluates the
study's finished ``rope_axial`` runs at every px and canvas size with the unclipped ramp
(``Scaling(yarn_clipped=False)``), and once more with the clipped one at px56 as a check that
it gives the study's recorded number. Rows go to
``experiments/studies/fashion_extrapolation/yarn_ramp.csv`` (arm ``rope_axial_yarn_unclipped``).
It is an evaluation of trained models, no training: about 3 minutes a seed on 2 CPU cores.
The unclipped ramp was chosen after seeing seeds 0-2; seeds 3 and 4 were its test on fresh
seeds (the study's README).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from experiments.studies import lib
from experiments.studies.definitions import STUDIES

STUDY = "fashion_extrapolation"
ARM = "rope_axial"
SIZES = (36, 44, 56)


def evaluate_run(workdir: str) -> dict[str, float]:
    """{eval name: accuracy} of one run: ``<eval>@yarn_unclipped`` at every size, and
    ``px56@yarn`` (clipped, the study's own tool) as a check."""
    import jax

    import rope_lie
    from rope_lie import in_memory
    from rope_lie.encodings import extrapolation

    model, config = rope_lie.load(workdir)
    forward = jax.jit(lambda x, states: model(x, pe_cache=states))

    def accuracy(images, labels, grid, size, scaling):
        states = model.pe_states(model.positions(grid), scaling)
        return lib.post_hoc_accuracy(forward, config, images, labels, size, [states])

    out = {}
    for kind in ("px", "canvas"):
        for size in SIZES:
            name = "plain" if kind == "px" else f"canvas{size}"
            images, labels = in_memory.arrays(f"fashion_mnist_idx/{name}", "test")
            grid = model.input_grid(np.zeros((1, size, size, 1), np.float32))
            clipped = extrapolation.resolve(
                "yarn",
                family=model.pe,
                grid=grid,
                train_grid=model.train_grid,
                convention=model.position_convention,
                num_prefix=model.num_prefix,
            )
            unclipped = dataclasses.replace(clipped, yarn_clipped=False)
            out[f"{kind}{size}@yarn_unclipped"] = accuracy(images, labels, grid, size, unclipped)
            if (kind, size) == ("px", 56):
                out["px56@yarn"] = accuracy(images, labels, grid, size, clipped)
            print(
                f"  {kind}{size}: unclipped {out[f'{kind}{size}@yarn_unclipped']:.4f}", flush=True
            )
    return out


def main(argv=None) -> int:
    args = lib.post_hoc_args(__doc__.split("\n\n")[0], STUDY, argv)
    out = os.path.join(args.results, "yarn_ramp.csv")
    arm = STUDIES[STUDY].arm(ARM)
    recorded = {
        (int(r["seed"]), r["eval"]): float(r["accuracy"])
        for r in lib.read_results(args.results)
        if r["arm"] == f"{ARM}_yarn"
    }
    seeds = args.seeds
    rows = lib.post_hoc_rows_kept(out, seeds)
    for seed in seeds:
        workdir = lib.run_dir(args.root, arm, seed, "cpu")
        if not lib.is_finished(workdir):
            print(f"seed {seed}: no finished run in {workdir}; skipped")
            continue
        print(f"seed {seed}: {workdir}", flush=True)
        accs = evaluate_run(workdir)
        check, want = accs.pop("px56@yarn"), recorded.get((seed, "px56"))
        print(f"  px56@yarn (clipped) {check:.4f}; the study recorded {want}")
        if want is not None and abs(check - want) > 2e-4:  # 2 images of 10,000
            raise SystemExit(f"seed {seed}: px56@yarn gave {check}, the study recorded {want}")
        for name, acc in accs.items():
            rows.append(lib.post_hoc_row(f"{ARM}_yarn_unclipped", seed, name.split("@")[0], acc))
    if not rows:
        raise SystemExit(f"no finished {ARM} runs of {STUDY} under {args.root}")
    lib.write_post_hoc(out, rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
