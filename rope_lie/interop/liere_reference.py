"""The LieRE reference's ViT (github.com/StanfordMIMI/LieRE) into rope_lie's ViT, exactly.

The reference (Ostmeier et al., arXiv:2406.10322) trains ``RoPEViT`` (``models/rope_vit.py``,
on lucidrains' ``models/vit.py``) inside a Lightning module (``lightning_modules/
lightning_liere_image_classification.py``: ``self.model``, so its checkpoints'
``state_dict`` keys start with ``model.``). For ``model_architecture="liere"`` (and
``"rope_mixed"``, the same with ``generator_dim=2``):

- patches ``b c (h p1) (w p2) -> b (h w) (p1 p2 c)`` and ``nn.Linear`` (``to_patch_embedding``;
  rope_lie's ``patchify`` order), a class token, no absolute table (``enable_ape=False``; the
  ``pos_embedding`` parameter is zeroed and frozen by ``force_absolute_encodings=False``);
- pre-norm blocks: ``nn.LayerNorm`` (epsilon 1e-5), ``FlexibleAttention`` with ``to_qkv``
  without bias (``chunk(3)``, then ``b n (h d)``), head size ``dim_head = 64`` (asserted
  there), ``to_out`` = Linear (Identity when one head of the model width), ``FeedForward`` =
  Linear, exact ``nn.GELU``, Linear; no final norm before pooling: the class token's output
  goes through ``mlp_head`` = LayerNorm, Linear (a norm per token, so norm-then-pool is the
  same);
- ``LierePositionEncoder``: ``generator_raw_params`` of shape (A, L', N' K, b, b) (L' = depth
  with ``rotary_embedding_per_layer``, else 1; N' = heads with ``rotary_embedding_per_head``,
  else 1; K = 64 // b), generators ``U - U^T`` with U = ``triu(raw, 1) - 0.5`` (the 0.5 cancels
  in U - U^T: rope_lie's ``skew_from_upper``), positions ``linspace(0, n / n_train, n)`` per
  axis in row-major order (``PositionEncoderBase``: rope_lie's ``"sequential"``), R(p) =
  ``torch.matrix_exp(sum_a p_a G_a)``, the class token the identity, applied as R @ x to
  contiguous b-blocks of q and k (``apply_transforms``).

One deviation of the reference from its own intent is reproduced, not repaired: its
``Transformer.forward`` (``models/vit.py``) rebinds ``positional_transforms`` to layer 0's
slice inside the layer loop, so with ``rotary_embedding_per_layer`` every layer uses layer 0's
generators (layers 1..L-1 of ``generator_raw_params`` never reach the output and get no
gradient). ``layers="as_run"`` (the default) converts what the reference computes: one set of
generators shared by all layers (``share_pe_layers``), layer 0's, and reports the others as
unused; ``layers="as_stored"`` converts every layer's stored generators (per-layer LieRE as
the paper describes it; not the reference's logits).

Inputs: the reference normalises with mean (0.4914, 0.4822, 0.4465), std (0.2023, 0.1994,
0.2010) (``lightning_data_image.py``, CIFAR-100 and ImageNet alike) and takes NCHW; the
converted model takes the same values NHWC. 2D images only (the reference's 3D path is not
converted).

``liere_torch.reference_model`` re-implements that ViT in PyTorch, module for module with the
reference's parameter names (so its ``state_dict`` has the Lightning layout), for the
command's ``--checkpoint=none`` and for the tests. PyTorch is imported inside functions only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from rope_lie.interop import _torch_first

DIM_HEAD = 64  # FlexibleAttention asserts dim_head == 64
MEAN = (0.4914, 0.4822, 0.4465)  # lightning_data_image.py: transforms.Normalize
STD = (0.2023, 0.1994, 0.2010)
LAYERS = ("as_run", "as_stored")
PREFIX = "model."  # LightningModule attribute holding RoPEViT


@dataclasses.dataclass(frozen=True)
class ReferenceSpec:
    """The reference ``RoPEViT``'s constructor arguments that shape its weights (2D images)."""

    image_size: int  # px per side (square)
    patch_size: int  # px per patch side
    num_classes: int
    dim: int  # model width, = heads * 64
    depth: int
    heads: int
    mlp_dim: int
    generator_dim: int = 64  # LieRE block size b (64: dense; 2: the paper's RoPE-Mixed)
    per_layer: bool = False  # rotary_embedding_per_layer
    per_head: bool = False  # rotary_embedding_per_head
    channels: int = 3

    def __post_init__(self):
        if self.dim != self.heads * DIM_HEAD:
            raise ValueError(
                f"LieRE reference: dim={self.dim} must be heads * {DIM_HEAD} = "
                f"{self.heads * DIM_HEAD} (its FlexibleAttention has dim_head=64; the encoder "
                "uses dim // heads)"
            )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"LieRE reference: image_size={self.image_size} is not divisible by "
                f"patch_size={self.patch_size}"
            )
        if not 2 <= self.generator_dim <= DIM_HEAD:
            raise ValueError(f"generator_dim={self.generator_dim} must be in [2, {DIM_HEAD}]")


