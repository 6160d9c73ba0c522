"""timm's naver RoPE ViTs and DINOv3 ViTs (``timm/models/eva.py``) into rope_lie's ViT, exactly.

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

DINOv3 (Simeoni et al., arXiv:2508.10104; timm's port of github.com/facebookresearch/dinov3,
timm >= 1.0.20): ``vit_{small,base,large}_patch16_dinov3{,_qkvb}`` and
``vit_tiny_patch16_dinov3_qkvb``, ``Eva`` models with the same pre-LN blocks and LayerScale,
LayerNorm epsilon 1e-5, ``EvaAttention`` (fused q/k/v without biases, or ``_qkvb``: biases on q
and v, k's a zero buffer: rope_lie's ``bk_NH`` is 0), a class token and 4 register tokens
(``reg_token``: rope_lie's ``num_registers``, ``reg_RD``), no APE, and ``RotaryEmbeddingDinoV3``
(``timm/layers/pos_embed_sincos.py``):

- periods ``temperature^(4i/H)`` (100), i < H/4, or ``min_period (max/min)^(i/(H/4 - 1))``;
  angle of pair j of axis a ``2 pi t_a / period_j``, angles [axis 0's H/4, axis 1's H/4]: rope_lie's
  ``dinov3`` with the same base or periods (its ``pair_frequencies``);
- coordinates: pixel centres ``2 (i + 0.5) / n - 1`` per axis (``grid_type="centered"``,
  ``normalize_coords="separate"``; ``"max"``/``"min"`` divide by the longest / shortest side):
  rope_lie's conventions ``"centred"``, ``"centred_max"``, ``"centred_min"``, recomputed at every
  resolution as timm's ``dynamic_img_size`` does;
- ``rotate_half=True``: pair j is channels (j, j + H/2) (``rope_rotate_half``), rope_lie's is
  (2j, 2j + 1): the converter permutes every head's q and k channels (weights and biases) so
  that channel 2j is timm's j and 2j + 1 timm's j + H/2, the same rotation of the same numbers;
- every prefix token (class and registers, ``num_prefix_tokens=5``) is left unrotated: rope_lie's
  sit at position 0, R(0) = I.

Pooling (``Eva.forward_head``: ``pool``, then ``fc_norm``, then the head): ``"token"`` takes
the class token (rope_lie's ``pool="cls"``); ``"avg"``, the default of timm's DINOv3 models,
the mean of the tokens after the ``num_prefix_tokens`` class and register tokens
(``global_pool_nlc``) beside a class token that is not pooled (``pool="mean_with_cls"``;
upstream DINOv3 uses the class token: ``--overrides=global_pool=token``), and with
``class_token=False`` that mean alone (``pool="mean"``). The state_dict does
not record which of the two a model was fine-tuned with, so the overrides say it. timm's final
``norm`` (every token, before pooling) and ``fc_norm`` (the pooled feature) are each a
LayerNorm or an Identity: with ``"avg"`` timm turns ``fc_norm`` on and ``norm`` off unless told
otherwise, and its DINOv3 models keep ``norm`` (``use_fc_norm=False``); rope_lie's
``final_norm`` and ``fc_norm`` hold either. A model without a classifier (``num_classes=0``,
the pretrained DINOv3 weights) converts with an identity head: the logits are the pooled
features (width D); fine-tune with ``init_head="new"``.

Inputs: timm takes NCHW images normalised with ``IMAGENET_DEFAULT_MEAN``/``STD`` (the
``naver_in1k`` and ``lvd1689m`` pretrained configs); the converted model takes the same values
NHWC.

Anything else in a timm model (max pooling, attention pooling, qk-norm, SwiGLU, patch dropout,
coordinate augmentation, a rope grid offset, ...) is an error naming it, never approximated.
PyTorch and timm are imported only inside functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from rope_lie.interop import _torch_first

SIZES = ("small", "base", "large")
KINDS = ("rope", "rope_mixed", "rope_ape", "rope_mixed_ape")
NAVER = tuple(f"vit_{size}_patch16_{kind}_224" for size in SIZES for kind in KINDS)
# The GELU-MLP DINOv3s (small_plus, huge_plus and 7b have SwiGLU MLPs, which rope_lie has not).
DINOV3 = ("vit_tiny_patch16_dinov3_qkvb",) + tuple(
    f"vit_{size}_patch16_dinov3{bias}" for size in SIZES for bias in ("", "_qkvb")
)
SUPPORTED = NAVER + DINOV3
# timm's global_pool -> rope_lie's pool: the class token, or the patch tokens' mean (timm's
# global_pool_nlc: tokens after the num_prefix_tokens class and register tokens) beside it
POOLS = {"token": "cls", "avg": "mean_with_cls"}
NO_CLASS_TOKEN_POOLS = {"avg": "mean"}  # class_token=False: the patch tokens' mean alone
DINOV3_CONVENTIONS = {"separate": "centred", "max": "centred_max", "min": "centred_min"}
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # timm.data.IMAGENET_DEFAULT_MEAN
IMAGENET_STD = (0.229, 0.224, 0.225)  # timm.data.IMAGENET_DEFAULT_STD


def check_name(name: str) -> str:
    """The timm architecture of ``name`` (a pretrained tag such as ``.naver_in1k`` dropped)."""
    arch = name.split(".")[0]
    if arch not in SUPPORTED:
        raise ValueError(f"timm model {name!r} is not supported; expected one of {SUPPORTED}")
    return arch


def create(name: str, checkpoint: str | None = None, **overrides: Any):
    """The timm model ``name`` (a pretrained tag such as ``.sat493m`` picks that tag's input
    normalisation) built with ``overrides`` (e.g. a small ``embed_dim`` for tests), with the
    weights of ``checkpoint`` (a timm-layout ``state_dict`` file, ``.safetensors`` or
    ``.pth``; strict) or, without one, timm's random initialisation. Returns it in eval mode.

    The class count is read from the checkpoint's ``head.weight`` (a fine-tuned model's head
    has its own), as ``--from=liere`` reads the architecture; ``overrides`` may repeat it.
    """
    check_name(name)  # the tag stays: its pretrained config holds the input normalisation
    _torch_first.check()
    import timm

    state = None
    if checkpoint is not None:
        state = _load_state_dict(checkpoint)
        overrides = {**overrides, **_head_of(state, overrides, checkpoint)}
    try:
        model = timm.create_model(name, pretrained=False, **overrides)
    except (TypeError, RuntimeError) as e:  # a keyword it does not take, or sizes that clash
        if not overrides:
            raise
        raise ValueError(
            f"timm.create_model({name!r}) refused the overrides {overrides} ({e}); expected "
            f"keyword arguments of timm's {name!r} that fit together (e.g. embed_dim divisible "
            "by num_heads, img_size by patch_size)"
        ) from e
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
                "architecture's size with --overrides (e.g. embed_dim=, depth=, num_heads=; "
                "img_size= and patch_size= for pos_embed and patch_embed)"
            )
        model.load_state_dict(state, strict=True)
    return model.eval()


def _load_state_dict(checkpoint: str) -> dict[str, Any]:
    """timm's ``load_state_dict`` of a file, or a ValueError naming it when it is not a
    ``state_dict`` (a dict of tensors) that timm can read without unpickling code."""
    import timm.models
    import torch

    expected = "a timm state_dict file (.safetensors, or .pth written by torch.save)"
    try:
        state = timm.models.load_state_dict(checkpoint, weights_only=True)
    except Exception as e:  # safetensors, torch.load and pickle each raise their own types
        message = " ".join(str(e).split())[:300]
        raise ValueError(
            f"checkpoint {checkpoint!r} cannot be read ({type(e).__name__}: {message}); expected "
            f"{expected}"
        ) from e
    if not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"checkpoint {checkpoint!r} holds no state_dict; expected {expected}")
    return state


def _head_of(state: Mapping[str, Any], overrides: Mapping[str, Any], checkpoint: str) -> dict:
    """``{"num_classes": n}`` from the checkpoint's classifier, ``{"num_classes": 0}`` (no
    classifier) without ``head.weight`` unless ``overrides`` name a class count; a different
    ``num_classes`` in ``overrides`` is an error."""
    if "head.weight" not in state:
        return {} if "num_classes" in overrides else {"num_classes": 0}
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


class Rope(NamedTuple):
    """How a timm rope module is held in rope_lie."""

    pe: str  # the rope_lie family
    pe_hparams: dict[str, Any]
    convention: str  # position_convention
    column_first: bool  # timm's coordinate 0 is the column (grid_indexing="xy")
    half_split: bool  # timm's pair j is channels (j, j + H/2) (rotate_half), else (2j, 2j + 1)


def _check_rope(rope) -> Rope:
    """rope_lie's family, hparams and positions for a timm rope module (errors otherwise)."""
    from timm.layers import pos_embed_sincos as pes

    _require(not rope.aug_active, "rope coordinate augmentation", rope.aug_active, "off")
    _require(
        rope.grid_indexing in ("xy", "ij"), "rope.grid_indexing", rope.grid_indexing, "'xy' or 'ij'"
    )
    column_first = rope.grid_indexing == "xy"
    if type(rope) is pes.RotaryEmbeddingMixed:
        return Rope("rope_mixed", {}, "integer", column_first, False)
    if type(rope) is pes.RotaryEmbeddingDinoV3:
        _require(rope.grid_offset == 0.0, "rope.grid_offset", rope.grid_offset, "0.0")
        _require(
            rope.normalize_coords in DINOV3_CONVENTIONS,
            "rope.normalize_coords",
            rope.normalize_coords,
            f"one of {list(DINOV3_CONVENTIONS)}",
        )
        if rope.min_period is not None and rope.max_period is not None:  # timm's precedence
            hparams = dict(
                base=None, min_period=float(rope.min_period), max_period=float(rope.max_period)
            )
        else:
            hparams = dict(base=float(rope.temperature))
        convention = DINOV3_CONVENTIONS[rope.normalize_coords]
        return Rope("dinov3", hparams, convention, column_first, bool(rope.rotate_half))
    _require(
        type(rope) is pes.RotaryEmbeddingCat,
        "rope",
        type(rope).__name__,
        "RotaryEmbeddingCat, RotaryEmbeddingMixed or RotaryEmbeddingDinoV3",
    )
    for attr, expected in (
        ("in_pixels", False),
        ("grid_type", "index"),
        ("ref_feat_shape", None),
        ("grid_offset", 0.0),
        ("rotate_half", False),
    ):
        _require(
            getattr(rope, attr) == expected, f"rope.{attr}", getattr(rope, attr), repr(expected)
        )
    return Rope("rope_axial", dict(base=float(rope.temperature)), "integer", column_first, False)


