"""Benchmark 5: FLOPs per encoder from XLA's cost analysis at ViT-Ti/B/L 16 @ 224, beside
measured forward-time ratios.

Per encoder and model, from ``jax.jit(f).lower(...).cost_analysis()`` (the HLO before XLA's
optimisations, abstract parameters):

- forward FLOPs of one image with the encoder states cached: the rotation *application* only,
  comparable to the LieRE paper's Table 8 (+0.18 % LieRE8, +1.4 % LieRE64 on ViT-B);
- the encoder precompute (the exponentials), once per forward pass whatever the batch. XLA
  counts a while loop's body once; the squaring loop runs s times, so (s - 1) times the FLOPs
  of one squaring are added per layer, s taken from freshly initialised generators of the
  model's shapes (``liere.init``, U[0, 2*pi)). On a CPU ``expm_combination`` also runs its rows
  in groups, a ``lax.map`` loop whose body would be counted once too: every count here is made
  with the rows in one group (``rows_ungrouped``), the same arithmetic without the loop.

Times: the jitted forward of a batch of 8 at Ti/16 and B/16 (L/16: FLOPs only, to keep the run
short), cached and uncached, as ratios to ``nope`` timed round-robin with it.
"""

from __future__ import annotations

import argparse
import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks import common
from experiments.benchmarks.model_steps import ENCODERS, build
from rope_lie.encodings import expm, expm_combination, lie, liere
from rope_lie.models.variants import model_dims
from rope_lie.models.vit import num_prefix_tokens

MODELS = {"Ti/16": 8, "B/16": 8, "L/16": None}  # name: batch for the timed forward (None: no)
KW = dict(image_shape=(224, 224), num_classes=1000)


