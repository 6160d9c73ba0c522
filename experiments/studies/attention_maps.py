r"""The class token's attention over the grid, per encoder, from the studies' trained runs.

    python -m experiments.studies.attention_maps            # arrows study, seed 0, example 0
    python -m experiments.studies.attention_maps --study fashion   # 4 Fashion-MNIST test images

Arrows: for one test layout of ``spatial_arrows/c8_g8`` and each arm of the arrows study whose
run is finished, the last layer's class-token attention (mean over heads) is drawn over the
8x8 grid, beside the image with the Y (blue) and the target arrow (red) marked: an encoder that
has learned the task looks at the Y and the cell its stem points to (the LieRE paper's
attention figure). Written to ``experiments/studies/arrows/attention.png``.

Fashion: for a few Fashion-MNIST test images (one row each) and each arm of the fashion study
whose run is finished (one column each), the same map over the 7x7 patches, drawn over the
image, with the arm's prediction. Written to ``experiments/studies/fashion/attention.png``.
"""

from __future__ import annotations

import argparse
import importlib
import os

import numpy as np

from experiments.studies import lib
from experiments.studies.definitions import STUDIES


def load_config(arm: lib.Arm, seed: int, scale: str = "cpu"):
    """The run's config, as `rope_lie.main` built it (recipe, argument, overrides, seed)."""
    recipe = importlib.import_module(f"configs.{arm.recipe_for(scale)}")
    config = recipe.get_config(arm.argument(scale))
    config.update_from_flattened_dict(dict(arm.all_overrides(scale)))
    config.seed = seed
    return config


def load_model(config, workdir: str):
    """The ViT with the parameters of the run's latest checkpoint."""
    import jax
    from flax import nnx

    from rope_lie import checkpoint, train

    _, state = checkpoint.load_state(os.path.join(workdir, "checkpoints"))
    model = train.build_model(config.model, jax.random.key(0))
    params = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(params, state["params"])
    nnx.update(model, params)
    return model


def class_token_map(model, image_HWC: np.ndarray, layer: int = -1) -> np.ndarray:
    """Class token's attention to the grid tokens (mean over heads), shaped as the grid.

    The tokens are [class token, registers, grid] (``rope_lie/models/vit.py``): the class
    token's row, read at the columns after the model's ``num_prefix`` prefix tokens. What it
    gives itself and the registers is left out, so the map sums to less than 1.
    """
    import jax.numpy as jnp

    if model.cls_1D is None:
        raise ValueError(
            f"the model has no class token (pool={model.pool!r}; its {model.num_prefix} prefix "
            "tokens are registers)"
        )
    maps = model.attention_maps(jnp.asarray(image_HWC[None], jnp.float32))
    row = np.asarray(maps[layer, 0, :, 0, model.num_prefix :]).mean(axis=0)
    return row.reshape(model.input_grid(image_HWC[None]))


def fashion_figure(root: str, seed: int, examples: list[int], out: str) -> str:
    """Class-token maps of the fashion study's finished runs on Fashion-MNIST test images."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rope_lie.data import fashion_mnist_idx

    images, labels = fashion_mnist_idx.load_split("test")
    study = STUDIES["fashion"]
    columns = []
    for arm in study.arms:
        workdir = lib.run_dir(root, arm, seed, "cpu")
        if not lib.is_finished(workdir):
            print(f"{arm.name}: no finished run in {workdir}; skipped")
            continue
        config = load_config(arm, seed)
        model = load_model(config, workdir)
        mean, std = config.dataset.mean[0], config.dataset.std[0]
        column = []
        for i in examples:
            x = (images[i, :, :, None].astype(np.float32) / 255.0 - mean) / std
            pred = int(np.asarray(model(x[None]))[0].argmax())
            column.append((class_token_map(model, x), pred))
        columns.append((arm.label, column))
    if not columns:
        raise SystemExit("no finished fashion runs: run python -m experiments.studies.run fashion")
    names = fashion_mnist_idx.CLASS_NAMES
    rows, cols = len(examples), len(columns) + 1
    fig, axes = plt.subplots(rows, cols, figsize=(1.45 * cols, 1.6 * rows), squeeze=False)
    for r, i in enumerate(examples):
        axes[r, 0].imshow(images[i], cmap="gray")
        axes[r, 0].set_title(f"test {i}: {names[labels[i]]}", fontsize=6)
        for c, (label, column) in enumerate(columns, 1):
            amap, pred = column[r]
            axes[r, c].imshow(images[i], cmap="gray", extent=(0, 28, 28, 0))
            axes[r, c].imshow(amap, cmap="inferno", alpha=0.6, extent=(0, 28, 28, 0))
            mark = "" if pred == labels[i] else " (wrong)"
            head = f"{label}\n" if r == 0 else ""
            axes[r, c].set_title(f"{head}{names[pred]}{mark}", fontsize=5)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(
        f"Class token's attention in the last layer (mean over heads), seed {seed}", fontsize=8
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=150)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", choices=("arrows", "fashion"), default="arrows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--example", type=int, default=0, help="index in c8_g8's test split")
    parser.add_argument(
        "--examples", default="0,1,2,3", help="fashion: comma-separated test image indices"
    )
    parser.add_argument("--root", default=os.path.join(lib.REPO, "workdirs", "studies"))
    parser.add_argument("--out", default=None, help="default: <study>/attention.png")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(lib.STUDIES_DIR, args.study, "attention.png")
    if args.study == "fashion":
        examples = [int(e) for e in args.examples.split(",")]
        print(f"wrote {fashion_figure(args.root, args.seed, examples, out)}")
        return 0

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rope_lie.data import spatial_arrows

    study = STUDIES["arrows"]
    layout = spatial_arrows.generate_chunk(spatial_arrows.CONFIGS[3], "test", 0)  # c8_g8
    i = args.example
    image = layout["image"][i]
    normalised = (image.astype(np.float32) / 255.0 - 0.5) / 0.5  # the recipe's mean/std
    panels = []
    for arm in study.arms:
        workdir = lib.run_dir(args.root, arm, args.seed, "cpu")
        if not lib.is_finished(workdir):
            print(f"{arm.name}: no finished run in {workdir}; skipped")
            continue
        model = load_model(load_config(arm, args.seed), workdir)
        logits = np.asarray(model(normalised[None]))[0]
        panels.append((arm.label, class_token_map(model, normalised), int(logits.argmax())))
    if not panels:
        raise SystemExit("no finished arrows runs: run python -m experiments.studies.run arrows")
    label = int(layout["label"][i])
    directions = ("up", "right", "down", "left")
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(2.1 * (len(panels) + 1), 2.6))
    axes[0].imshow(image[..., 0], cmap="gray")
    axes[0].set_title(f"layout (label {directions[label]})", fontsize=7)
    for (r, c), color in ((layout["y_cell"][i], "tab:blue"), (layout["target_cell"][i], "red")):
        axes[0].add_patch(plt.Rectangle((c * 8 - 0.5, r * 8 - 0.5), 8, 8, fill=False, ec=color))
    for ax, (name, amap, pred) in zip(axes[1:], panels, strict=True):
        ax.imshow(amap, cmap="viridis")
        for (r, c), color in ((layout["y_cell"][i], "tab:blue"), (layout["target_cell"][i], "red")):
            ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, ec=color, lw=1.2))
        ax.set_title(f"{name}\npredicts {directions[pred]}", fontsize=6)
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle("Class token's attention in the last layer (mean over heads)", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out, dpi=130)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
