"""Resolution sweep of converted timm RoPE ViT-S/16s: rope_lie against timm, same images.

    python -m experiments.interop_sweep [--sides=224,320,384,448] [--json=OUT.json] \
        [--models=vit_small_patch16_rope_mixed_224 --checkpoint=model.safetensors]

For each of ``vit_small_patch16_rope_224`` (RoPE-Axial) and ``vit_small_patch16_rope_mixed_224``
(RoPE-Mixed), timm's randomly initialised model (no weights can be downloaded on this
project's machine: ``--checkpoint`` a ``.safetensors`` file where they can) is converted with
``rope_lie.interop`` and both run, in float32 on CPU, on the same 4 images (uniform noise in
[0, 255], normalised with ImageNet's mean and std) at each side, each changing resolution its
own way (timm's ``dynamic_img_size``). timm's initialisation leaves a random model nearly
silent (LayerScale 1e-5, a 1e-3-scaled head: logits ~1e-3, every block ~1e-5 of the
residual), so by default the weights are first rescaled as in tests/interop_torch_side.py
(LayerScale gains U[0.5, 1.5), biases and class token N(0, 0.25), head N(0, 1): logits O(1-10),
every block counts); ``--timm_init`` keeps timm's. Reported: the largest |logit difference|,
the logits' scale, the largest difference of the class-token features that enter the head,
and how many argmaxes agree. Needs the interop extra.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from rope_lie.interop import checks, timm_eva, workdir

MODELS = ("vit_small_patch16_rope_224", "vit_small_patch16_rope_mixed_224")


def sweep(name: str, sides, checkpoint: str | None, scale: bool, seed: int = 0) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    torch.manual_seed(seed)
    model = timm_eva.create(name, checkpoint, dynamic_img_size=True)
    if scale:
        checks.scale_weights(model, seed)
    vit = workdir.build(timm_eva.model_config(model), timm_eva.convert_params(model))
    features = []
    model.head.register_forward_hook(lambda module, args, output: features.append(args[0]))
    graphdef, state = nnx.split(vit)

    @jax.jit
    def logits_and_features(state, images):
        m = nnx.merge(graphdef, state)
        grid = m.input_grid(images)
        x = m.embed_tokens(images, grid)
        for block, pe in zip(m.blocks, m.precompute_pe(grid), strict=True):
            x = block(x, pe, train=False)
        cls = m.norm(x)[:, 0]
        return m.head(cls), cls

    rows = []
    mean, std = np.array(timm_eva.IMAGENET_MEAN), np.array(timm_eva.IMAGENET_STD)
    for side in sides:
        pixels = np.random.RandomState(side).uniform(0, 255, (4, side, side, 3))
        images = ((pixels / 255 - mean) / std).astype(np.float32)
        with torch.no_grad():
            expected = model(torch.from_numpy(images.transpose(0, 3, 1, 2))).numpy()
        got, got_features = (np.asarray(a) for a in logits_and_features(state, jnp.asarray(images)))
        rows.append(
            dict(
                model=name,
                side=side,
                tokens=(side // 16) ** 2,
                max_logit_diff=float(np.abs(got - expected).max()),
                logit_scale=float(np.abs(expected).max()),
                max_feature_diff=float(np.abs(got_features - features.pop().numpy()).max()),
                argmax_agree=int((got.argmax(-1) == expected.argmax(-1)).sum()),
            )
        )
    return rows


def main() -> None:
    import torch  # noqa: F401  (before anything imports TensorFlow: interop/_torch_first.py)

    parser = argparse.ArgumentParser()
    parser.add_argument("--sides", default="224,320,384,448")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--checkpoint", default=None, help="weights of the one model in --models")
    parser.add_argument("--json", default=None)
    parser.add_argument("--timm_init", action="store_true", help="keep timm's random weights")
    args = parser.parse_args()
    sides = [int(s) for s in args.sides.split(",")]
    models = args.models.split(",")
    if args.checkpoint and len(models) != 1:
        raise ValueError(f"--checkpoint needs exactly one model in --models, got {models}")
    scale = not args.timm_init and args.checkpoint is None
    rows = [r for name in models for r in sweep(name, sides, args.checkpoint, scale)]
    print(
        "model                              side  tokens  max|dlogit|  |logit|  "
        "max|dfeature|  argmax agree"
    )
    for r in rows:
        print(
            f"{r['model']:<34} {r['side']:>4}  {r['tokens']:>6}  {r['max_logit_diff']:>11.2e}"
            f"  {r['logit_scale']:>7.2e}  {r['max_feature_diff']:>13.2e}  "
            f"{r['argmax_agree']}/4"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
