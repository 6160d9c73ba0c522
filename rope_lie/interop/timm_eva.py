"""timm's naver RoPE ViTs (``timm/models/eva.py``, timm >= 1.0.20) into rope_lie's ViT, exactly.

The RoPE-ViTs of Heo et al. ("Rotary Position Embedding for Vision Transformer",
arXiv:2403.13298, github.com/naver-ai/rope-vit) are in timm as ``Eva`` models
(``vit_{small,base,large}_patch16_rope{,_mixed}{,_ape}_224``, tag ``.naver_in1k``): pre-LN
blocks with LayerScale (``init_values=1e-5``), fused q/k/v with biases (``AttentionRope``),
exact GELU, ``LayerNorm`` with epsilon 1e-6, a final norm, the class token's output
(``global_pool="token"``), and a rotary encoding:

- RoPE-Axial (``RotaryEmbeddingCat``, ``temperature=100``, ``in_pixels=False``): pair j of the
  first H/4 turns by ``t_0 * 100^(-4j/H)``, pair H/4 + j by ``t_1 * 100^(-4j/H)``
  (``freq_bands`` and ``build_rotary_pos_embed`` in ``timm/layers/pos_embed_sincos.py``), with
  integer patch coordinates t and, for ``grid_indexing="xy"``, t_0 the column. rope_lie's
  ``rope_axial`` with base 100 is the same table with axis 0 = the row, so for ``"xy"`` the
  converter swaps the two halves of every head's q and k channels (weights and biases). q.k
  is a sum over channels, so permuting the channels of q and k alike leaves every attention
  logit as it is; v is not touched;
- RoPE-Mixed (``RotaryEmbeddingMixed``): learned ``freqs`` (2, L, N, H/2), angle of pair j of
  head n in layer l = ``t_x freqs[0, l, n, j] + t_y freqs[1, l, n, j]`` (``get_mixed_freqs``):
  rope_lie's ``rope_mixed`` per layer and head with ``freqs_ANF = (freqs[row], freqs[col])``;
- ``_ape`` variants: a learned ``pos_embed`` over the patch grid only (``no_embed_class=True``),
  resized with ``F.interpolate(bicubic, antialias=True)`` (``resample_abs_pos_embed``), which
  ``jax.image.resize(cubic, antialias=True)`` matches (``ape.table``): rope_lie's ``ape`` with
  ``additive_prefix=False``.

Both apply the rotation with interleaved pairs (``apply_rot_embed_cat``, ``half=False``) to
every token but the class token (``num_prefix_tokens=1``); rope_lie puts the class token at
position 0, whose rotation is the identity, and the patch coordinates start at 0 in both. At
another resolution timm (``dynamic_img_size=True``) recomputes the coordinates with
``arange`` (``position_convention="integer"`` here) and resizes ``pos_embed``; so does
rope_lie.

Inputs: timm takes NCHW images normalised with ``IMAGENET_DEFAULT_MEAN``/``STD`` (the
``naver_in1k`` pretrained config); the converted model takes the same values NHWC.

Anything else in a timm model (registers, fc_norm, attention pooling, qk-norm, SwiGLU, patch
dropout, coordinate augmentation, ...) is an error naming it, never approximated. PyTorch and
timm are imported only inside functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rope_lie.interop import _torch_first

SIZES = ("small", "base", "large")
KINDS = ("rope", "rope_mixed", "rope_ape", "rope_mixed_ape")
SUPPORTED = tuple(f"vit_{size}_patch16_{kind}_224" for size in SIZES for kind in KINDS)
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # timm.data.IMAGENET_DEFAULT_MEAN
IMAGENET_STD = (0.229, 0.224, 0.225)  # timm.data.IMAGENET_DEFAULT_STD


def check_name(name: str) -> str:
    """The timm architecture of ``name`` (a pretrained tag such as ``.naver_in1k`` dropped)."""
    arch = name.split(".")[0]
    if arch not in SUPPORTED:
        raise ValueError(f"timm model {name!r} is not supported; expected one of {SUPPORTED}")
    return arch


def create(name: str, checkpoint: str | None = None, **overrides: Any):
    """The timm model ``name`` built with ``overrides`` (e.g. a small ``embed_dim`` for tests),
    with the weights of ``checkpoint`` (a timm-layout ``state_dict`` file, ``.safetensors`` or
    ``.pth``; strict) or, without one, timm's random initialisation. Returns it in eval mode.

    The class count is read from the checkpoint's ``head.weight`` (a fine-tuned model's head
    has its own), as ``--from=liere`` reads the architecture; ``overrides`` may repeat it.
    """
    _torch_first.check()
    import timm
    import timm.models

    state = None
    if checkpoint is not None:
        state = timm.models.load_state_dict(checkpoint, weights_only=True)
        overrides = {**overrides, **_head_of(state, overrides, checkpoint)}
    model = timm.create_model(check_name(name), pretrained=False, **overrides)
    if state is not None:
        wanted = model.state_dict()
        missing, unexpected = _key_differences(wanted, state)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {checkpoint!r} does not fit timm's {name!r}: missing keys "
                f"{missing}, unexpected keys {unexpected}"
            )
        shapes = {k: (tuple(v.shape), tuple(wanted[k].shape)) for k, v in state.items()}
        differ = {k: given_model for k, given_model in shapes.items() if len(set(given_model)) > 1}
        if differ:
            raise ValueError(
                f"checkpoint {checkpoint!r} does not fit timm's {name!r} with overrides "
                f"{overrides}: tensor shapes (checkpoint, model) {differ}; pass the "
                "architecture's size with --overrides (e.g. embed_dim=, depth=, num_heads=)"
            )
        model.load_state_dict(state, strict=True)
    return model.eval()


def _head_of(state: Mapping[str, Any], overrides: Mapping[str, Any], checkpoint: str) -> dict:
    """``{"num_classes": n}`` from the checkpoint's classifier (empty without ``head.weight``);
    a different ``num_classes`` in ``overrides`` is an error."""
    if "head.weight" not in state:
        return {}
    num_classes = int(state["head.weight"].shape[0])
    given = overrides.get("num_classes", num_classes)
    if given != num_classes:
        raise ValueError(
            f"num_classes={given!r} (--overrides) but checkpoint {checkpoint!r} has a head of "
            f"{num_classes} classes (head.weight {tuple(state['head.weight'].shape)})"
        )
    return {"num_classes": num_classes}


def _key_differences(wanted: Mapping[str, Any], given: Mapping[str, Any]):
    return sorted(set(wanted) - set(given)), sorted(set(given) - set(wanted))


def _require(ok: bool, what: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"timm model: {what}={value!r}, expected {expected} (rope_lie.interop)")


def _check_rope(rope) -> tuple[str, bool]:
    """(rope_lie family, whether timm's coordinate 0 is the column) of a timm rope module."""
    from timm.layers import pos_embed_sincos as pes

    _require(not rope.aug_active, "rope coordinate augmentation", rope.aug_active, "off")
    _require(rope.grid_indexing in ("xy", "ij"), "rope.grid_indexing", rope.grid_indexing,
             "'xy' or 'ij'")  # fmt: skip
    if type(rope) is pes.RotaryEmbeddingMixed:
        return "rope_mixed", rope.grid_indexing == "xy"
    _require(type(rope) is pes.RotaryEmbeddingCat, "rope", type(rope).__name__,
             "RotaryEmbeddingCat or RotaryEmbeddingMixed")  # fmt: skip
    for attr, expected in (("in_pixels", False), ("grid_type", "index"), ("ref_feat_shape", None),
                           ("grid_offset", 0.0), ("rotate_half", False)):  # fmt: skip
        _require(getattr(rope, attr) == expected, f"rope.{attr}", getattr(rope, attr),
                 repr(expected))  # fmt: skip
    return "rope_axial", rope.grid_indexing == "xy"


def _check_block(block, norm_eps: float) -> None:
    from timm.layers import AttentionRope, LayerNorm, Mlp
    from timm.models.eva import EvaBlock
    from torch import nn

    _require(type(block) is EvaBlock, "block", type(block).__name__, "EvaBlock (pre-norm)")
    attn = block.attn
    _require(type(attn) is AttentionRope, "block.attn", type(attn).__name__, "AttentionRope")
    _require(attn.qkv is not None, "attn.qkv", None, "a fused qkv Linear")
    _require(attn.qkv.bias is not None, "attn.qkv.bias", None, "present (qkv_bias=True)")
    for name in ("q_norm", "k_norm", "norm"):
        module = getattr(attn, name)
        _require(isinstance(module, nn.Identity), f"attn.{name}", type(module).__name__, "Identity")
    _require(attn.gate is None and attn.num_kv_groups == 1, "attn gate / kv groups",
             (attn.gate, attn.num_kv_groups), "(None, 1)")  # fmt: skip
    _require(attn.head_dim * attn.num_heads == attn.proj.in_features, "attn_head_dim",
             attn.head_dim, "dim // num_heads")  # fmt: skip
    _require(type(block.mlp) is Mlp, "block.mlp", type(block.mlp).__name__, "Mlp (no SwiGLU)")
    act = block.mlp.act
    _require(type(act) is nn.GELU and act.approximate == "none", "mlp.act", act, "nn.GELU()")
    _require(isinstance(block.mlp.norm, nn.Identity), "mlp.norm", block.mlp.norm, "Identity")
    for name in ("norm1", "norm2"):
        norm = getattr(block, name)
        _require(type(norm) is LayerNorm and norm.eps == norm_eps, f"block.{name}",
                 norm, f"timm LayerNorm with eps={norm_eps}")  # fmt: skip
    _require((block.gamma_1 is None) == (block.gamma_2 is None), "LayerScale gamma_1/gamma_2",
             (block.gamma_1 is None, block.gamma_2 is None), "both or neither")  # fmt: skip


def model_config(model) -> dict[str, Any]:
    """``config.model`` (ViT keyword arguments) of a supported timm ``Eva`` model.

    Raises ValueError naming the first attribute rope_lie's ViT cannot hold exactly.
    """
    from timm.layers import LayerNorm
    from timm.models.eva import Eva
    from torch import nn

    _require(type(model) is Eva, "model", type(model).__name__, "timm.models.eva.Eva")
    _require(model.cls_token is not None and model.reg_token is None, "prefix tokens",
             model.num_prefix_tokens, "one class token, no registers")  # fmt: skip
    _require(model.global_pool == "token", "global_pool", model.global_pool, "'token'")
    for name in ("fc_norm", "norm_pre", "head_drop"):
        module = getattr(model, name)
        ok = isinstance(module, nn.Identity) or (name == "head_drop" and module.p == 0)
        _require(ok, name, module, "Identity")
    _require(model.attn_pool is None and model.patch_drop is None, "attn_pool/patch_drop",
             (model.attn_pool, model.patch_drop), "None")  # fmt: skip
    _require(type(model.norm) is LayerNorm, "norm", model.norm, "timm LayerNorm")
    _require(model.rope is not None, "rope", None, "a rotary embedding (use_rot_pos_emb)")
    pe, _ = _check_rope(model.rope)
    embed = model.patch_embed
    kernel, stride = tuple(embed.proj.kernel_size), tuple(embed.proj.stride)
    conv_ok = kernel == stride and embed.proj.bias is not None and not embed.dynamic_img_pad
    _require(conv_ok, "patch_embed", (kernel, stride), "a biased conv, stride = kernel, no pad")
    _require(isinstance(embed.norm, nn.Identity), "patch_embed.norm", embed.norm, "Identity")
    norm_eps = float(model.norm.eps)
    for block in model.blocks:
        _check_block(block, norm_eps)
    first = model.blocks[0]
    width, heads = model.embed_dim, first.attn.num_heads
    layer_scale = None if first.gamma_1 is None else float(first.init_values)  # its init value
    ape = model.pos_embed is not None
    return dict(
        variant=None,  # dims below, not a named variant
        dims=dict(
            width=width,
            depth=len(model.blocks),
            num_heads=heads,
            mlp_dim=first.mlp.fc1.out_features,
        ),  # fmt: skip
        patch_size=int(kernel[0]) if kernel[0] == kernel[1] else kernel,
        image_shape=tuple(int(s) for s in embed.img_size),
        channels=int(embed.proj.in_channels),
        num_classes=int(model.head.out_features),
        pool="cls",
        dropout=0.0,
        pe=pe,
        pe_hparams=dict(base=float(model.rope.temperature)) if pe == "rope_axial" else {},
        additive="ape" if ape else "none",
        additive_hparams={},
        additive_prefix=not (ape and model.no_embed_class),
        position_convention="integer",
        share_pe_heads=False,
        share_pe_layers=False,
        head_zero_init=False,
        layer_scale=layer_scale,
        gelu_approximate=False,
        norm_eps=norm_eps,
        qkv_bias=True,
        dtype="float32",
    )


def _linear(state: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {"kernel": state.pop(f"{prefix}.weight").T, "bias": state.pop(f"{prefix}.bias")}


def _norm(state: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {"scale": state.pop(f"{prefix}.weight"), "bias": state.pop(f"{prefix}.bias")}


def _attention(state, prefix: str, heads: int, swap_halves: bool) -> dict[str, np.ndarray]:
    """q/k/v/out of one ``AttentionRope``: ``qkv.weight`` rows are (3, N, H) (its reshape)."""
    w = state.pop(f"{prefix}.qkv.weight")  # (3 N H, D)
    b = state.pop(f"{prefix}.qkv.bias")  # (3 N H,)
    width = w.shape[1]
    head_dim = w.shape[0] // (3 * heads)
    w_3NHD, b_3NH = w.reshape(3, heads, head_dim, width), b.reshape(3, heads, head_dim)
    w_3DNH = w_3NHD.transpose(0, 3, 1, 2)
    perm_H = np.roll(np.arange(head_dim), -head_dim // 2) if swap_halves else np.arange(head_dim)
    out = {"wv_DNH": w_3DNH[2], "bv_NH": b_3NH[2]}
    for i, name in ((0, "q"), (1, "k")):  # the same channel permutation for q and k
        out[f"w{name}_DNH"], out[f"b{name}_NH"] = w_3DNH[i][..., perm_H], b_3NH[i][..., perm_H]
    proj_w = state.pop(f"{prefix}.proj.weight")  # (D, N H)
    out["wo_NHD"] = proj_w.T.reshape(heads, head_dim, width)
    out["bo_D"] = state.pop(f"{prefix}.proj.bias")
    return out


def convert_params(model) -> dict[str, Any]:
    """rope_lie ViT parameters (a pure dict of float32 numpy arrays) of a timm ``Eva`` model.

    Every tensor of its ``state_dict`` is used; one left over is an error naming it.
    """
    cfg = model_config(model)  # checks the architecture first
    pe, column_first = _check_rope(model.rope)
    state = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    heads, depth = cfg["dims"]["num_heads"], cfg["dims"]["depth"]
    w_DCpp = state.pop("patch_embed.proj.weight")  # conv (D, C, p, p) -> (p p C, D), patchify order
    params: dict[str, Any] = {
        "embed": {
            "kernel": w_DCpp.transpose(2, 3, 1, 0).reshape(-1, w_DCpp.shape[0]),
            "bias": state.pop("patch_embed.proj.bias"),
        },  # fmt: skip
        "cls_1D": state.pop("cls_token").reshape(1, -1),
        "norm": _norm(state, "norm"),
        "head": _linear(state, "head"),
        "blocks": {},
    }
    if model.pos_embed is not None:
        pos_1TD = state.pop("pos_embed")
        grid = tuple(int(s) for s in model.patch_embed.grid_size)
        prefix = pos_1TD.shape[1] - int(np.prod(grid))
        params["additive_params"] = {"grid_GD": pos_1TD[0, prefix:].reshape(*grid, -1)}
        if prefix:
            params["additive_params"]["prefix_PD"] = pos_1TD[0, :prefix]
    freqs = state.pop("rope.freqs") if pe == "rope_mixed" else None  # (2, L, N, H/2)
    for i in range(depth):
        p = f"blocks.{i}"
        block = {
            "ln1": _norm(state, f"{p}.norm1"),
            "ln2": _norm(state, f"{p}.norm2"),
            "attn": _attention(state, f"{p}.attn", heads, pe == "rope_axial" and column_first),
            "mlp": {"fc1": _linear(state, f"{p}.mlp.fc1"), "fc2": _linear(state, f"{p}.mlp.fc2")},
        }
        if cfg["layer_scale"] is not None:
            block["ls1_D"], block["ls2_D"] = state.pop(f"{p}.gamma_1"), state.pop(f"{p}.gamma_2")
        if freqs is not None:  # axis 0 of rope_lie = the row = timm's coordinate 1 under "xy"
            rows_cols = (freqs[1, i], freqs[0, i]) if column_first else (freqs[0, i], freqs[1, i])
            block["attn"]["pe_params"] = {"freqs_ANF": np.stack(rows_cols)}
        params["blocks"][i] = block
    if state:
        raise ValueError(f"timm state_dict keys not converted: {sorted(state)}")
    return params
