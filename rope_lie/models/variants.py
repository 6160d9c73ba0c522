"""Named ViT sizes (``VARIANTS``) and explicit dimensions (``model_dims``) for ``vit.ViT``."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence

# width D, depth L, heads N, MLP hidden size. Ti/S/B/L as in ViT and DeiT.
VARIANTS: dict[str, dict[str, int]] = {
    "pico": dict(width=32, depth=2, num_heads=2, mlp_dim=64),  # unit tests and smoke runs
    "mu": dict(width=64, depth=4, num_heads=4, mlp_dim=128),  # CPU quickstart, H = 16
    # The sparse Cayley-STRING study's small ViT (H = 12): 0.116-0.118 M parameters at
    # 32x32x3, patch 4, 10 classes, depending on the generator (see tests/models/test_vit.py).
    "string": dict(width=48, depth=4, num_heads=4, mlp_dim=192),
    "Ti": dict(width=192, depth=12, num_heads=3, mlp_dim=768),
    "S": dict(width=384, depth=12, num_heads=6, mlp_dim=1536),
    "B": dict(width=768, depth=12, num_heads=12, mlp_dim=3072),
    "L": dict(width=1024, depth=24, num_heads=16, mlp_dim=4096),
}
DIM_KEYS = ("width", "depth", "num_heads", "mlp_dim")


def parse_variant(
    variant: str, patch_size: int | Sequence[int] | None, rank: int
) -> tuple[dict[str, int], tuple[int, ...]]:
    """Model dimensions and patch size from ``"Ti/16"``-style names.

    Args:
      variant: a key of ``VARIANTS``, optionally followed by ``/p`` (the patch size).
      patch_size: int or tuple of length ``rank``; wins over the variant's ``/p`` (which must
        then agree with its last entry).
      rank: spatial rank of the input (2 for images, 3 for volumes).

    Returns:
      (dims, patch): the variant's dimensions and the patch size per spatial axis.
    """
    name, _, patch_str = str(variant).partition("/")
    if name not in VARIANTS:
        raise ValueError(f"unknown variant={variant!r}; expected one of {sorted(VARIANTS)}")
    if patch_str and not patch_str.isdigit():
        raise ValueError(f"variant={variant!r}: the patch size after '/' must be an integer")
    variant_patch = int(patch_str) if patch_str else None
    if patch_size is None:
        if variant_patch is None:
            raise ValueError(f"variant={variant!r} has no '/patch' and patch_size is None")
        patch_size = variant_patch
    patch = (patch_size,) * rank if isinstance(patch_size, numbers.Integral) else tuple(patch_size)
    if len(patch) != rank or any(not isinstance(p, numbers.Integral) or p < 1 for p in patch):
        raise ValueError(
            f"patch_size={patch_size!r} must be a positive int or {rank} positive ints "
            f"(one per spatial axis of image_shape)"
        )
    if variant_patch is not None and variant_patch != patch[-1]:
        raise ValueError(f"variant={variant!r} and patch_size={patch_size!r} disagree")
    return dict(VARIANTS[name]), tuple(int(p) for p in patch)


def model_dims(
    variant: str | None,
    dims: Mapping[str, int] | None,
    patch_size: int | Sequence[int] | None,
    rank: int,
) -> tuple[dict[str, int], tuple[int, ...]]:
    """``parse_variant``, with ``dims`` entries overriding the variant's (all four without one).

    Args:
      variant: ``VARIANTS`` key with optional ``/p``, or None (then ``dims`` gives every entry
        of ``DIM_KEYS`` and ``patch_size`` the patch).
      dims: None or a mapping from some of ``DIM_KEYS`` to positive ints (or None: the
        variant's).
      patch_size: as in ``parse_variant``.
      rank: spatial rank of the input.

    Returns:
      (dims, patch).
    """
    dims = {k: v for k, v in dict(dims or {}).items() if v is not None}  # None: the variant's
    unknown = sorted(set(dims) - set(DIM_KEYS))
    if unknown:
        raise ValueError(f"dims has unknown keys {unknown}; expected some of {list(DIM_KEYS)}")
    for key, value in dims.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"dims[{key!r}]={value!r} must be a positive int")
    if variant is None:
        missing = [k for k in DIM_KEYS if k not in dims]
        if missing or patch_size is None:
            raise ValueError(
                f"variant=None needs dims with every key of {list(DIM_KEYS)} (missing {missing}) "
                f"and a patch_size (got {patch_size!r})"
            )
        _, patch = parse_variant("Ti", patch_size, rank)  # the patch alone: any name would do
        return {k: int(v) for k, v in dims.items()}, patch
    base, patch = parse_variant(variant, patch_size, rank)
    return {**base, **{k: int(v) for k, v in dims.items()}}, patch
