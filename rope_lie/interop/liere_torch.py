"""The LieRE reference's ViT (github.com/StanfordMIMI/LieRE) re-implemented in PyTorch, module for
module with the reference's ``state_dict`` layout (its Lightning checkpoints): what
``rope_lie.convert --from=liere --checkpoint=none`` converts and what the interop tests compare
against. The conversion itself is ``liere_reference.py``.
"""

from __future__ import annotations

import functools
import math

from rope_lie.interop import _torch_first
from rope_lie.interop.liere_reference import DIM_HEAD, ReferenceSpec


@functools.cache
def _torch_modules():
    """The reference's modules (``models/vit.py``, ``models/rope_vit.py``), for ``spec``."""
    import torch
    from torch import nn

    class Patchify(nn.Module):
        """einops ``Rearrange("b c (h p1) (w p2) -> b (h w) (p1 p2 c)")``."""

        def __init__(self, p):
            super().__init__()
            self.p = p

        def forward(self, x):
            b, c, h, w = x.shape
            p = self.p
            x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
            return x.reshape(b, (h // p) * (w // p), p * p * c)

    class PreNorm(nn.Module):
        def __init__(self, dim, fn):
            super().__init__()
            self.norm, self.fn = nn.LayerNorm(dim), fn

        def forward(self, x, **kwargs):
            return self.fn(self.norm(x), **kwargs)

    class FeedForward(nn.Module):
        def __init__(self, dim, hidden_dim, dropout):
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(dim, hidden_dim),
                nn.GELU(),
                nn.Dropout(dropout),
                nn.Linear(hidden_dim, dim),
                nn.Dropout(dropout),
            )

        def forward(self, x):
            return self.net(x)

    class FlexibleAttention(nn.Module):
        def __init__(self, dim, heads, dropout, per_head):
            super().__init__()
            inner = DIM_HEAD * heads
            self.heads, self.scale = heads, DIM_HEAD**-0.5
            self.to_qkv = nn.Linear(dim, inner * 3, bias=False)
            project_out = not (heads == 1 and DIM_HEAD == dim)
            self.to_out = (
                nn.Sequential(nn.Linear(inner, dim), nn.Dropout(dropout))
                if project_out
                else nn.Identity()
            )
            self.rot_heads = heads if per_head else 1

        def apply_transforms(self, x, transforms):
            b_dim = transforms.shape[-1]
            batch, heads, tokens, _ = x.shape
            rotators = transforms.shape[-3] // self.rot_heads
            rot = b_dim * rotators
            states = x[..., :rot].reshape(batch, heads, tokens, rotators, b_dim, 1)
            t = transforms.squeeze(2).view(1, tokens, self.rot_heads, rotators, b_dim, b_dim)
            rotated = torch.matmul(t.transpose(1, 2), states)
            return torch.cat([rotated.flatten(start_dim=-3), x[..., rot:]], dim=-1)

        def forward(self, x, positional_transforms=None):
            q, k, v = self.to_qkv(x).chunk(3, dim=-1)
            q, k, v = (t.reshape(*t.shape[:2], self.heads, -1).transpose(1, 2) for t in (q, k, v))
            if positional_transforms is not None:
                q = self.apply_transforms(q, positional_transforms)
                k = self.apply_transforms(k, positional_transforms)
            attn = (torch.matmul(q, k.transpose(-1, -2)) * self.scale).softmax(dim=-1)
            out = torch.matmul(attn, v).transpose(1, 2).flatten(2)
            return self.to_out(out)

    class Transformer(nn.Module):
        def __init__(self, spec, dropout):
            super().__init__()
            self.layers = nn.ModuleList(
                nn.ModuleList(
                    [
                        PreNorm(
                            spec.dim,
                            FlexibleAttention(spec.dim, spec.heads, dropout, spec.per_head),
                        ),
                        PreNorm(spec.dim, FeedForward(spec.dim, spec.mlp_dim, dropout)),
                    ]
                )
                for _ in range(spec.depth)
            )

        def forward(self, x, positional_transforms=None):
            for i, (attn, ff) in enumerate(self.layers):
                if positional_transforms.shape[2] > 1:
                    # The reference rebinds the variable here (models/vit.py), so layers >= 1
                    # reuse layer 0's slice: reproduced on purpose (see the module docstring).
                    positional_transforms = positional_transforms[:, :, i, ...].unsqueeze(2)
                x = attn(x, positional_transforms=positional_transforms) + x
                x = ff(x) + x
            return x

    class LierePositionEncoder(nn.Module):
        def __init__(self, spec):
            super().__init__()
            self.expected = (spec.image_size // spec.patch_size,) * 2
            self.patch = spec.patch_size
            generators = (spec.dim // spec.heads // spec.generator_dim) * (
                spec.heads if spec.per_head else 1
            )
            shape = (
                2,
                spec.depth if spec.per_layer else 1,
                generators,
                spec.generator_dim,
                spec.generator_dim,
            )
            self.generator_raw_params = nn.Parameter(torch.rand(*shape) * 2 * math.pi)

        def positions(self, image_size):
            steps = [math.ceil(s / self.patch) for s in image_size]
            scales = [n / e for n, e in zip(steps, self.expected, strict=True)]
            axes = [torch.linspace(0, s, n) for s, n in zip(scales, steps, strict=True)]
            return torch.cartesian_prod(*axes).unsqueeze(0)

        def forward(self, image_size):
            positions = self.positions(image_size)  # (1, T, A)
            upper = torch.triu(self.generator_raw_params, diagonal=1) - 0.5
            bases = upper - upper.transpose(-1, -2)  # (A, L', G, b, b)
            generator_pos = (positions.reshape(*positions.shape, 1, 1, 1, 1) * bases).sum(dim=-5)
            cls = torch.zeros_like(generator_pos[:, :1])
            generator_pos = torch.cat((cls, generator_pos), dim=1)  # class token: identity
            return torch.cat(
                [
                    torch.matrix_exp(generator_pos[:, :, i : i + 1].contiguous())
                    for i in range(generator_pos.shape[2])
                ],
                dim=2,
            )

    class RoPEViT(nn.Module):
        def __init__(self, spec, dropout):
            super().__init__()
            patch_dim = spec.channels * spec.patch_size**2
            num_patches = (spec.image_size // spec.patch_size) ** 2
            self.to_patch_embedding = nn.Sequential(
                Patchify(spec.patch_size), nn.Linear(patch_dim, spec.dim)
            )
            pos = torch.zeros(1, num_patches + 1, spec.dim)  # zeroed, frozen, unused (no APE)
            self.pos_embedding = nn.Parameter(pos, requires_grad=False)
            self.cls_token = nn.Parameter(torch.randn(1, 1, spec.dim))
            self.dropout = nn.Dropout(dropout)
            self.transformer = Transformer(spec, dropout)
            self.mlp_head = nn.Sequential(
                nn.LayerNorm(spec.dim), nn.Linear(spec.dim, spec.num_classes)
            )
            self.position_encoder = LierePositionEncoder(spec)

        def forward(self, img):
            transforms = self.position_encoder(img.shape[2:])
            x = self.to_patch_embedding(img)
            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
            x = self.transformer(self.dropout(x), positional_transforms=transforms)
            return self.mlp_head(x[:, 0])

    class Lightning(nn.Module):
        """``LiereImageClassification``'s parameters: the ViT as ``self.model``."""

        def __init__(self, spec, dropout):
            super().__init__()
            self.model = RoPEViT(spec, dropout)

        def forward(self, img):
            return self.model(img)

    return Lightning


def reference_model(spec: ReferenceSpec, seed: int = 0, dropout: float = 0.1):
    """The reference ViT of ``spec`` in PyTorch, randomly initialised as the reference does
    (``torch.manual_seed(seed)``), in eval mode; ``state_dict()`` has the Lightning layout."""
    _torch_first.check()
    import torch

    torch.manual_seed(seed)
    return _torch_modules()(spec, dropout).eval()
