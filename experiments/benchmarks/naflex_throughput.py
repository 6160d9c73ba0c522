"""Throughput of padded and packed mixed-size token batches against fixed-size ones (NaFlex).

One ViT train step per case (``train.make_train_step``, the training job's: forward, backward,
AdamW), on batches of B images:

- ``fixed8``: 8x8-patch images through ``ViT.__call__`` (the fixed-size path, 64 tokens);
- ``fixed10``: 10x10-patch images through ``ViT.__call__`` (100 tokens, the padded length);
- ``tokens8``: the 8x8 batch through ``ViT.classify_tokens`` unpadded (the token path's own cost:
  per-example positions and states, the mask bias);
- ``mixed``: images of sides uniform in [6, 10] patches (NaFlex's training mix) padded to 100
  tokens through ``ViT.classify_tokens``;
- ``packed``: the same images packed greedily into rows of 100 tokens (``tokens.pack_images``,
  first-fit decreasing; at most 100 // 36 = 2 images a row), each image in its own segment
  (``tokens.Packed``), as ``naflex.pack`` trains;
- ``packed200``: the same into rows of 200 tokens (at most 5 images a row): less padding,
  longer attention rows.

Reported: real (unpadded) tokens per second, the padding fraction (padded slots over the
patch-token slots; the per-image prefix tokens left out, as in ``mixed``), each case's time
over ``fixed8``'s, and the packed cases' time over ``mixed``'s (the same images), all timed
round-robin in the same run (``common.timeit_interleaved``).

    python -m experiments.benchmarks.naflex_throughput [--pe rope_mixed] [--batch 32] [--out X]
    python -m experiments.benchmarks.naflex_throughput --variant B --batch 128 \
        --attention xla+cudnn --dtype bfloat16 --pool mean   # a GPU: the key mask through cuDNN
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks import common, model_steps
from rope_lie import config_lib
from rope_lie.evaluate import PACKED_KEYS, TOKEN_KEYS
from rope_lie.models import tokens
from rope_lie.models.vit import ViT

PATCH = 8


def _step_calls(model):
    """(images, labels) -> loss and (tokens, labels) -> loss: one ``train.make_train_step``
    step each (``model_steps.train_step``), sharing one train state that each call advances."""
    step, state, other = model_steps.train_step(model)
    held, key = {"state": state}, jax.random.key(0)

    def call(batch):
        held["state"], metrics = step(held["state"], batch, other, key)
        return metrics["loss"]

    def image_step(images, labels):
        return call({"image": images, "label": labels})

    def token_step(batch, labels):
        return call({**dict(zip(TOKEN_KEYS, batch, strict=True)), "label": labels})

    def packed_step(batch, place, labels):
        arrays = dict(zip(PACKED_KEYS, batch, strict=True))
        return call(
            {**arrays, "image_row": place[:, 0], "image_slot": place[:, 1], "label": labels}
        )

    return image_step, token_step, packed_step


def run(
    pe: str,
    batch: int,
    repeats: int,
    variant: str,
    min_side: int,
    max_side: int,
    attention: str = "xla",
    dtype: str = "float32",
    pool: str = "cls",
) -> dict:
    rng = np.random.default_rng(0)
    model = ViT(
        variant=f"{variant}/{PATCH}",
        image_shape=(64, 64),
        channels=1,
        num_classes=4,
        attention=attention,
        dtype=dtype,
        pool=pool,
        **config_lib.pe_fields(pe),
        rngs=nnx.Rngs(0),
    )
    labels = jnp.asarray(rng.integers(0, 4, batch))
    image = lambda side: rng.normal(size=(side * PATCH, side * PATCH, 1)).astype(np.float32)
    fixed8 = jnp.asarray(np.stack([image(8) for _ in range(batch)]))
    fixed10 = jnp.asarray(np.stack([image(10) for _ in range(batch)]))
    sides = rng.integers(min_side, max_side + 1, batch)
    images = [image(s) for s in sides]
    mixed = tokens.pack(images, (PATCH, PATCH), max_side**2)
    mixed = tokens.Tokens(*map(jnp.asarray, mixed))
    real = int(mixed.mask_BT.sum())
    tokens8 = model.image_tokens(fixed8)
    image_step, token_step, packed_step = _step_calls(model)
    cases = {
        "fixed8": (lambda: image_step(fixed8, labels), batch * 64, batch * 64),
        "fixed10": (lambda: image_step(fixed10, labels), batch * 100, batch * 100),
        "tokens8": (lambda: token_step(tokens8, labels), batch * 64, batch * 64),
        "mixed": (lambda: token_step(mixed, labels), real, batch * max_side**2),
    }
    for name, length in (("packed", max_side**2), ("packed200", 2 * max_side**2)):
        packed, place = tokens.pack_images(images, (PATCH, PATCH), length, length // min_side**2)
        packed, place = tokens.Packed(*map(jnp.asarray, packed)), jnp.asarray(place)
        step = lambda p=packed, q=place: packed_step(p, q, labels)
        cases[name] = (step, real, packed.segment_BT.size)
    times = common.timeit_interleaved({k: v[0] for k, v in cases.items()}, repeats=repeats)
    rows = {}
    for name, (_, real, slots) in cases.items():
        t = times[name]
        rows[name] = {
            "time": t,
            "real_tokens": real,
            "slots": slots,
            "padding_fraction": 1 - real / slots,
            "real_tokens_per_s": real / t["median_s"],
            "time_over_fixed8": common.ratio(t, times["fixed8"]),
            "time_over_mixed": common.ratio(t, times["mixed"]),
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pe", default="rope_mixed", help="a recipe pe= value")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--variant", default="mu")
    parser.add_argument("--attention", default="xla", help="backends, joined by +")
    parser.add_argument("--dtype", default="float32", help="activation dtype")
    parser.add_argument(
        "--pool",
        default="cls",
        help="'cls' (65 and 101 tokens) or 'mean' (64, 100: cuDNN's even lengths)",
    )
    parser.add_argument("--min-side", type=int, default=6)
    parser.add_argument("--max-side", type=int, default=10)
    parser.add_argument(
        "--out",
        default=os.path.join(tempfile.gettempdir(), "naflex_throughput.json"),
        help="JSON output path (a scratch file unless given: the committed results are only "
        "overwritten when named)",
    )
    args = parser.parse_args()
    results = {"machine": common.machine(), "args": vars(args), "cases": {}}
    for pe, attention in itertools.product(args.pe.split("+"), args.attention.split("+")):
        rows = run(
            pe,
            args.batch,
            args.repeats,
            args.variant,
            args.min_side,
            args.max_side,
            attention,
            args.dtype,
            args.pool,
        )
        key = pe if attention == "xla" else f"{pe} {attention}"
        results["cases"][key] = rows
        common.print_table(
            f"{key}: one train step (forward, backward, AdamW), batch {args.batch}, "
            f"ViT-{args.variant}/8, {args.dtype}, pool {args.pool}",
            [
                "case",
                "min / median ms",
                "real tokens/s",
                "padding",
                "time / fixed8",
                "time / mixed",
            ],
            [
                [
                    name,
                    common.fmt_time(r["time"]),
                    f"{r['real_tokens_per_s']:,.0f}",
                    f"{100 * r['padding_fraction']:.1f} %",
                    f"{r['time_over_fixed8']['median_s']:.2f}",
                    f"{r['time_over_mixed']['median_s']:.2f}",
                ]
                for name, r in rows.items()
            ],
        )
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