def qk_permutation(head_dim: int, half_split: bool, column_first: bool) -> np.ndarray:
    """perm_H: rope_lie's q/k channel c is timm's channel perm_H[c], so that rope_lie's pair j
    (channels 2j, 2j + 1) holds timm's pair src(j) and turns by its angle.

    timm's pair k is channels (k, k + H/2) when ``half_split`` (``rotate_half``), else
    (2k, 2k + 1); its F = H/2 angles are [axis 0's F/2, axis 1's F/2], so rope_lie's axis 0 (the
    row) is timm's axis 1 when ``column_first``: src(j) = (j + F/2) mod F, else j. q.k sums over
    the channels, so permuting q's and k's alike changes no attention logit.
    """
    num_pairs = head_dim // 2
    src_F = np.arange(num_pairs)
    if column_first:
        src_F = (src_F + num_pairs // 2) % num_pairs
    first_F, second_F = (src_F, src_F + num_pairs) if half_split else (2 * src_F, 2 * src_F + 1)
    return np.stack([first_F, second_F], axis=-1).reshape(head_dim)


def _qkv_bias(attn) -> bool:
    """Whether an ``AttentionRope`` (``qkv.bias``) or ``EvaAttention`` (``q_bias``, ``v_bias``
    and a zero ``k_bias`` buffer) has q/k/v biases."""
    from timm.layers import AttentionRope
    from timm.models.eva import EvaAttention

    _require(
        type(attn) in (AttentionRope, EvaAttention),
        "block.attn",
        type(attn).__name__,
        "AttentionRope or EvaAttention",
    )
    _require(attn.qkv is not None, "attn.qkv", None, "a fused qkv Linear")
    if type(attn) is AttentionRope:
        _require(attn.num_kv_groups == 1, "attn.num_kv_groups", attn.num_kv_groups, "1")
        return attn.qkv.bias is not None
    _require(attn.qkv.bias is None, "attn.qkv.bias", "present", "None (EvaAttention's q_bias)")
    has_bias = attn.q_bias is not None
    if has_bias:
        k_zero = bool((attn.k_bias == 0).all())
        _require(k_zero, "attn.k_bias", "non-zero", "zeros (timm's non-persistent buffer)")
    return has_bias


def _check_block(block, norm_eps: float, num_prefix: int, half_split: bool) -> bool:
    """Check one block; returns whether it has q/k/v biases."""
    from timm.layers import LayerNorm, Mlp
    from timm.models.eva import EvaBlock
    from torch import nn

    _require(type(block) is EvaBlock, "block", type(block).__name__, "EvaBlock (pre-norm)")
    attn = block.attn
    qkv_bias = _qkv_bias(attn)
    for name in ("q_norm", "k_norm", "norm"):
        module = getattr(attn, name)
        _require(isinstance(module, nn.Identity), f"attn.{name}", type(module).__name__, "Identity")
    _require(attn.gate is None, "attn.gate", attn.gate, "None")
    _require(
        attn.head_dim * attn.num_heads == attn.proj.in_features,
        "attn_head_dim",
        attn.head_dim,
        "dim // num_heads",
    )
    _require(attn.proj.bias is not None, "attn.proj.bias", None, "present")
    _require(
        attn.num_prefix_tokens == num_prefix,
        "attn.num_prefix_tokens",
        attn.num_prefix_tokens,
        f"the model's {num_prefix}",
    )
    _require(
        bool(attn.rotate_half) == half_split,
        "attn.rotate_half",
        attn.rotate_half,
        f"the rope's rotate_half={half_split}",
    )
    _require(type(block.mlp) is Mlp, "block.mlp", type(block.mlp).__name__, "Mlp (no SwiGLU)")
    act = block.mlp.act
    _require(type(act) is nn.GELU and act.approximate == "none", "mlp.act", act, "nn.GELU()")
    _require(isinstance(block.mlp.norm, nn.Identity), "mlp.norm", block.mlp.norm, "Identity")
    for name in ("norm1", "norm2"):
        norm = getattr(block, name)
        _require(
            type(norm) is LayerNorm and norm.eps == norm_eps,
            f"block.{name}",
            norm,
            f"timm LayerNorm with eps={norm_eps}",
        )
    _require(
        (block.gamma_1 is None) == (block.gamma_2 is None),
        "LayerScale gamma_1/gamma_2",
        (block.gamma_1 is None, block.gamma_2 is None),
        "both or neither",
    )
    return qkv_bias


def model_config(model) -> dict[str, Any]:
    """``config.model`` (ViT keyword arguments) of a supported timm ``Eva`` model.

    Raises ValueError naming the first attribute rope_lie's ViT cannot hold exactly.
    """
    from timm.layers import LayerNorm
    from timm.models.eva import Eva
    from torch import nn

    _require(type(model) is Eva, "model", type(model).__name__, "timm.models.eva.Eva")
    pools = POOLS if model.cls_token is not None else NO_CLASS_TOKEN_POOLS
    _require(
        model.global_pool in pools,
        "global_pool",
        model.global_pool,
        f"one of {list(pools)} (the class token, or the patch tokens' mean)"
        if model.cls_token is not None
        else f"one of {list(pools)} (without a class token, the patch tokens' mean)",
    )
    for name in ("norm_pre", "head_drop"):
        module = getattr(model, name)
        ok = isinstance(module, nn.Identity) or (name == "head_drop" and module.p == 0)
        _require(ok, name, module, "Identity")
    _require(
        model.attn_pool is None and model.patch_drop is None,
        "attn_pool/patch_drop",
        (model.attn_pool, model.patch_drop),
        "None",
    )
    norm1 = model.blocks[0].norm1
    _require(type(norm1) is LayerNorm, "blocks[0].norm1", norm1, "timm LayerNorm")
    norm_eps = float(norm1.eps)  # every norm of rope_lie's ViT has one epsilon
    for name in ("norm", "fc_norm"):  # before pooling (every token), after it (the pooled one)
        module = getattr(model, name)
        is_norm = type(module) is LayerNorm and module.eps == norm_eps
        _require(
            is_norm or isinstance(module, nn.Identity),
            name,
            module,
            f"Identity or a timm LayerNorm with eps={norm_eps}",
        )
    _require(model.rope is not None, "rope", None, "a rotary embedding (use_rot_pos_emb)")
    rope = _check_rope(model.rope)
    embed = model.patch_embed
    kernel, stride = tuple(embed.proj.kernel_size), tuple(embed.proj.stride)
    conv_ok = kernel == stride and embed.proj.bias is not None and not embed.dynamic_img_pad
    _require(conv_ok, "patch_embed", (kernel, stride), "a biased conv, stride = kernel, no pad")
    _require(isinstance(embed.norm, nn.Identity), "patch_embed.norm", embed.norm, "Identity")
    biases = {
        _check_block(b, norm_eps, model.num_prefix_tokens, rope.half_split) for b in model.blocks
    }
    _require(len(biases) == 1, "qkv_bias per block", biases, "the same in every block")
    head = model.head
    _require(isinstance(head, (nn.Linear, nn.Identity)), "head", head, "a Linear or Identity")
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
        ),
        patch_size=int(kernel[0]) if kernel[0] == kernel[1] else kernel,
        image_shape=tuple(int(s) for s in embed.img_size),
        channels=int(embed.proj.in_channels),
        num_classes=int(head.out_features) if isinstance(head, nn.Linear) else width,
        pool=pools[model.global_pool],
        final_norm=not isinstance(model.norm, nn.Identity),
        fc_norm=not isinstance(model.fc_norm, nn.Identity),
        num_registers=0 if model.reg_token is None else int(model.reg_token.shape[1]),
        dropout=0.0,
        pe=rope.pe,
        pe_hparams=rope.pe_hparams,
        additive="ape" if ape else "none",
        additive_hparams={},
        additive_prefix=not (ape and model.no_embed_class),
        position_convention=rope.convention,
        share_pe_heads=False,
        share_pe_layers=False,
        head_zero_init=False,
        layer_scale=layer_scale,
        gelu_approximate=False,
        norm_eps=norm_eps,
        qkv_bias=biases.pop(),
        dtype="float32",
    )


