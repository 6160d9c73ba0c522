"""Pretrained PyTorch models into rope_lie: timm's RoPE and DINOv3 ViTs and the LieRE reference.

    python -m rope_lie.convert --from=timm --model=vit_small_patch16_rope_mixed_224 \
        --checkpoint=<file or none> --workdir=DIR
    model, config = rope_lie.interop.load(DIR)   # NNX ViT with the weights, and its config

- ``timm_eva``: timm ``Eva`` RoPE-Axial / RoPE-Mixed / +APE models (Heo et al.) and DINOv3
  (Siméoni et al.; a class token and 4 registers) -> ViT;
- ``liere_reference``: the LieRE reference's ViT and Lightning ``state_dict`` layout
  (Ostmeier et al., github.com/StanfordMIMI/LieRE) -> ViT, and a PyTorch re-implementation
  of that ViT (for checkpoints written by the reference layout and for the tests);
- ``workdir``: the converted model on disk (an Orbax checkpoint that ``config.init_from``
  reads and a config that ``rope_lie.main`` takes) and ``load``.

PyTorch and timm (the ``interop`` extra) are imported inside functions only, when a
conversion runs: ``import rope_lie`` and ``load`` do not need them.
"""

from rope_lie.interop.workdir import load

__all__ = ["load"]
