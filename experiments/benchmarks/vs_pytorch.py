"""Benchmark 6: the ViT train step against PyTorch eager on the same CPU, at the same shapes.

One train step = forward, backward and an AdamW update of every parameter, float32, batch 128,
no dropout. Ours is the training job's step, ``train.make_train_step`` (``model_steps.train_step``;
it also computes the gradient norm and the batch accuracy). PyTorch's is eager:
``zero_grad``, forward, cross-entropy, ``backward``, ``torch.optim.AdamW.step``, with
``torch.get_num_threads()`` threads (one per core, as XLA:CPU uses). Models, when timm can be
imported (the ``bench`` extra):

- none / APE: timm's ``VisionTransformer`` (``pos_embed="none"`` / ``"learn"``, class token,
  pre-LN, fused qkv, ``F.scaled_dot_product_attention``, exact GELU);
- RoPE-Mixed: timm's ``Eva`` as built by ``vit_*_patch16_rope_mixed_224`` (naver's RoPE-ViT:
  ``attn_type="rope"``, ``rope_type="mixed"``, temperature 10), without LayerScale so that it
  holds the same parameters as ours;
- LieRE b8 / dense: timm's ``VisionTransformer`` with an attention layer that rotates q and k by
  ``torch.linalg.matrix_exp`` of the per-layer, per-head generators at the token positions (the
  LieRE reference's approach; blocks of 8 are exponentiated as 8 x 8 matrices, not as one
  block-diagonal 64 x 64), class token at position 0 (identity).

Without timm, none and APE fall back to PyTorch's ``nn.TransformerEncoderLayer`` (pre-LN, GELU)
and the rotary rows are skipped. Both frameworks see the same shapes; positions follow the
"sequential" convention on our side. The models' parameter counts are printed side by side.

Timing: warm-up calls first (ours compiles), then ``repeats`` rounds in which every step is
called once, framework order alternating, with a 0.2 s pause before each call: PyTorch's
OpenMP threads spin for a while after a parallel region, and without the pause they took CPU
from the XLA call that followed (neither framework runs while the other is timed).

Ceiling: the best matmul rate of the machine, measured in the same run: the model's largest
matmul shapes and a 2048^3 product, in XLA and in torch (MKL / oneDNN); the best of all is the
ceiling. Each step's FLOPs are XLA's cost analysis of our compiled step (the same model in both
frameworks), so "GFLOP/s" is step FLOPs / time and "of ceiling" its fraction of the best matmul
rate.
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks import common, model_steps

# name: (ViT kwargs, batch). Two shapes: the quickstart's model and ViT-Ti/4.
MODELS = {
    "mu/8 @ 64x64x1": (dict(variant="mu/8", image_shape=(64, 64), channels=1, num_classes=4), 128),
    "Ti/4 @ 32x32x3": (dict(variant="Ti/4", image_shape=(32, 32), channels=3, num_classes=10), 128),
}
QUICK_MODELS = {"mu/8 @ 64x64x1": MODELS["mu/8 @ 64x64x1"]}
# name: (our pe, pe_hparams, additive)
ENCODERS = {
    "none": ("nope", None, "none"),
    "ape": ("nope", None, "ape"),
    "rope_mixed": ("rope_mixed", None, "none"),
    "liere_b8": ("liere", {"block_size": 8}, "none"),
    "liere_dense": ("liere", None, "none"),
}
GOALS = {"none": 1.0, "ape": 1.0, "rope_mixed": 1.0}  # PyTorch / ours >= goal (parity)
PAUSE_S = 0.2


# --- ours ---------------------------------------------------------------------------------


def ours_step(model_kw: dict, batch: int, encoder: str):
    """(no-argument call running one train step, its FLOPs, parameter count)."""
    from flax import nnx

    from rope_lie.models.vit import ViT

    pe, hparams, additive = ENCODERS[encoder]
    model = ViT(
        **model_kw,
        pe=pe,
        pe_hparams=hparams,
        additive=additive,
        position_convention="sequential",
        head_zero_init=False,
        rngs=nnx.Rngs(0),
    )
    step, state, other = model_steps.train_step(model)
    images, labels = _batch(model_kw, batch)
    data, key = {"image": images, "label": labels}, jax.random.key(0)
    compiled = step.lower(state, data, other, key).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    count = sum(x.size for x in jax.tree.leaves(state["params"]))
    held = {"state": state}

    def call():
        held["state"], metrics = compiled(held["state"], data, other, key)
        return metrics["loss"]

    call.compiled = compiled  # for profile_step.py: the HLO behind the call
    return call, float(cost["flops"]), count


def _batch(model_kw: dict, batch: int):
    rng = np.random.default_rng(0)
    shape = (batch, *model_kw["image_shape"], model_kw["channels"])
    images = rng.normal(size=shape).astype(np.float32)
    labels = rng.integers(0, model_kw["num_classes"], size=(batch,))
    return jnp.asarray(images), jnp.asarray(labels)


# --- PyTorch ------------------------------------------------------------------------------


def _dims(model_kw: dict) -> dict:
    from rope_lie.models.variants import parse_variant

    dims, patch = parse_variant(model_kw["variant"], None, 2)
    return dict(dims, patch=patch[0])


def maybe_timm():
    """timm if it imports (it needs a torchvision that loads beside torch), else None."""
    try:
        import timm
    except Exception:  # noqa: BLE001 - ImportError or torchvision's operator errors
        return None
    return timm


def torch_model(model_kw: dict, encoder: str):
    """The PyTorch model for an encoder, or None when it needs timm and timm is missing."""
    import torch

    d = _dims(model_kw)
    timm = maybe_timm()
    common_kw = dict(
        img_size=model_kw["image_shape"],
        patch_size=d["patch"],
        in_chans=model_kw["channels"],
        num_classes=model_kw["num_classes"],
        embed_dim=d["width"],
        depth=d["depth"],
        num_heads=d["num_heads"],
        mlp_ratio=d["mlp_dim"] / d["width"],
        qkv_bias=True,
        class_token=True,
        global_pool="token",
    )
    if timm is None:
        if encoder not in ("none", "ape"):
            return None
        return _PlainViT(model_kw, d, ape=encoder == "ape")
    from timm.models.eva import Eva
    from timm.models.vision_transformer import VisionTransformer

    if encoder in ("none", "ape"):
        return VisionTransformer(**common_kw, pos_embed="none" if encoder == "none" else "learn")
    if encoder == "rope_mixed":
        return Eva(
            **common_kw,
            attn_type="rope",
            use_abs_pos_emb=False,
            use_rot_pos_emb=True,
            rope_grid_indexing="xy",
            rope_temperature=10.0,
            rope_type="mixed",
        )
    block = 8 if encoder == "liere_b8" else d["width"] // d["num_heads"]
    grid = [s // d["patch"] for s in model_kw["image_shape"]]
    attn = _liere_attention(torch, grid, block)
    return VisionTransformer(**common_kw, pos_embed="none", attn_layer=attn)


def _liere_attention(torch, grid, block: int):
    """A timm ``Attention`` that rotates q and k by LieRE rotations (class token: identity)."""
    from timm.layers import Attention

    axes = len(grid)
    # LieRE's positions: each axis on [0, 1] over the training grid, prefix token at 0.
    mesh = torch.meshgrid(*[torch.linspace(0, 1, n) for n in grid], indexing="ij")
    pos_TA = torch.cat([torch.zeros(1, axes), torch.stack([m.flatten() for m in mesh], -1)])

    class LieREAttention(Attention):
        def __init__(self, dim, num_heads, **kw):
            super().__init__(dim, num_heads, **kw)
            nb = self.head_dim // block
            # generators: free upper triangles, uniform [0, 2 pi) as the reference initialises
            self.gen = torch.nn.Parameter(
                torch.rand(axes, num_heads, nb, block, block) * 2 * math.pi
            )

        def rotations(self):
            skew = self.gen - self.gen.transpose(-1, -2)
            exponent = torch.einsum("ta,anbij->tnbij", pos_TA, skew)
            return torch.linalg.matrix_exp(exponent)  # (T, N, nb, b, b)

        def forward(self, x, attn_mask=None, is_causal=False):
            B, T, C = x.shape
            qkv = self.qkv(x).reshape(B, T, 3, self.num_heads, self.head_dim)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, N, T, H)
            rot = self.rotations()
            nb = self.head_dim // block

            def rotate(z_BNTH):  # blocks c of size b: z_c <- R_c z_c per token and head
                z = z_BNTH.reshape(B, self.num_heads, T, nb, block)
                z = torch.einsum("tncij,zntcj->zntci", rot, z)
                return z.reshape(B, self.num_heads, T, self.head_dim)

            q, k = rotate(q), rotate(k)
            x = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            return self.proj(x.transpose(1, 2).reshape(B, T, C))

    return LieREAttention


def _PlainViT(model_kw: dict, d: dict, *, ape: bool):  # noqa: N802 - a class factory
    """PyTorch's own pre-LN ``nn.TransformerEncoder`` ViT (the fallback without timm)."""
    import torch
    from torch import nn

    class PlainViT(nn.Module):
        def __init__(self):
            super().__init__()
            p, w = d["patch"], d["width"]
            self.embed = nn.Conv2d(model_kw["channels"], w, p, stride=p)
            tokens = math.prod(s // p for s in model_kw["image_shape"]) + 1
            self.cls = nn.Parameter(torch.zeros(1, 1, w))
            self.pos = nn.Parameter(torch.randn(1, tokens, w) * 0.02) if ape else None
            layer = nn.TransformerEncoderLayer(
                w,
                d["num_heads"],
                d["mlp_dim"],
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            self.blocks = nn.TransformerEncoder(layer, d["depth"], enable_nested_tensor=False)
            self.norm = nn.LayerNorm(w)
            self.head = nn.Linear(w, model_kw["num_classes"])

        def forward(self, x):
            x = self.embed(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1)
            if self.pos is not None:
                x = x + self.pos
            return self.head(self.norm(self.blocks(x))[:, 0])

    return PlainViT()


def torch_step(model_kw: dict, batch: int, encoder: str):
    """(no-argument call running one eager train step, parameter count) or None."""
    import torch

    torch.manual_seed(0)
    model = torch_model(model_kw, encoder)
    if model is None:
        return None
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images, labels = _batch(model_kw, batch)
    x = torch.from_numpy(np.asarray(images)).permute(0, 3, 1, 2).contiguous()
    y = torch.from_numpy(np.asarray(labels)).long()

    def call():
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return call, sum(p.numel() for p in model.parameters())


# --- ceiling ------------------------------------------------------------------------------


def matmul_ceiling(models: dict, repeats: int) -> dict:
    """The best GFLOP/s of float32 matmuls in XLA and torch at the models' shapes and 2048^3."""
    torch = common.maybe_torch()
    shapes = {(2048, 2048, 2048)}
    for model_kw, batch in models.values():
        d = _dims(model_kw)
        tokens = math.prod(s // d["patch"] for s in model_kw["image_shape"]) + 1
        m = batch * tokens
        shapes |= {(m, d["width"], d["mlp_dim"]), (m, d["mlp_dim"], d["width"])}
    out = []
    for m, k, n in sorted(shapes):
        rng = np.random.default_rng(0)
        a, b = rng.random((m, k), np.float32), rng.random((k, n), np.float32)
        xla = jax.jit(jnp.matmul)
        aj, bj = jnp.asarray(a), jnp.asarray(b)
        calls = {"xla": lambda xla=xla, aj=aj, bj=bj: xla(aj, bj)}
        if torch is not None:
            at, bt = torch.from_numpy(a), torch.from_numpy(b)
            calls["torch"] = lambda at=at, bt=bt: at @ bt
        times = common.timeit_interleaved(calls, max(repeats, 2))
        for lib, t in times.items():
            out.append({"shape": [m, k, n], "lib": lib, "gflops": 2 * m * k * n / t["min_s"] / 1e9})
    best = max(out, key=lambda r: r["gflops"])
    return {"matmuls": out, "ceiling_gflops": best["gflops"], "ceiling_from": best}


# --- run ----------------------------------------------------------------------------------


def timeit_alternating(fns: dict, repeats: int, pause: float = PAUSE_S) -> dict:
    """min and median seconds per call: warm-ups, then rounds calling each once (order rotated
    by one each round) with ``pause`` seconds of idle before every call."""
    for fn in fns.values():
        common.block(fn())
        common.block(fn())
    names = list(fns)
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            time.sleep(pause)
            start = time.perf_counter()
            common.block(fns[name]())
            times[name].append(time.perf_counter() - start)
    return {
        name: {"min_s": min(ts), "median_s": sorted(ts)[len(ts) // 2], "repeats": repeats}
        for name, ts in times.items()
    }


def run(quick: bool = False, encoders=tuple(ENCODERS)) -> dict:
    torch = common.maybe_torch()
    models = QUICK_MODELS if quick else MODELS
    repeats = 3 if quick else 6
    out = {"rows": [], "timm": maybe_timm() is not None, "pause_s": PAUSE_S}
    if torch is None:
        out["skipped"] = "torch is not installed (pip install -e '.[bench]')"
        print("  skipped:", out["skipped"])
        return out
    out["torch_threads"] = torch.get_num_threads()
    out.update(matmul_ceiling(models, repeats))
    print(f"  matmul ceiling {out['ceiling_gflops']:.1f} GFLOP/s ({out['ceiling_from']})")
    for name, (model_kw, batch) in models.items():
        for encoder in encoders:
            theirs = torch_step(model_kw, batch, encoder)
            if theirs is None:
                continue
            ours, flops, ours_params = ours_step(model_kw, batch, encoder)
            their_call, their_params = theirs
            times = timeit_alternating({"torch": their_call, "ours": ours}, repeats)
            row = {
                "model": name,
                "batch": batch,
                "encoder": encoder,
                "flops": flops,
                "params_ours": ours_params,
                "params_torch": their_params,
                "torch": times["torch"],
                "ours": times["ours"],
            }
            out["rows"].append(row)
            del their_call, ours
            print(
                f"  {name} {encoder}: torch {common.fmt_time(times['torch'])} ms, ours "
                f"{common.fmt_time(times['ours'])} ms",
                flush=True,
            )
    return out


def table(results: dict) -> None:
    if "skipped" in results:
        print("\n6. Train step vs PyTorch: skipped,", results["skipped"])
        return
    ceiling = results["ceiling_gflops"]
    rows = []
    for r in results["rows"]:
        ratio = common.ratio(r["torch"], r["ours"])
        goal = GOALS.get(r["encoder"])
        gf_ours = r["flops"] / r["ours"]["min_s"] / 1e9
        gf_torch = r["flops"] / r["torch"]["min_s"] / 1e9
        rows.append(
            [
                r["model"],
                r["encoder"],
                f"{r['params_torch']:,} / {r['params_ours']:,}",
                common.fmt_time(r["torch"]),
                common.fmt_time(r["ours"]),
                common.fmt_ratio(ratio),
                "-" if goal is None else ("yes" if ratio["min_s"] >= goal else "no"),
                f"{r['flops'] / 1e9:.1f}",
                f"{gf_torch:.1f} ({gf_torch / ceiling:.0%})",
                f"{gf_ours:.1f} ({gf_ours / ceiling:.0%})",
            ]
        )
    common.print_table(
        f"6. Train step vs PyTorch eager ({'timm' if results['timm'] else 'nn.Transformer'}), "
        f"batch 128; matmul ceiling {ceiling:.1f} GFLOP/s",
        [
            "model",
            "encoder",
            "params torch / ours",
            "torch ms min / med",
            "ours ms min / med",
            "torch / ours",
            ">= 1",
            "GFLOP/step",
            "torch GFLOP/s (of ceiling)",
            "ours GFLOP/s (of ceiling)",
        ],
        rows,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--encoders", default=",".join(ENCODERS))
    flags = parser.parse_args()
    table(run(flags.quick, tuple(flags.encoders.split(","))))