def notes(model) -> list[str]:
    """What a user of the converted model should know that its config does not say."""
    from torch import nn

    if isinstance(model.head, nn.Identity):
        return [
            "the timm model has no classifier (num_classes=0): the converted head is the "
            f"identity, so the logits are the pooled features (width {model.embed_dim}); "
            "fine-tune with --config.init_head=new and the task's num_classes"
        ]
    return []


def _linear(state: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {"kernel": state.pop(f"{prefix}.weight").T, "bias": state.pop(f"{prefix}.bias")}


def _head(state: dict[str, np.ndarray], num_classes: int) -> dict[str, np.ndarray]:
    """The classifier, or for a model without one (num_classes=0) the identity (D = K)."""
    if "head.weight" in state:
        return _linear(state, "head")
    return {
        "kernel": np.eye(num_classes, dtype=np.float32),
        "bias": np.zeros(num_classes, np.float32),
    }


def _norm(state: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {"scale": state.pop(f"{prefix}.weight"), "bias": state.pop(f"{prefix}.bias")}


def _qkv_bias_3NH(state, prefix: str, w_3NHD: np.ndarray) -> np.ndarray | None:
    """The q/k/v biases (3, N, H): ``AttentionRope``'s ``qkv.bias``, or ``EvaAttention``'s
    ``q_bias`` and ``v_bias`` with k's zero (its non-persistent ``k_bias``); None without."""
    shape_3NH = w_3NHD.shape[:3]
    if f"{prefix}.qkv.bias" in state:
        return state.pop(f"{prefix}.qkv.bias").reshape(shape_3NH)
    if f"{prefix}.q_bias" in state:
        q_NH = state.pop(f"{prefix}.q_bias").reshape(shape_3NH[1:])
        v_NH = state.pop(f"{prefix}.v_bias").reshape(shape_3NH[1:])
        return np.stack([q_NH, np.zeros_like(q_NH), v_NH])
    return None


def _attention(state, prefix: str, heads: int, perm_H: np.ndarray | None) -> dict[str, np.ndarray]:
    """q/k/v/out of one ``AttentionRope`` or ``EvaAttention``: ``qkv.weight`` rows are
    (3, N, H) (their reshape); q's and k's channels permuted by ``perm_H`` (``qk_permutation``)."""
    w = state.pop(f"{prefix}.qkv.weight")  # (3 N H, D)
    width = w.shape[1]
    head_dim = w.shape[0] // (3 * heads)
    w_3NHD = w.reshape(3, heads, head_dim, width)
    b_3NH = _qkv_bias_3NH(state, prefix, w_3NHD)
    w_3DNH = w_3NHD.transpose(0, 3, 1, 2)
    perm_H = np.arange(head_dim) if perm_H is None else perm_H
    out = {"wv_DNH": w_3DNH[2]}
    for i, name in ((0, "q"), (1, "k")):  # the same channel permutation for q and k
        out[f"w{name}_DNH"] = w_3DNH[i][..., perm_H]
    if b_3NH is not None:
        out["bv_NH"] = b_3NH[2]
        out["bq_NH"], out["bk_NH"] = b_3NH[0][..., perm_H], b_3NH[1][..., perm_H]
    proj_w = state.pop(f"{prefix}.proj.weight")  # (D, N H)
    out["wo_NHD"] = proj_w.T.reshape(heads, head_dim, width)
    out["bo_D"] = state.pop(f"{prefix}.proj.bias")
    return out


def convert_params(model) -> dict[str, Any]:
    """rope_lie ViT parameters (a pure dict of float32 numpy arrays) of a timm ``Eva`` model.

    Every tensor of its ``state_dict`` is used; one left over is an error naming it.
    """
    cfg = model_config(model)  # checks the architecture first
    rope = _check_rope(model.rope)
    state = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    heads, depth = cfg["dims"]["num_heads"], cfg["dims"]["depth"]
    w_DCpp = state.pop("patch_embed.proj.weight")  # conv (D, C, p, p) -> (p p C, D), patchify order
    params: dict[str, Any] = {
        "embed": {
            "kernel": w_DCpp.transpose(2, 3, 1, 0).reshape(-1, w_DCpp.shape[0]),
            "bias": state.pop("patch_embed.proj.bias"),
        },
        "head": _head(state, cfg["num_classes"]),
        "blocks": {},
    }
    if model.cls_token is not None:  # class_token=False: none, and pool="mean"
        params["cls_1D"] = state.pop("cls_token").reshape(1, -1)
    for name, present in (("norm", cfg["final_norm"]), ("fc_norm", cfg["fc_norm"])):
        if present:
            params[name] = _norm(state, name)
    if cfg["num_registers"]:
        params["reg_RD"] = state.pop("reg_token")[0]  # (1, R, D) -> (R, D)
    if model.pos_embed is not None:
        pos_1TD = state.pop("pos_embed")
        grid = tuple(int(s) for s in model.patch_embed.grid_size)
        prefix = pos_1TD.shape[1] - int(np.prod(grid))
        params["additive_params"] = {"grid_GD": pos_1TD[0, prefix:].reshape(*grid, -1)}
        if prefix:
            params["additive_params"]["prefix_PD"] = pos_1TD[0, :prefix]
    freqs = state.pop("rope.freqs") if rope.pe == "rope_mixed" else None  # (2, L, N, H/2)
    head_dim = cfg["dims"]["width"] // heads
    perm_H = None  # rope_mixed: the frequency rows are swapped instead
    if rope.pe in ("rope_axial", "dinov3"):
        perm_H = qk_permutation(head_dim, rope.half_split, rope.column_first)
    for i in range(depth):
        p = f"blocks.{i}"
        block = {
            "ln1": _norm(state, f"{p}.norm1"),
            "ln2": _norm(state, f"{p}.norm2"),
            "attn": _attention(state, f"{p}.attn", heads, perm_H),
            "mlp": {"fc1": _linear(state, f"{p}.mlp.fc1"), "fc2": _linear(state, f"{p}.mlp.fc2")},
        }
        if cfg["layer_scale"] is not None:
            block["ls1_D"], block["ls2_D"] = state.pop(f"{p}.gamma_1"), state.pop(f"{p}.gamma_2")
        if freqs is not None:  # axis 0 of rope_lie = the row = timm's coordinate 1 under "xy"
            rows_cols = (
                (freqs[1, i], freqs[0, i]) if rope.column_first else (freqs[0, i], freqs[1, i])
            )
            block["attn"]["pe_params"] = {"freqs_ANF": np.stack(rows_cols)}
        params["blocks"][i] = block
    if state:
        raise ValueError(f"timm state_dict keys not converted: {sorted(state)}")
    return params