def parse_fields(text: str) -> dict[str, Any]:
    """``ReferenceSpec`` fields from ``"image_size=32,patch_size=8,per_head=1,..."``, typed."""
    fields = {f.name: f.type for f in dataclasses.fields(ReferenceSpec)}
    values: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        if key not in fields:
            raise ValueError(f"unknown LieRE reference field {key!r}; expected {sorted(fields)}")
        if fields[key] == "bool":
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{key}={value!r} must be true/false")
            values[key] = value.lower() in ("true", "1")
        else:
            values[key] = int(value)
    return values


def parse_spec(text: str) -> ReferenceSpec:
    """A ``ReferenceSpec`` from ``"image_size=32,patch_size=8,dim=128,..."`` (every field
    without a default given)."""
    try:
        return ReferenceSpec(**parse_fields(text))
    except TypeError as e:
        raise ValueError(f"LieRE reference spec {text!r}: {e}") from None


def load_state_dict(path: str) -> dict[str, np.ndarray]:
    """A Lightning checkpoint's (or a bare) ``state_dict`` as float32 numpy arrays, keys with
    the ``model.`` prefix. Read with ``torch.load(weights_only=True)``: no code is unpickled."""
    _torch_first.check()
    import torch

    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a pickle with objects torch's safe loader refuses
        raise ValueError(
            f"cannot read {path!r} with torch.load(weights_only=True) ({e}); save its "
            "state_dict alone (torch.save(ckpt['state_dict'], file)) and convert that"
        ) from e
    state = blob.get("state_dict", blob) if isinstance(blob, dict) else None
    if not isinstance(state, dict) or not state:
        raise ValueError(f"{path!r} holds no state_dict (a dict of tensors)")
    return {k: v.detach().float().numpy() for k, v in state.items()}


