r"""RPE-2D's runs evaluated on the positions its reference evaluates on, post hoc.

    python -m experiments.studies.rpe_positions              # fashion_extrapolation's runs
    python -m experiments.studies.rpe_positions --seeds 0,1

RPE-2D trains on a sorted random subset of the positions of a grid L = 2 n_train tokens long
per axis (``rope_lie/encodings/positions.py``, ``randomize``), so the gaps between neighbouring
tokens are about 2. rope_lie's ViT then evaluates on the usual positions 0, 1, ..., n - 1 (gaps
of 1), which no training batch held for a grid smaller than L. Ruoss et al.'s code
(google-deepmind/randomized_positional_encodings, ``models/transformer.py`` and
``experiments/range_evaluation.py``) draws the random subset at evaluation too. This evaluates
the study's finished ``_rpe2`` runs at every size below L (28, 36, 44 px, and the 36 and 44 px
canvases; at 56 px the grid is L long and every variant is the same) on:

- ``random``: a sorted random subset of the L-grid's positions, one draw per 500-image batch
  from a fixed key (the reference's evaluation);
- ``spread``: the usual positions times L / n per axis, evenly spread over the training range.

Rows go to ``experiments/studies/fashion_extrapolation/rpe_positions.csv`` (arm
``<arm>@random`` or ``<arm>@spread``); the ``usual`` positions are the study's own rows, and a
run whose usual-position test accuracy differs from the recorded one is refused. About 3
minutes a run on 2 CPU cores.
"""

from __future__ import annotations

import os

import numpy as np

from experiments.studies import lib
from experiments.studies.definitions import STUDIES

STUDY = "fashion_extrapolation"
ARMS = ("rope_mixed_heo_rpe2", "rope_axial_rpe2", "liere_b8_rpe2")
EVALS = (  # (evaluation, data, side in px)
    ("test", "plain", 28),
    ("px36", "plain", 36),
    ("px44", "plain", 44),
    ("canvas36", "canvas36", 36),
    ("canvas44", "canvas44", 44),
)
DRAWS = 20  # random position draws, cycled over the 500-image batches
VARIANTS = ("usual", "spread", "random")


def _variants(model, grid) -> dict[str, list]:
    """{variant: per-batch positions}: usual, spread (times L / n) and random (``DRAWS``),
    L the length of the grid the model drew its training positions from."""
    import jax

    from rope_lie.encodings import positions

    scale = dict(model.position_augment or {}).get("randomize")
    if scale is None:
        raise ValueError("the model was not trained with randomized positions (RPE-2D)")
    (wide,) = set(positions.randomized_grid(model.train_grid, scale))
    pos = model.positions(grid)
    (n,) = set(grid)  # square grids here
    key, draws = jax.random.key(0), []
    for _ in range(DRAWS):
        key, sub = jax.random.split(key)
        draws.append(
            positions.randomize(
                sub,
                grid,
                model.position_convention,
                scale=wide / n,
                num_prefix=model.num_prefix,
                train_grid=model.train_grid,
                anchor_grid=model.train_grid,
                **dict(model.position_hparams),
            )
        )
    return {"usual": [pos], "spread": [pos * (wide / n)], "random": draws}


def evaluate_run(workdir: str) -> dict[str, float]:
    """{"<eval>@<variant>": accuracy} of one run at every size in ``EVALS``."""
    import jax

    import rope_lie
    from rope_lie import in_memory

    model, config = rope_lie.load(workdir)
    forward = jax.jit(lambda x, states: model(x, pe_cache=states))
    out = {}
    for name, data, size in EVALS:
        images, labels = in_memory.arrays(f"fashion_mnist_idx/{data}", "test")
        grid = model.input_grid(np.zeros((1, size, size, 1), np.float32))
        for variant, per_batch in _variants(model, grid).items():
            states = [model.pe_states(p) for p in per_batch]
            out[f"{name}@{variant}"] = lib.post_hoc_accuracy(
                forward, config, images, labels, size, states
            )
        print(f"  {name}: " + ", ".join(f"{v} {out[f'{name}@{v}']:.4f}" for v in VARIANTS))
    return out


def main(argv=None) -> int:
    args = lib.post_hoc_args(__doc__.split("\n\n")[0], STUDY, argv)
    out = os.path.join(args.results, "rpe_positions.csv")
    study = STUDIES[STUDY]
    recorded = {
        (r["arm"], int(r["seed"]), r["eval"]): float(r["accuracy"])
        for r in lib.read_results(args.results)
    }
    seeds = args.seeds
    rows = lib.post_hoc_rows_kept(out, seeds)
    for arm_name in ARMS:
        arm = study.arm(arm_name)
        for seed in seeds:
            workdir = lib.run_dir(args.root, arm, seed, "cpu")
            if not lib.is_finished(workdir):
                print(f"{arm_name} seed {seed}: no finished run in {workdir}; skipped")
                continue
            print(f"{arm_name} seed {seed}: {workdir}", flush=True)
            accs = evaluate_run(workdir)
            for name, _, _ in EVALS:
                want = recorded.get((arm_name, seed, name))
                got = accs.pop(f"{name}@usual")
                if want is None or abs(got - want) > 2e-4:  # 2 images of 10,000
                    raise SystemExit(
                        f"{arm_name} seed {seed} {name}: usual positions gave {got}, the "
                        f"study recorded {want}"
                    )
            for key, acc in accs.items():
                name, variant = key.split("@")
                rows.append(lib.post_hoc_row(f"{arm_name}@{variant}", seed, name, acc))
    if not rows:
        raise SystemExit(f"no finished RPE-2D runs of {STUDY} under {args.root}")
    lib.write_post_hoc(out, rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
