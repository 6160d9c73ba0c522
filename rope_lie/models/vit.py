"""Vision Transformer (Dosovitskiy et al., arXiv:2010.11929) for 2D images and 3D volumes/videos.

1D inputs (B, L, C) with 1D patches are accepted too (e.g. for 1D RoPE, which takes A = 1).

Patches (2D) or tubelets (3D) are flattened and projected (a strided convolution written as
patchify + linear), a class token is prepended when ``pool="cls"``, an absolute table is added
when ``additive`` is ``"ape"``/``"sincos"``, then pre-LN blocks (attention with the position-
encoding hook of ``attention.py``, GELU MLP; ``blocks.py``), a final LayerNorm, pooling and a
linear head.

Options that other codes' models need, off by default (``rope_lie/interop`` converts timm's
naver RoPE ViTs and the LieRE reference with them): explicit ``dims`` instead of a named
variant, LayerScale, the exact (erf) GELU, the LayerNorm epsilon (``blocks.py``), q/k/v
projections without biases (``qkv_bias``), and an additive table that leaves the class token
alone (``additive_prefix=False``, timm's ``no_embed_class``).

The token grid is derived from the input shape at every call, so the model runs at any
resolution divisible by the patch size: positions are recomputed with ``position_convention``
(the training grid is ``train_grid``/``anchor_grid``) and APE tables are resized.

Encoder parameters are per layer and per head by default (as in the LieRE paper);
``share_pe_heads`` and ``share_pe_layers`` share them. All position-encoding parameters
(rotary, ALiBi, APE tables) are ``PositionParam`` so the optimizer can exclude them from weight
decay, as DeiT/timm do for ``pos_embed``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rope_lie import encodings
from rope_lie.encodings import positions
from rope_lie.encodings.state import State
from rope_lie.models import attention, blocks, position_hook
from rope_lie.models.attention import xavier_uniform
from rope_lie.models.position_hook import PositionParam
from rope_lie.models.variants import (  # noqa: F401  (vit.VARIANTS, vit.parse_variant: public)
    DIM_KEYS,
    VARIANTS,
    model_dims,
    parse_variant,
)

POOLS = ("cls", "mean")
_DTYPES = ("float32", "bfloat16", "float16")


def token_grid(spatial: Sequence[int], patch: Sequence[int], what: str) -> tuple[int, ...]:
    """Tokens per axis, ``spatial // patch``, with an error naming both when not divisible."""
    spatial, patch = tuple(spatial), tuple(patch)
    if len(spatial) != len(patch) or any(s % p for s, p in zip(spatial, patch, strict=True)):
        raise ValueError(f"{what}={spatial} is not divisible by patch_size={patch}")
    return tuple(s // p for s, p in zip(spatial, patch, strict=True))


def patchify(images_BXC: jax.Array, patch: Sequence[int]) -> jax.Array:
    """Non-overlapping patches (tubelets in 3D) flattened in token order.

    Args:
      images_BXC: (B, *spatial, C), spatial divisible by ``patch``.
      patch: patch size per spatial axis.

    Returns:
      (B, T, P) with T = prod(spatial // patch) row-major and P = prod(patch) * C ordered
      (*patch, C), the layout of a flattened convolution kernel.
    """
    batch, *spatial, channels = images_BXC.shape
    grid = [s // p for s, p in zip(spatial, patch, strict=True)]
    split = [batch] + [d for g, p in zip(grid, patch, strict=True) for d in (g, p)] + [channels]
    x = images_BXC.reshape(split)
    rank = len(grid)
    order = [0, *range(1, 2 * rank, 2), *range(2, 2 * rank + 1, 2), 2 * rank + 1]
    return x.transpose(order).reshape(batch, math.prod(grid), math.prod(patch) * channels)


def additive_names() -> list[str]:
    """The valid values of ``additive``."""
    return ["none", *sorted(encodings.ADDITIVE)]


def _check_choice(value: Any, name: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name}={value!r}; expected one of {list(choices)}")


def _check_image_shape(image_shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(image_shape)
    if len(shape) not in (1, 2, 3) or any(
        not isinstance(s, numbers.Integral) or s < 1 for s in shape
    ):
        raise ValueError(
            f"image_shape={image_shape} must be 2 (image) or 3 (volume) positive ints, or 1 "
            "(sequence)"
        )
    return tuple(int(s) for s in shape)


def _check_options(pe: str, pool: str, additive: str, convention: str, dropout: float) -> None:
    position_hook.pe_module(pe)  # raises for an unknown pe, listing the valid ones
    _check_choice(pool, "pool", POOLS)
    _check_choice(additive, "additive", additive_names())
    _check_choice(convention, "position_convention", positions.CONVENTIONS)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout} must be in [0, 1)")


def _activation_dtype(dtype: Any) -> jnp.dtype:
    name = jnp.dtype(dtype).name
    _check_choice(name, "dtype", _DTYPES)
    return jnp.dtype(name)


def check_model_attention(
    model_cfg: Mapping[str, Any], platform: str | None = None, *, train: bool = True
) -> None:
    """Check ``model_cfg["attention"]`` against a platform, the dtype, head_dim and the bias.

    Call it outside ``jit``, before the first step: an unsupported choice fails with an error
    that names ``model.attention`` and what it needs (``attention.check_attention``).

    Args:
      model_cfg: ``config.model`` (the ``ViT`` keyword arguments).
      platform: where the steps run; None: ``jax.default_backend()``.
      train: whether the model is trained (cuDNN's biased backward pass needs an even T).
    """
    cfg = model_cfg.to_dict() if hasattr(model_cfg, "to_dict") else dict(model_cfg)
    name = cfg.get("attention", "xla")
    attention.check_attention_name(name)
    image_shape = _check_image_shape(cfg.get("image_shape", (224, 224)))
    dims, patch = model_dims(
        cfg.get("variant", "Ti/16"), cfg.get("dims"), cfg.get("patch_size"), len(image_shape)
    )
    grid = token_grid(image_shape, patch, "image_shape")
    tokens = math.prod(grid) + (1 if cfg.get("pool", "cls") == "cls" else 0)
    attention.check_attention(
        name,
        platform=jax.default_backend() if platform is None else platform,
        dtype=_activation_dtype(cfg.get("dtype", "float32")),
        head_dim=dims["width"] // dims["num_heads"],
        tokens=tokens,
        has_bias=cfg.get("pe", "nope") in encodings.BIAS,
        train=train,
    )


def init_additive_params(
    additive: str,
    rngs: nnx.Rngs,
    grid_shape: tuple[int, ...],
    width: int,
    num_prefix: int,
    hparams: Mapping[str, Any] | None,
) -> nnx.Dict:
    """The additive family's parameters (APE table) as ``PositionParam``; empty for none/sincos.

    Args:
      additive: ``additive_names()``.
      rngs: ``nnx.Rngs`` with a ``params`` (or default) stream.
      grid_shape: the training token grid.
      width: D.
      num_prefix: prefix (class) tokens, which get their own rows.
      hparams: the family's ``init`` keyword arguments.

    Returns:
      ``nnx.Dict`` of ``PositionParam``.
    """
    if additive == "none":
        return nnx.Dict()
    arrays = encodings.ADDITIVE[additive].init(
        rngs.params(), grid_shape=grid_shape, width=width, num_prefix=num_prefix,
        **dict(hparams or {}),
    )  # fmt: skip
    return nnx.Dict({name: PositionParam(value) for name, value in arrays.items()})


class ViT(nnx.Module):
    """ViT classifier; the keyword arguments are the ``config.model`` keys."""

    def __init__(
        self,
        *,
        variant: str | None = "Ti/16",
        dims: Mapping[str, int] | None = None,
        patch_size: int | Sequence[int] | None = None,
        image_shape: Sequence[int] = (224, 224),
        channels: int = 3,
        num_classes: int = 1000,
        pool: str = "cls",
        dropout: float = 0.0,
        pe: str = "nope",
        pe_hparams: Mapping[str, Any] | None = None,
        additive: str = "none",
        additive_hparams: Mapping[str, Any] | None = None,
        position_convention: str = "integer",
        share_pe_heads: bool = False,
        share_pe_layers: bool = False,
        head_zero_init: bool = True,
        layer_scale: float | None = None,
        gelu_approximate: bool = True,
        norm_eps: float = 1e-6,
        qkv_bias: bool = True,
        additive_prefix: bool = True,
        attention: str = "xla",
        dtype: Any = "float32",
        rngs: nnx.Rngs,
    ):
        """Build the model.

        Args:
          variant: ``VARIANTS`` key with optional ``/patch``, e.g. ``"Ti/16"``, ``"mu/8"``; None
            with ``dims`` giving width, depth, num_heads and mlp_dim.
          dims: entries of ``DIM_KEYS`` that override the variant's (``model_dims``).
          patch_size: int, (p, p) patches or (t, p, p) tubelets; overrides the variant's.
          image_shape: training input spatial shape, (H, W) or (D, H, W).
          channels: input channels C.
          num_classes: K, classifier outputs.
          pool: ``"cls"`` (class token) or ``"mean"`` (mean of the patch tokens, no class token).
          dropout: rate after the embedding, the attention output and in the MLP.
          pe: rotary or bias family, ``position_hook.pe_names()``.
          pe_hparams: the family's ``init`` keyword arguments.
          additive: ``"none"``, ``"ape"`` or ``"sincos"``, added to the tokens.
          additive_hparams: the additive family's ``init`` keyword arguments.
          position_convention: one of ``positions.CONVENTIONS``.
          share_pe_heads: one set of encoder parameters for all heads (default: per head).
          share_pe_layers: one set of encoder parameters for all layers (default: per layer).
          head_zero_init: zero-initialise the classifier head.
          layer_scale: None, or LayerScale's initial value (``blocks.py``; timm's 1e-5).
          gelu_approximate: tanh-approximated GELU (default) or, False, the exact erf form.
          norm_eps: LayerNorm epsilon of every norm (1e-6; PyTorch's ``nn.LayerNorm`` 1e-5).
          qkv_bias: biases on the q, k and v projections (the output projection always has one).
          additive_prefix: the class token gets its own row of the additive table (ViT); False:
            the table covers the grid only (timm's ``no_embed_class``).
          attention: the attention backend, ``attention.ATTENTIONS``: ``"xla"`` (the plain
            formula), ``"cudnn"`` (GPU), ``"pallas"`` (TPU) or ``"chunked"`` (exact, O(T x
            block) memory, anywhere); ``check_model_attention`` checks it against a platform.
          dtype: activation dtype, ``"float32"`` or ``"bfloat16"``; parameters are float32.
          rngs: ``nnx.Rngs``: ``params`` (or default) stream, and ``dropout`` when dropout > 0.
        """
        self.image_shape = _check_image_shape(image_shape)
        dims, self.patch = model_dims(variant, dims, patch_size, len(self.image_shape))
        self.train_grid = token_grid(self.image_shape, self.patch, "image_shape")
        _check_options(pe, pool, additive, position_convention, dropout)
        self.channels, self.pool, self.pe, self.additive = channels, pool, pe, additive
        self.position_convention = position_convention
        self.dtype = dt = _activation_dtype(dtype)
        self.num_prefix = num_prefix = 1 if pool == "cls" else 0
        width, num_heads = dims["width"], dims["num_heads"]
        if width % num_heads:
            raise ValueError(f"width={width} is not divisible by num_heads={num_heads}")
        num_axes = len(self.image_shape)
        self.embed = nnx.Linear(math.prod(self.patch) * channels, width, dtype=dt, rngs=rngs)
        self.cls_1D = nnx.Param(jnp.zeros((1, width))) if num_prefix else None
        self.additive_prefix = bool(additive_prefix)
        self.additive_params = init_additive_params(
            additive, rngs, self.train_grid, width, num_prefix if additive_prefix else 0,
            additive_hparams,
        )  # fmt: skip
        self.embed_dropout = nnx.Dropout(dropout, rngs=rngs if dropout > 0 else None)
        pe_kwargs = dict(num_heads=num_heads, head_dim=width // num_heads, num_axes=num_axes)
        self.pe_params = nnx.data(None)  # data: may hold a Dict of PositionParam below
        if share_pe_layers:
            self.pe_params = position_hook.init_pe_params(
                pe, rngs.params(), share_heads=share_pe_heads, hparams=pe_hparams, **pe_kwargs
            )
        attention_kwargs = dict(
            num_axes=num_axes, pe=pe, pe_hparams=pe_hparams, share_pe_heads=share_pe_heads,
            own_pe=not share_pe_layers, num_prefix=num_prefix, qkv_bias=qkv_bias,
            attention=attention,
        )  # fmt: skip
        block_kwargs = dict(
            norm_eps=norm_eps, gelu_approximate=gelu_approximate, layer_scale=layer_scale
        )
        self.blocks = nnx.List(
            blocks.Block(width, num_heads, dims["mlp_dim"], dropout=dropout, dtype=dt, rngs=rngs,
                         **block_kwargs, **attention_kwargs)
            for _ in range(dims["depth"])
        )  # fmt: skip
        self.norm = nnx.LayerNorm(width, epsilon=norm_eps, dtype=dt, rngs=rngs)
        head_init = jax.nn.initializers.zeros if head_zero_init else xavier_uniform(0, 1)
        self.head = nnx.Linear(width, num_classes, kernel_init=head_init, dtype=dt, rngs=rngs)

    def input_grid(self, images: jax.Array) -> tuple[int, ...]:
        """The token grid of an input batch, checking its rank and channels."""
        rank = len(self.image_shape)
        if images.ndim != rank + 2 or images.shape[-1] != self.channels:
            layout = {1: "(B, L, C)", 2: "(B, H, W, C)", 3: "(B, D, H, W, C)"}[rank]
            raise ValueError(
                f"images must have shape {layout} with C={self.channels} for "
                f"image_shape={self.image_shape}; got shape {tuple(images.shape)}"
            )
        return self.grid_of(images.shape[1:-1])

    def grid_of(self, spatial_shape: Sequence[int]) -> tuple[int, ...]:
        """The token grid of images with this spatial shape (divisible by the patch size)."""
        return token_grid(tuple(spatial_shape), self.patch, "images spatial shape")

    def embed_tokens(self, images: jax.Array, grid: tuple[int, ...]) -> jax.Array:
        """Patch embedding, class token and additive table: (B, T, D), prefix tokens first."""
        x_BTD = self.embed(patchify(images.astype(self.dtype), self.patch))
        if self.additive != "none" and not self.additive_prefix:
            x_BTD = self._add_table(x_BTD, grid, num_prefix=0)  # timm's no_embed_class
        if self.cls_1D is not None:
            cls_BPD = jnp.broadcast_to(self.cls_1D[...], (x_BTD.shape[0], *self.cls_1D.shape))
            x_BTD = jnp.concatenate([cls_BPD.astype(x_BTD.dtype), x_BTD], axis=1)
        if self.additive != "none" and self.additive_prefix:
            x_BTD = self._add_table(x_BTD, grid, num_prefix=self.num_prefix)
        return x_BTD

    def _add_table(self, x_BTD: jax.Array, grid: tuple[int, ...], num_prefix: int) -> jax.Array:
        params = {k: v[...] for k, v in self.additive_params.items()}
        emb_TD = encodings.ADDITIVE[self.additive].table(
            params, grid_shape=grid, width=x_BTD.shape[-1], num_prefix=num_prefix
        )
        return x_BTD + emb_TD.astype(x_BTD.dtype)

    def positions(self, grid: Sequence[int]) -> jax.Array:
        """pos_TA of a token grid under ``position_convention``, prefix tokens at 0."""
        return positions.grid_positions(
            tuple(grid),
            self.position_convention,
            num_prefix=self.num_prefix,
            train_grid=self.train_grid,
            anchor_grid=self.train_grid,
        )

    def pe_states(self, pos_TA: jax.Array) -> list[State]:
        """One encoder state per block (``position_hook.precompute_pe``, ``encodings/state.py``).
        Layers that share parameters share one state, so shared generators cost one exponential
        per step, not one per layer."""
        if self.pe_params is not None:  # shared across layers
            state = self.blocks[0].attn.pe_state(pos_TA, pe_params=self.pe_params)
            return [state] * len(self.blocks)
        return [block.attn.pe_state(pos_TA) for block in self.blocks]

    def precompute_pe(self, grid: Sequence[int]) -> list[State]:
        """Encoder states at a token grid, to pass as ``pe_cache`` (evaluation at a resolution).

        They depend on the encoder parameters and the grid only, so an evaluation loop computes
        them once per resolution (e.g. ``jax.jit(model.precompute_pe, static_argnums=0)`` after
        ``nnx.split``/``merge``) and every batch then costs what a model with a cheap encoder
        does. Gradients do not flow into a cache computed outside the loss.

        Args:
          grid: tokens per axis, e.g. ``model.input_grid(images)``.

        Returns:
          a list of per-block states (pytrees of arrays).
        """
        return self.pe_states(self.positions(grid))

    def attention_maps(self, images: jax.Array) -> jax.Array:
        """Every layer's attention weights on a batch (eval mode), float32 (L, B, N, T, T).

        Row t of layer l, head n: how much token t takes from each token (prefix tokens first,
        then the grid row-major); with ``pool="cls"`` row 0 is the class token's attention.
        """
        grid = self.input_grid(images)
        x_BTD = self.embed_tokens(images, grid)
        maps = []
        for block, state in zip(self.blocks, self.precompute_pe(grid), strict=True):
            maps.append(block.attn.probs(block.ln1(x_BTD), state))
            x_BTD = block(x_BTD, state, train=False)
        return jnp.stack(maps)

    def __call__(
        self,
        images: jax.Array,
        *,
        train: bool = False,
        pe_cache: Sequence[State] | None = None,
        chunk_plan: attention.ChunkPlan | None = None,
    ) -> jax.Array:
        """Classify a batch at any resolution divisible by the patch size.

        Args:
          images: (B, H, W, C) or (B, D, H, W, C), matching ``image_shape``'s rank.
          train: apply dropout (uses the ``dropout`` RNG stream).
          pe_cache: ``precompute_pe(self.input_grid(images))`` computed beforehand, or None to
            compute the encoder states here.
          chunk_plan: how the ``"xla"`` attention cuts an inference batch
            (``attention.chunk_plan()``, decided outside ``jit`` from host facts); None: none.

        Returns:
          float32 logits (B, V).
        """
        grid = self.input_grid(images)
        states = self.precompute_pe(grid) if pe_cache is None else list(pe_cache)
        if len(states) != len(self.blocks):
            raise ValueError(
                f"pe_cache has {len(states)} block states, the model has {len(self.blocks)} "
                "blocks (use model.precompute_pe(grid))"
            )
        x_BTD = self.embed_dropout(self.embed_tokens(images, grid), deterministic=not train)
        for block, state in zip(self.blocks, states, strict=True):
            x_BTD = block(x_BTD, state, train=train, chunk_plan=chunk_plan)
        x_BTD = self.norm(x_BTD)
        pooled_BD = x_BTD[:, 0] if self.pool == "cls" else jnp.mean(x_BTD, axis=1)
        return self.head(pooled_BD).astype(jnp.float32)
