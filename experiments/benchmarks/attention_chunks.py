"""Benchmark 7: the train step with the attention in two batch chunks against one (issue 14).

``attention.cpu_batch_chunks`` splits each attention into two interleaved batch chunks on a
single XLA:CPU device, so that XLA's thunk executor runs the small batched products and the
softmax of the two chunks on both cores at once. This times the same train step as
``vs_pytorch.py`` (forward, backward, AdamW; batch 128, float32) traced with the rule as it is
(two chunks here) and with one chunk, round-robin in the same run (``common.timeit_interleaved``),
and prints one chunk / two chunks per model and encoder (> 1: the chunks are faster). It also
prints the largest gradient difference between the two steps on the same batch: the forward is
bitwise equal, the gradients differ by float32 rounding only.

    python -m experiments.benchmarks.attention_chunks [--quick] [--repeats 8]
"""

from __future__ import annotations

import argparse
from unittest import mock

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments.benchmarks import common, vs_pytorch
from rope_lie.models import attention
from rope_lie.models.vit import ViT

ENCODERS = ("none", "liere_b8")


def step_and_grads(model_kw: dict, batch: int, encoder: str, chunks: int | None):
    """(no-argument train-step call, the gradients of the first step) with the attention in
    ``chunks`` batch chunks, or as ``cpu_batch_chunks`` decides when None."""
    rule = attention.cpu_batch_chunks if chunks is None else (lambda _batch: chunks)
    with mock.patch.object(attention, "cpu_batch_chunks", rule):  # read while tracing
        call, _, _ = vs_pytorch.ours_step(model_kw, batch, encoder)
        pe, hparams, additive = vs_pytorch.ENCODERS[encoder]
        model = ViT(
            **model_kw, pe=pe, pe_hparams=hparams, additive=additive,
            position_convention="sequential", head_zero_init=False, rngs=nnx.Rngs(0),
        )  # fmt: skip
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        images, labels = vs_pytorch._batch(model_kw, batch)

        def loss_fn(params):
            logits = nnx.merge(graphdef, params, rest)(images, train=True)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        grads = jax.jit(jax.grad(loss_fn))(params)
    return call, grads


def run(quick: bool = False, repeats: int = 8) -> list[dict]:
    models = vs_pytorch.QUICK_MODELS if quick else vs_pytorch.MODELS
    rows = []
    for name, (model_kw, batch) in models.items():
        for encoder in ENCODERS:
            one, g_one = step_and_grads(model_kw, batch, encoder, 1)
            auto, g_auto = step_and_grads(model_kw, batch, encoder, None)
            diff = max(
                float(jnp.max(jnp.abs(a - b)))
                for a, b in zip(jax.tree.leaves(g_one), jax.tree.leaves(g_auto), strict=True)
            )
            times = common.timeit_interleaved({"one": one, "auto": auto}, repeats=repeats)
            row = {
                "model": name, "encoder": encoder, "chunks": attention.cpu_batch_chunks(batch),
                "one": times["one"], "auto": times["auto"], "max_grad_diff": diff,
            }  # fmt: skip
            rows.append(row)
            print(
                f"  {name} {encoder}: one chunk {common.fmt_time(times['one'])} ms, "
                f"{row['chunks']} chunks {common.fmt_time(times['auto'])} ms",
                flush=True,
            )
    return rows


def table(rows: list[dict]) -> None:
    common.print_table(
        "7. Train step, attention in batch chunks (cpu_batch_chunks) vs one, batch 128",
        ["model", "encoder", "chunks", "one ms min / med", "chunks ms min / med",
         "one / chunks", "max |grad diff|"],
        [
            [r["model"], r["encoder"], r["chunks"], common.fmt_time(r["one"]),
             common.fmt_time(r["auto"]), common.fmt_ratio(common.ratio(r["one"], r["auto"])),
             f"{r['max_grad_diff']:.1e}"]
            for r in rows
        ],
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=8)
    flags = parser.parse_args()
    print(common.machine())
    table(run(flags.quick, flags.repeats))
