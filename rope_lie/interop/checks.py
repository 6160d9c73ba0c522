"""Helpers for checking a conversion against PyTorch (tests/test_interop.py, the sweep in
experiments/interop_sweep.py); torch is imported only when called."""

from __future__ import annotations


def scale_weights(model, seed: int, attention_gain: float = 1.0, embed_gain: float = 1.0) -> None:
    """Weights where every part moves the logits, in place: LayerScale gains ~1 (timm's 1e-5
    would hide the blocks), biases, an APE table, class and register tokens N(0, 0.25), and a
    unit head (timm's 1e-3 head, or the LieRE reference's, would leave logits near zero, where
    any two models agree).

    ``attention_gain`` multiplies a timm model's fused q/k/v weights and ``embed_gain`` its patch
    embedding: with timm's N(0, 0.02) weights the attention is near uniform, so that positions
    (hence a wrong rotation) move the logits by ~1e-3 only; gains of 8 and 4 make that ~1.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gamma_1", "gamma_2")):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif name.endswith("bias") or name in ("pos_embed", "cls_token", "reg_token"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name in ("head.weight", "model.mlp_head.1.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            if name.endswith("attn.qkv.weight"):
                p.mul_(attention_gain)
            elif name == "patch_embed.proj.weight":
                p.mul_(embed_gain)
