"""Cayley-STRING's cost on the ``cayley_fashion`` model: P folded into q/k, or applied per token.

The model of ``configs/cayley.py:dataset=fashion_mnist`` (the sparse Cayley-STRING study's ViT:
width 48, 4 layers, 4 heads of 12 dims, MLP 192, 32x32 grayscale inputs in 4x4 patches, 65
tokens), one arm per generator of the ``cayley_fashion`` study and RoPE-Mixed without P. Every
Cayley arm runs two ways, with the same logits and gradients
(``tests/models/test_vit.py::test_cayley_string_p_per_token_equals_folded``; checked here on the
logits of 8 images with S drawn N(0, ``CHECK_INIT_STD``), as the recipe's S = 0 makes P = I):

- ``folded`` (the model's default, ``fold_mix=True``): P = (I - S)(I + S)^-1 solved (or, 2x2,
  formed in closed form) once per head and layer in every forward pass and folded into W_q and
  W_k, D N H^2 work per layer;
- ``per_token`` (``fold_mix=False``): the same P per head, applied to every token's q and k, B T
  N H^2 work per layer, as the reference implementations do.

Timed: a train step (forward, backward and the recipe's AdamW update, batch 128, the recipe's)
and an inference forward pass (batch 256, no cached states: P is rebuilt in every pass), all
cases round-robin (``common.timeit_interleaved``). Reported: train s/epoch (the step's time x
469 steps of 128 for 60,000 images, from timed steps, not a timed epoch), inference ms/image,
and the ratios to RoPE-Mixed (no P) and of per-token to folded, from the same run. The
classifier starts random instead of zero (the recipe's), so that the two ways' logits can be
compared; the cost is the same. Run:
``python -m experiments.benchmarks.cayley_speed [--out experiments/benchmarks/cayley_speed.json]
[--repeats 9]``.
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments.benchmarks import common, model_steps
from rope_lie import train

# arm: the recipe argument after dataset=fashion_mnist (the cayley_fashion study's arms)
ARMS = {
    "dense": "generator=dense",
    "block2x2": "generator=block2x2",
    "banded": "generator=banded,bw=2",
    "topk": "generator=topk,k=24",
    "rope_mixed": "pe=rope_mixed",
}
TRAIN_BATCH, EVAL_BATCH, TRAIN_IMAGES = 128, 256, 60_000
CHECK_INIT_STD = 0.1  # S of the logits check: nonzero, so P is not the identity


def model_config(arm: str, fold: bool, init_std: float | None = None):
    """The arm's recipe, with ``fold_mix`` (and Cayley's S drawn N(0, ``init_std``) if given)."""
    from configs import cayley

    config = cayley.get_config(f"dataset=fashion_mnist,{ARMS[arm]}")
    config.model.fold_mix = fold
    if init_std is not None and arm != "rope_mixed":
        config.model.pe_hparams.init_std = init_std
    config.model.head_zero_init = False  # nonzero logits to compare (same cost)
    return config


def cases() -> list[tuple[str, str, bool]]:
    """(case name, arm, fold): the Cayley arms both ways, RoPE-Mixed once."""
    out = []
    for arm in ARMS:
        for fold in (True, False) if arm != "rope_mixed" else (True,):
            name = arm if arm == "rope_mixed" else f"{arm}/{'folded' if fold else 'per_token'}"
            out.append((name, arm, fold))
    return out


def _images(config, batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (batch, *config.model.image_shape, config.model.channels)
    images = jnp.asarray(rng.normal(size=shape), jnp.float32)
    labels = jnp.asarray(rng.integers(0, config.model.num_classes, size=(batch,)))
    return images, labels


def check_logits(arm: str, fold: bool, images) -> tuple[np.ndarray, float]:
    """The logits of ``images`` of the arm's model with S drawn N(0, ``CHECK_INIT_STD``) (the
    same draw either way of ``fold``), and the largest |S| entry (0 would make P = I)."""
    config = model_config(arm, fold, CHECK_INIT_STD)
    model = train.build_model(config.model, jax.random.key(0))
    s_max = max(
        float(jnp.abs(leaf).max())
        for path, leaf in jax.tree.leaves_with_path(nnx.state(model, nnx.Param))
        if any(str(getattr(k, "key", "")).startswith("s_") for k in path)
    )
    return np.asarray(jax.jit(model)(images)), s_max


def calls(arm: str, fold: bool, train_batch: int, eval_batch: int) -> dict:
    """No-argument calls: one train step with the recipe's AdamW (keeping its state), one
    inference forward; and the parameter count."""
    config = model_config(arm, fold)
    model = train.build_model(config.model, jax.random.key(0))
    optimizer = optax.adamw(config.optim.lr, weight_decay=config.optim.weight_decay)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    forward = jax.jit(lambda params, images: nnx.merge(graphdef, params, rest)(images))
    eval_images, _ = _images(config, eval_batch, seed=1)
    return {
        "train": model_steps.step_call(model, *_images(config, train_batch), optimizer),
        "infer": lambda: forward(params, eval_images),
        "params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
    }


def run(repeats: int = 9, train_batch: int = TRAIN_BATCH, eval_batch: int = EVAL_BATCH) -> dict:
    built = {name: calls(arm, fold, train_batch, eval_batch) for name, arm, fold in cases()}
    # The two ways of one arm compute the same logits (same init key, S != 0): checked here too.
    agree = {}
    images = _images(model_config("dense", True), 8, seed=1)[0]
    for arm in ARMS:
        if arm != "rope_mixed":
            (a, s_max), (b, _) = (check_logits(arm, fold, images) for fold in (True, False))
            if s_max == 0:
                raise RuntimeError(f"{arm}: S = 0 in the logits check, P = I")
            agree[arm] = float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-12))
    results = {
        "machine": common.machine(),
        "shapes": dict(train_batch=train_batch, eval_batch=eval_batch, repeats=repeats),
        "params": {name: c["params"] for name, c in built.items()},
        "logits_rel_diff_per_token_vs_folded": agree,
    }
    for mode in ("train", "infer"):
        results[mode] = common.timeit_interleaved(
            {name: c[mode] for name, c in built.items()}, repeats=repeats
        )
    results["machine_after"] = common.machine()
    return results


def rows(results: dict) -> list[list[str]]:
    """Table rows: case, parameters, s/epoch, ms/image, ratios (min over repeats)."""
    train_t, infer_t = results["train"], results["infer"]
    shapes = results["shapes"]
    steps = math.ceil(TRAIN_IMAGES / shapes["train_batch"])
    out = []
    for name in train_t:
        arm = name.split("/")[0]
        folded = name if "/" not in name else f"{arm}/folded"
        r_train = train_t[name]["min_s"] / train_t["rope_mixed"]["min_s"]
        r_infer = infer_t[name]["min_s"] / infer_t["rope_mixed"]["min_s"]
        tok_train = train_t[name]["min_s"] / train_t[folded]["min_s"]
        tok_infer = infer_t[name]["min_s"] / infer_t[folded]["min_s"]
        out.append(
            [
                name,
                f"{results['params'][name]:,}",
                f"{train_t[name]['min_s'] * steps:.1f}",
                f"{infer_t[name]['min_s'] / shapes['eval_batch'] * 1e3:.3f}",
                f"{r_train:.2f} / {r_infer:.2f}",
                "-" if "/" not in name or name == folded else f"{tok_train:.2f} / {tok_infer:.2f}",
            ]
        )
    return out


HEADER = [
    "case",
    "params",
    "train s/epoch",
    "infer ms/image",
    "vs RoPE-Mixed (train / infer)",
    "per-token / folded (train / infer)",
]


def table(results: dict) -> None:
    common.print_table(
        f"Cayley-STRING on the cayley_fashion model, min over {results['shapes']['repeats']} "
        "repeats",
        HEADER,
        rows(results),
    )
    agree = results["logits_rel_diff_per_token_vs_folded"]
    print("logits, per-token vs folded (max rel diff):", agree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--repeats", type=int, default=9)
    flags = parser.parse_args()
    print("machine:", json.dumps(common.machine()), flush=True)
    results = run(flags.repeats)
    table(results)
    if flags.out:
        with open(flags.out, "w") as f:
            json.dump(results, f, indent=1, default=float)
        print(f"wrote {flags.out}")


if __name__ == "__main__":
    main()