def matmul_train_flops(model_kw: dict, batch: int) -> float:
    """Model FLOPs of one ViT train step by hand, the MFU convention (PaLM, App. B): the matrix
    products of the forward pass times 3 (the backward pass does two of each).

    Forward, per image of P patches, T = P + prefix tokens, width D, MLP width M, L layers:
    2 P (p C) D (patch embedding) + L (2 T D (4 D + 2 M) + 4 T^2 D) (q, k, v and output
    projections, MLP, attention logits and weighted values) + 2 D V (classifier). The position
    encoding, norms, softmax, activations and optimiser are left out (XLA:CPU's count of the
    ViT-B/16 train step at 224 px, batch 64, is 0.2 % higher with RoPE-Mixed and 0.5 % with LieRE
    8x8), so the count is the same for every encoder and attention backend, and MFU ranks the
    steps by speed.

    Args:
      model_kw: ``ViT`` keyword arguments (variant, dims, patch_size, image_shape, channels,
        num_classes, pool, num_registers).
      batch: images per step.

    Returns:
      FLOPs per step.
    """
    spatial = tuple(model_kw["image_shape"])
    dims, patch = model_dims(
        model_kw.get("variant"), model_kw.get("dims"), model_kw.get("patch_size"), len(spatial)
    )
    patches = math.prod(s // p for s, p in zip(spatial, patch, strict=True))
    tokens = patches + num_prefix_tokens(
        model_kw.get("pool", "cls"), model_kw.get("num_registers", 0)
    )
    width, mlp = dims["width"], dims["mlp_dim"]
    embed = 2 * patches * math.prod(patch) * model_kw.get("channels", 3) * width
    layer = 2 * tokens * width * (4 * width + 2 * mlp) + 4 * tokens**2 * width
    head = 2 * width * model_kw.get("num_classes", 1000)
    return 3.0 * batch * (embed + dims["depth"] * layer + head)


@contextlib.contextmanager
def rows_ungrouped():
    """Trace with ``expm_combination``'s rows all in one group (``expm.Host.groups_rows`` off).

    On a CPU the rows of the exponentials run in groups, one ``lax.map`` iteration each, and
    XLA's cost analysis counts a loop's body once: a model with G groups per layer would count
    1/G of its Taylor rows and squarings. Traces are cleared on entry and exit
    (``jax.clear_caches``), as grouped and ungrouped hosts compare equal as static arguments.
    """
    grouped = expm.Host.groups_rows
    jax.clear_caches()
    expm.Host.groups_rows = property(lambda self: False)
    try:
        yield
    finally:
        expm.Host.groups_rows = grouped
        jax.clear_caches()


def xla_flops(fn, *args) -> float:
    """XLA's FLOP count of ``jax.jit(fn)`` at ``args`` (arrays or ``jax.ShapeDtypeStruct``),
    lowered with the exponentials' rows ungrouped (``rows_ungrouped``)."""
    with rows_ungrouped():
        return _flops(jax.jit(fn).lower(*args))


def _flops(lowered) -> float:
    """XLA's FLOP count; a computation without arithmetic (NoPE's precompute) has no key."""
    cost = lowered.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    if cost is None:
        raise RuntimeError("XLA gave no cost analysis for this backend")
    return float(cost.get("flops", 0.0))


def _loop_correction(model_abstract, encoder: str, pos) -> float:
    """(s - 1) x FLOPs of one squaring, summed over layers (LieRE with b > 4 only)."""
    pe, hparams, _ = ENCODERS[encoder]
    if pe != "liere":
        return 0.0
    attn = model_abstract.blocks[0].attn
    block = (hparams or {}).get("block_size") or attn.head_dim
    if block <= 4:
        return 0.0
    body = jax.jit(
        lambda r, s: jnp.where((s > 0)[:, None, None], expm.product(r, r, expm.this_host()), r)
    )
    n = pos.shape[0] * attn.num_heads * (attn.head_dim // block)
    one = _flops(
        body.lower(
            jax.ShapeDtypeStruct((n, block, block), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.int32),
        )
    )
    total = 0.0
    for layer in range(len(model_abstract.blocks)):
        gen = liere.init(
            jax.random.key(layer),
            num_heads=attn.num_heads,
            head_dim=attn.head_dim,
            num_axes=2,
            block_size=block,
        )["gen_ANKbb"]
        skew = lie.skew_from_upper(gen).reshape(2, -1, block, block)
        s = int(np.max(expm_combination.num_squarings(pos, skew)))
        total += max(s - 1, 0) * one
    return total


def count(model_name: str, encoder: str) -> dict:
    """Forward FLOPs per image with cached encoder states, and the precompute's FLOPs."""
    kw = dict(KW, variant=model_name)
    model = nnx.eval_shape(lambda: build(kw, encoder))
    graphdef, state = nnx.split(model)
    grid = model.train_grid
    pos = model.positions(grid)

    def precompute(s):
        return nnx.merge(graphdef, s).precompute_pe(grid)

    def cached(s, x, c):
        return nnx.merge(graphdef, s)(x, pe_cache=c)

    cache = jax.eval_shape(precompute, state)
    image = jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)
    return {
        "model": model_name,
        "encoder": encoder,
        "forward_cached_flops": xla_flops(cached, state, image, cache),
        "precompute_flops": xla_flops(precompute, state) + _loop_correction(model, encoder, pos),
    }


def forward_calls(model_name: str, encoder: str, batch: int) -> dict:
    """No-argument calls of the real model's forward on a batch, uncached and cached."""
    kw = dict(KW, variant=model_name)
    model = build(kw, encoder)
    graphdef, state = nnx.split(model)
    grid = model.train_grid
    images = jnp.asarray(np.random.default_rng(0).normal(size=(batch, 224, 224, 3)), jnp.float32)
    cache = jax.jit(lambda s: nnx.merge(graphdef, s).precompute_pe(grid))(state)
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    cached = jax.jit(lambda s, x, c: nnx.merge(graphdef, s)(x, pe_cache=c))
    return {
        "time_uncached": lambda: forward(state, images),
        "time_cached": lambda: cached(state, images, cache),
    }


def run(quick: bool = False) -> dict:
    """FLOPs of every encoder per model; forward times of a model's encoders round-robin."""
    models = {"Ti/16": 2} if quick else MODELS
    encoders = ("nope", "liere_b8", "liere_dense") if quick else tuple(ENCODERS)
    repeats = 3 if quick else 5
    out = {"rows": [], "load_before": common.machine()["loadavg_1_5_15"]}
    for name, batch in models.items():
        rows = [count(name, encoder) for encoder in encoders]
        for row in rows:
            print(f"  flops {name} {row['encoder']}: {row['forward_cached_flops']:.3g}", flush=True)
        if batch:
            calls = {
                (encoder, kind): fn
                for encoder in encoders
                for kind, fn in forward_calls(name, encoder, batch).items()
            }
            times = common.timeit_interleaved(calls, repeats)
            del calls
            for row in rows:
                row["batch"] = batch
                for kind in ("time_uncached", "time_cached"):
                    row[kind] = times[(row["encoder"], kind)]
        out["rows"] += rows
    out["load_after"] = common.machine()["loadavg_1_5_15"]
    return out


def table(results: dict) -> None:
    rows = []
    for r in results["rows"]:
        base = next(
            b for b in results["rows"] if b["model"] == r["model"] and b["encoder"] == "nope"
        )
        extra = r["forward_cached_flops"] / base["forward_cached_flops"] - 1
        per_pass = (r["forward_cached_flops"] + r["precompute_flops"]) / base[
            "forward_cached_flops"
        ] - 1
        timed = "time_cached" in r
        rows.append(
            [
                r["model"],
                r["encoder"],
                f"{r['forward_cached_flops'] / 1e9:.2f}",
                f"{100 * extra:+.2f} %",
                f"{r['precompute_flops'] / 1e9:.2f}",
                f"{100 * per_pass:+.1f} %",
                common.fmt_ratio(common.ratio(r["time_cached"], base["time_cached"]))
                if timed
                else "-",
                common.fmt_ratio(common.ratio(r["time_uncached"], base["time_uncached"]))
                if timed
                else "-",
            ]
        )
    common.print_table(
        "5. FLOPs (XLA cost analysis) per encoder at 224, and measured forward-time ratios",
        [
            "model",
            "encoder",
            "fwd GFLOP/img (cached)",
            "vs nope",
            "precompute GFLOP",
            "vs nope at batch 1",
            "time cached / nope",
            "time uncached / nope",
        ],
        rows,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    table(run(parser.parse_args().quick))
