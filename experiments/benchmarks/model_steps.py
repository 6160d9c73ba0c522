"""Benchmarks 2 and 3: a full ViT train step per encoder, and an eval step with cached states.

All encoders of a model are timed round-robin (``common.timeit_interleaved``). Train step:
``train.make_train_step``, the training job's own (forward, backward, an AdamW update of every
parameter, the gradient norm; encoder parameters per layer and head, the default), no dropout,
as a ratio to the same model
without position encoding (``nope``) measured in the same run. Eval step: the jitted forward
with the encoder states precomputed once for the resolution (``ViT.precompute_pe``), as a
ratio to RoPE-Mixed (and the uncached forward beside it). Positions: the "sequential"
convention (LieRE's: [0, 1] at the training grid) for every encoder.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from experiments.benchmarks import common
from rope_lie import sharding, train
from rope_lie.models.vit import ViT

# name: (pe, pe_hparams, goal for the train-step ratio to nope, or None)
ENCODERS = {
    "nope": ("nope", None, None),
    "rope_mixed": ("rope_mixed", None, 1.05),
    "liere_b8": ("liere", {"block_size": 8}, 1.15),
    "liere_dense": ("liere", None, 1.5),
    "cayley_dense": ("cayley_string", {"generator": "dense", "init_std": 0.1}, 1.10),
    "cayley_block2x2": ("cayley_string", {"generator": "block2x2", "init_std": 0.1}, 1.05),
}
# name: (ViT kwargs, batch)
MODELS = {
    "Ti/4 @ 32x32 (65 tokens)": (dict(variant="Ti/4", image_shape=(32, 32), num_classes=10), 128),
    "S/16 @ 224 (197 tokens)": (dict(variant="S/16", image_shape=(224, 224), num_classes=1000), 8),
}
QUICK_MODELS = {
    "mu/4 @ 32x32 (65 tokens)": (dict(variant="mu/4", image_shape=(32, 32), num_classes=10), 32),
}


def build(model_kw: dict, encoder: str) -> ViT:
    pe, hparams, _ = ENCODERS[encoder]
    return ViT(
        **model_kw,
        pe=pe,
        pe_hparams=hparams,
        position_convention="sequential",
        head_zero_init=False,
        rngs=nnx.Rngs(0),
    )


def batch_of(model_kw: dict, batch: int):
    rng = np.random.default_rng(0)
    images = rng.normal(size=(batch, *model_kw["image_shape"], 3)).astype(np.float32)
    labels = rng.integers(0, model_kw["num_classes"], size=(batch,))
    return jnp.asarray(images), jnp.asarray(labels)


def train_step(model: ViT, optimizer: optax.GradientTransformation | None = None):
    """(jitted step, state, other): ``train.make_train_step`` of ``model`` with ``optimizer``
    (default AdamW 1e-3) on one device, its train state and the model's other state.

    ``step(state, {"image", "label"}, other, dropout_key) -> (state, metrics)``, the state
    donated: the training job's own step (loss, gradients, update, gradient norm).
    """
    optimizer = optax.adamw(1e-3) if optimizer is None else optimizer
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1}, jax.devices()[:1])
    setup, _ = train.make_setup(model, optimizer, mesh)
    state, other = train.model_state(model, optimizer)
    # Placed as the step returns them: a later call then reuses the first call's program.
    state = jax.device_put(state, setup.state_shardings)
    other = jax.device_put(other, setup.other_sharding)
    return train.make_train_step(setup), state, other


def train_call(model_kw: dict, batch: int, encoder: str):
    """A no-argument call that runs one train step (and keeps the updated state)."""
    return step_call(build(model_kw, encoder), *batch_of(model_kw, batch))


def step_call(model: ViT, images, labels, optimizer: optax.GradientTransformation | None = None):
    """A no-argument call that runs one ``train_step`` of ``model`` on one batch (and keeps the
    updated state)."""
    step, state, other = train_step(model, optimizer)
    batch, key = {"image": images, "label": labels}, jax.random.key(0)
    held = {"state": state}

    def call():
        held["state"], metrics = step(held["state"], batch, other, key)
        return metrics["loss"]

    return call


def eval_calls(model_kw: dict, batch: int, encoder: str) -> dict:
    """No-argument calls: the uncached and cached forward of one batch, and the precompute."""
    model = build(model_kw, encoder)
    graphdef, state = nnx.split(model)
    images, _ = batch_of(model_kw, batch)
    grid = model.input_grid(images)
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    cached = jax.jit(lambda s, x, cache: nnx.merge(graphdef, s)(x, pe_cache=cache))
    precompute = jax.jit(lambda s: nnx.merge(graphdef, s).precompute_pe(grid))
    cache = precompute(state)
    return {
        "uncached": lambda: forward(state, images),
        "cached": lambda: cached(state, images, cache),
        "precompute": lambda: precompute(state),
    }


EVAL_ENCODERS = ("nope", "rope_mixed", "liere_b8", "liere_dense", "cayley_dense")


def run(quick: bool = False) -> dict:
    """Train steps of every encoder, then eval steps, each set timed round-robin per model."""
    models = QUICK_MODELS if quick else MODELS
    repeats = 3 if quick else 5
    out = {"train": [], "eval": [], "load_before": common.machine()["loadavg_1_5_15"]}
    for name, (model_kw, batch) in models.items():
        calls = {encoder: train_call(model_kw, batch, encoder) for encoder in ENCODERS}
        times = common.timeit_interleaved(calls, repeats)
        del calls
        for encoder, t in times.items():
            out["train"].append({"model": name, "batch": batch, "encoder": encoder, "time": t})
            print(f"  train {name} {encoder}: {common.fmt_time(t)} ms", flush=True)
        if name.startswith("S/16"):
            continue  # eval: the CPU-sized model only
        calls = {
            (encoder, kind): fn
            for encoder in EVAL_ENCODERS
            for kind, fn in eval_calls(model_kw, batch, encoder).items()
        }
        times = common.timeit_interleaved(calls, repeats)
        del calls
        for encoder in EVAL_ENCODERS:
            t = {kind: times[(encoder, kind)] for kind in ("uncached", "cached", "precompute")}
            out["eval"].append({"model": name, "batch": batch, "encoder": encoder, **t})
            print(f"  eval {name} {encoder}: cached {common.fmt_time(t['cached'])} ms", flush=True)
    out["load_after"] = common.machine()["loadavg_1_5_15"]
    return out


def table(results: dict) -> None:
    rows = []
    for r in results["train"]:
        base = next(
            b for b in results["train"] if b["model"] == r["model"] and b["encoder"] == "nope"
        )
        goal = ENCODERS[r["encoder"]][2]
        ratio = common.ratio(r["time"], base["time"])
        # Judged on the min ratio, the least noise-sensitive (the median is printed beside it).
        met = "-" if goal is None else ("yes" if ratio["min_s"] <= goal else "no")
        rows.append(
            [
                r["model"],
                r["batch"],
                r["encoder"],
                common.fmt_time(r["time"]),
                common.fmt_ratio(ratio),
                goal or "-",
                met,
            ]
        )
    common.print_table(
        "2. Train step (fwd + bwd + AdamW), ratio to nope in the same run",
        ["model", "batch", "encoder", "ms min / median", "/ nope", "goal", "met"],
        rows,
    )
    rows = []
    for r in results["eval"]:
        base = next(
            b for b in results["eval"] if b["model"] == r["model"] and b["encoder"] == "rope_mixed"
        )
        nope = next(
            b for b in results["eval"] if b["model"] == r["model"] and b["encoder"] == "nope"
        )
        rows.append(
            [
                r["model"],
                r["batch"],
                r["encoder"],
                common.fmt_time(r["cached"]),
                common.fmt_ratio(common.ratio(r["cached"], base["cached"])),
                common.fmt_ratio(common.ratio(r["cached"], nope["cached"])),
                common.fmt_time(r["uncached"]),
                common.fmt_ratio(common.ratio(r["uncached"], base["uncached"])),
                common.fmt_time(r["precompute"]),
            ]
        )
    common.print_table(
        "3. Eval step (forward), encoder states cached per resolution",
        [
            "model",
            "batch",
            "encoder",
            "cached ms",
            "/ rope_mixed",
            "/ nope",
            "uncached ms",
            "uncached / rope_mixed",
            "precompute ms",
        ],
        rows,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    table(run(parser.parse_args().quick))
