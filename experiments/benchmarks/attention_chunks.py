"""Benchmark 7: inference with the attention in chunks (``xla_attention.cpu_chunks``) against none.

On one XLA:CPU device the evaluation step attends with the ``"xla_cpu"`` backend
(``backends.inference_backend``): the batch in groups, one after the other in a ``lax.map``
loop, so that a group's logits stay in cache through the softmax, and each group in two
concurrent chunks, one per core (``xla_attention.attend_cpu_batches``). This times the
jitted forward of a ViT (the evaluation path: encoder states precomputed once per resolution)
with the chunks ``cpu_chunks`` chooses and with none, round-robin in one process
(``common.timeit_interleaved``), at the training grid and the larger evaluation grids of the
arrows studies, checks that the logits are bitwise equal, and prints none / chunks (> 1: the
chunks are faster).

    python -m experiments.benchmarks.attention_chunks [--quick] [--repeats 4]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks import common
from rope_lie.models import xla_attention
from rope_lie.models.vit import ViT

# The arrows studies' model and evaluation batch: ViT mu/8 with LieRE 8x8 trained on 64 px,
# evaluated on 250 images at the training grid (65 tokens) and at 2x and 2.5x (257, 401).
MODEL = dict(
    variant="mu/8",
    image_shape=(64, 64),
    channels=1,
    num_classes=4,
    pe="liere",
    pe_hparams={"block_size": 8},
    position_convention="sequential",
)
SIDES = (64, 128, 160)
QUICK_SIDES = (64, 96)
BATCH = 250


def forward_calls(side: int, batch: int) -> tuple[dict, int, tuple[int, int], bool]:
    """({"none": call, "chunks": call}, tokens, the chunks, whether the two give equal bits)."""
    images = np.random.default_rng(0).normal(size=(batch, side, side, 1)).astype(np.float32)
    images = jnp.asarray(images)
    calls = {}
    for name, backend in (("none", "xla"), ("chunks", "xla_cpu")):  # the same parameters
        model = ViT(**MODEL, attention=backend, head_zero_init=False, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        grid = model.input_grid(images)
        cache = jax.jit(lambda s, g=graphdef, t=grid: nnx.merge(g, s).precompute_pe(t))(state)
        fn = jax.jit(lambda s, x, c, g=graphdef: nnx.merge(g, s)(x, pe_cache=c))
        compiled = fn.lower(state, images, cache).compile()
        calls[name] = lambda compiled=compiled, s=state, c=cache: compiled(s, images, c)
    heads, tokens = model.blocks[0].attn.num_heads, grid[0] * grid[1] + 1
    chunks = xla_attention.cpu_chunks(batch, heads, tokens, tokens)
    equal = bool(jnp.all(calls["none"]() == calls["chunks"]()))
    return calls, tokens, chunks, equal


def run(quick: bool = False, repeats: int = 4) -> list[dict]:
    rows = []
    for side in QUICK_SIDES if quick else SIDES:
        calls, tokens, chunks, equal = forward_calls(side, BATCH)
        times = common.timeit_interleaved(calls, repeats=repeats)
        rows.append(
            {
                "side": side,
                "tokens": tokens,
                "batch": BATCH,
                "chunks": chunks,
                "bitwise_equal": equal,
                "none": times["none"],
                "with_chunks": times["chunks"],
            }
        )
        print(
            f"  {side} px: none {common.fmt_time(times['none'])} ms, chunks {chunks} "
            f"{common.fmt_time(times['chunks'])} ms, bitwise equal {equal}",
            flush=True,
        )
    return rows


def table(rows: list[dict]) -> None:
    common.print_table(
        f"7. Inference forward, mu/8 LieRE 8x8, batch {BATCH}: attention chunks vs none",
        [
            "image",
            "tokens",
            "(loop, parallel)",
            "none ms min / med",
            "chunks ms min / med",
            "none / chunks",
            "bitwise equal",
        ],
        [
            [
                f"{r['side']} px",
                r["tokens"],
                str(tuple(r["chunks"])),
                common.fmt_time(r["none"]),
                common.fmt_time(r["with_chunks"]),
                common.fmt_ratio(common.ratio(r["none"], r["with_chunks"])),
                r["bitwise_equal"],
            ]
            for r in rows
        ],
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=4)
    flags = parser.parse_args()
    print(common.machine())
    table(run(flags.quick, flags.repeats))