def infer_spec(state: dict[str, np.ndarray], channels: int = 3) -> ReferenceSpec:
    """The ``ReferenceSpec`` of a reference ``state_dict`` (square images, ``channels`` given)."""
    need = (
        "cls_token",
        "pos_embedding",
        "to_patch_embedding.1.weight",
        "mlp_head.1.weight",
        "position_encoder.generator_raw_params",
    )
    missing = [PREFIX + k for k in need if PREFIX + k not in state]
    if missing:
        raise ValueError(f"not a LieRE reference state_dict: missing keys {missing}")
    dim = state[PREFIX + "cls_token"].shape[-1]
    patch = math.isqrt(state[PREFIX + "to_patch_embedding.1.weight"].shape[1] // channels)
    side = math.isqrt(state[PREFIX + "pos_embedding"].shape[1] - 1) * patch
    raw = state[PREFIX + "position_encoder.generator_raw_params"]
    if raw.ndim != 5 or raw.shape[0] != 2:
        raise ValueError(f"generator_raw_params has shape {raw.shape}; expected (2, L', G, b, b)")
    depth = 1 + max(int(k.split(".")[3]) for k in state if k.startswith(PREFIX + "transformer."))
    heads = state[PREFIX + "transformer.layers.0.0.fn.to_qkv.weight"].shape[0] // (3 * DIM_HEAD)
    b = raw.shape[-1]
    return ReferenceSpec(
        image_size=side,
        patch_size=patch,
        num_classes=state[PREFIX + "mlp_head.1.weight"].shape[0],
        dim=dim,
        depth=depth,
        heads=heads,
        mlp_dim=state[PREFIX + "transformer.layers.0.1.fn.net.0.weight"].shape[0],
        generator_dim=b,
        per_layer=raw.shape[1] > 1,
        per_head=raw.shape[2] > DIM_HEAD // b,
        channels=channels,
    )


def model_config(spec: ReferenceSpec, layers: str = "as_run") -> dict[str, Any]:
    """``config.model`` (ViT keyword arguments) holding the reference ViT of ``spec``."""
    if layers not in LAYERS:
        raise ValueError(f"layers={layers!r}; expected one of {LAYERS}")
    return dict(
        variant=None,  # dims below, not a named variant
        dims=dict(width=spec.dim, depth=spec.depth, num_heads=spec.heads, mlp_dim=spec.mlp_dim),
        patch_size=spec.patch_size,
        image_shape=(spec.image_size, spec.image_size),
        channels=spec.channels,
        num_classes=spec.num_classes,
        pool="cls",
        dropout=0.1,  # the reference trains with 0.1 (RoPEViT's dropout and emb_dropout)
        pe="liere",
        pe_hparams=dict(block_size=spec.generator_dim),
        additive="none",
        additive_hparams={},
        additive_prefix=True,
        position_convention="sequential",
        share_pe_heads=not spec.per_head,
        share_pe_layers=not spec.per_layer or layers == "as_run",
        head_zero_init=False,
        layer_scale=None,
        gelu_approximate=False,
        norm_eps=1e-5,  # torch.nn.LayerNorm
        qkv_bias=False,
        dtype="float32",
    )


def _take(state: dict[str, np.ndarray], key: str) -> np.ndarray:
    if PREFIX + key not in state:
        raise ValueError(f"LieRE reference state_dict has no key {PREFIX + key!r}")
    return state.pop(PREFIX + key)


def _linear(state, key: str) -> dict[str, np.ndarray]:
    return {"kernel": _take(state, key + ".weight").T, "bias": _take(state, key + ".bias")}


def _norm(state, key: str) -> dict[str, np.ndarray]:
    return {"scale": _take(state, key + ".weight"), "bias": _take(state, key + ".bias")}


def _attention(state, key: str, spec: ReferenceSpec) -> dict[str, np.ndarray]:
    w = _take(state, key + ".to_qkv.weight")  # (3 N H, D): chunk(3), then "(h d)"
    w_3DNH = w.reshape(3, spec.heads, DIM_HEAD, spec.dim).transpose(0, 3, 1, 2)
    out = {"wq_DNH": w_3DNH[0], "wk_DNH": w_3DNH[1], "wv_DNH": w_3DNH[2]}
    if PREFIX + key + ".to_out.0.weight" in state:
        proj = _linear(state, key + ".to_out.0")
        out["wo_NHD"] = proj["kernel"].reshape(spec.heads, DIM_HEAD, spec.dim)
        out["bo_D"] = proj["bias"]
    else:  # to_out = Identity (one head of the model width)
        out["wo_NHD"] = np.eye(spec.dim, dtype=np.float32).reshape(1, DIM_HEAD, spec.dim)
        out["bo_D"] = np.zeros(spec.dim, np.float32)
    return out


def convert_state_dict(
    state: dict[str, np.ndarray], spec: ReferenceSpec, layers: str = "as_run"
) -> tuple[dict[str, Any], list[str]]:
    """rope_lie ViT parameters of a reference ``state_dict`` (keys ``model.*``), and notes.

    Every tensor is used or named in the notes (the zero ``pos_embedding``; with ``as_run``, the
    generators of layers 1..L-1 that the reference never uses); a key left over is an error.
    """
    model_config(spec, layers)  # validates layers
    state = dict(state)
    notes = []
    pos = _take(state, "pos_embedding")
    if np.any(pos != 0):
        raise ValueError(
            "pos_embedding is not zero: a checkpoint with an absolute table "
            "(force_absolute_encodings) is not the reference's LieRE layout"
        )
    notes.append("pos_embedding: zero and unused by the reference (enable_ape=False)")
    w = _take(state, "to_patch_embedding.1.weight")  # (D, p p C), (p1 p2 c) = patchify order
    params: dict[str, Any] = {
        "embed": {"kernel": w.T, "bias": _take(state, "to_patch_embedding.1.bias")},
        "cls_1D": _take(state, "cls_token").reshape(1, -1),
        "norm": _norm(state, "mlp_head.0"),
        "head": _linear(state, "mlp_head.1"),
        "blocks": {},
    }
    raw = _take(state, "position_encoder.generator_raw_params")  # (A, L', N' K, b, b)
    b = spec.generator_dim
    raw_ALNKbb = raw.reshape(raw.shape[0], raw.shape[1], -1, DIM_HEAD // b, b, b)
    per_layer = spec.per_layer and layers == "as_stored"
    if not per_layer:
        params["pe_params"] = {"gen_ANKbb": raw_ALNKbb[:, 0]}
        if spec.per_layer:
            notes.append(
                f"generator_raw_params layers 1..{spec.depth - 1}: never used by the reference's "
                "forward (models/vit.py Transformer.forward reuses layer 0's); not converted"
            )
    for i in range(spec.depth):
        p = f"transformer.layers.{i}"
        block = {
            "ln1": _norm(state, f"{p}.0.norm"),
            "attn": _attention(state, f"{p}.0.fn", spec),
            "ln2": _norm(state, f"{p}.1.norm"),
            "mlp": {
                "fc1": _linear(state, f"{p}.1.fn.net.0"),
                "fc2": _linear(state, f"{p}.1.fn.net.3"),
            },
        }
        if per_layer:
            block["attn"]["pe_params"] = {"gen_ANKbb": raw_ALNKbb[:, i]}
        params["blocks"][i] = block
    if state:
        raise ValueError(f"LieRE reference state_dict keys not converted: {sorted(state)}")
    return params, notes
