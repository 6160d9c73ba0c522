"""Vision Transformer (Dosovitskiy et al., arXiv:2010.11929) for 2D images and 3D volumes/videos.

1D inputs (B, L, C) with 1D patches are accepted too (e.g. for 1D RoPE, which takes A = 1).

Patches (2D) or tubelets (3D) are flattened and projected (a strided convolution written as
patchify + linear), a class token is prepended when ``pool`` is ``"cls"`` or
``"mean_with_cls"``, an absolute table is added when ``additive`` is ``"ape"``/``"sincos"``,
then pre-LN blocks (attention with the position-encoding hook of ``attention.py``, GELU MLP;
``blocks.py``), a final LayerNorm, pooling and a linear head.

Options that other codes' models need, off by default (``rope_lie/interop`` converts timm's
naver RoPE ViTs, timm's DINOv3 ViTs and the LieRE reference with them): explicit ``dims``
instead of a named variant, LayerScale, the exact (erf) GELU, the LayerNorm epsilon
(``blocks.py``), q/k/v projections without biases (``qkv_bias``), an additive table that leaves
the class token alone (``additive_prefix=False``, timm's ``no_embed_class``), register tokens
(``num_registers``), and timm's ``"avg"`` pooling head: the patch tokens' mean beside a class
token (``pool="mean_with_cls"``), without the final norm (``final_norm=False``, timm's ``norm``
an Identity) and with a LayerNorm on the pooled feature (``fc_norm=True``, timm's ``fc_norm``).

Register tokens (Darcet et al., "Vision Transformers Need Registers", arXiv:2309.16588; DINOv3's
four "storage tokens"): R learned tokens after the class token, [cls, reg_0, ..., reg_(R-1),
patches] as timm's ``Eva`` orders them. They are prefix tokens like the class token: position 0
on every axis (so R(0), unrotated, for every rotary family; zero ALiBi bias), their own rows of
an additive table when ``additive_prefix``, never pooled (``pool="cls"`` takes the class token,
``"mean"`` and ``"mean_with_cls"`` the patch tokens, as timm's ``"token"`` and ``"avg"``).
Drawn from N(0, 0.02), as timm and DINOv3 do, after every other parameter: the other
parameters are those of the model without registers (an additive table's prefix rows aside).
``num_registers=0`` (the default) adds nothing.

The token grid is derived from the input shape at every call, so the model runs at any
resolution divisible by the patch size: positions are recomputed with ``position_convention``
(the training grid is ``train_grid``/``anchor_grid``) and APE tables are resized.

``classify_tokens`` takes a padded batch of already patchified images of mixed sizes
(``tokens.Tokens``, NaFlex-style): positions per example from each token's grid coordinates,
a key-padding mask in every attention, mean pooling over real tokens, and patch dropout in
training; each example gets the logits it gets alone at its own size. It also takes a packed
batch (``tokens.Packed``, NaViT): several images per row, each with its own prefix tokens and
positions, attending within its own segment and pooled alone: logits per image slot.

``features`` returns the patch tokens (and, apart, the prefix tokens) of chosen layers, as
DINOv3's ``get_intermediate_layers`` and timm's ``forward_intermediates`` do, from the same
forward pass: ``__call__``, ``classify_tokens`` and ``features`` share one block loop
(``_blocks_forward``).

Encoder parameters are per layer and per head by default (as in the LieRE paper);
``share_pe_heads`` and ``share_pe_layers`` share them. All position-encoding parameters
(rotary, ALiBi, APE tables) are ``PositionParam`` so the optimizer can exclude them from weight
decay, as DeiT/timm do for ``pos_embed``.
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from rope_lie import encodings
from rope_lie.encodings import _sharding, positions
from rope_lie.encodings import extrapolation as extrapolation_lib
from rope_lie.encodings.state import State
from rope_lie.models import blocks, position_hook, tokens
from rope_lie.models.attention import xavier_uniform
from rope_lie.models.options import (
    activation_dtype,
    check_augment,
    check_image_shape,
    check_options,
    check_position_hparams,
    check_registers,
    has_class_token,
    num_prefix_tokens,
)
from rope_lie.models.position_hook import PositionParam
from rope_lie.models.tokens import patchify, token_grid
from rope_lie.models.variables import NoDecay
from rope_lie.models.variants import model_dims

REGISTER_INIT_STD = 0.02  # timm's reg_token and DINOv3's storage tokens


class Features(NamedTuple):
    """``ViT.features``: per layer asked for, its patch tokens and its prefix tokens.

    Attributes:
      patch: a tuple of (B, T, D) arrays (or (B, *grid, D) with ``reshape``), grid row-major.
      prefix: a tuple of (B, num_prefix, D) arrays: the class token, then the registers
        ((B, 0, D) for a model with neither).
    """

    patch: tuple[jax.Array, ...]
    prefix: tuple[jax.Array, ...]


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
      additive: ``options.additive_names()``.
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
        rngs.params(),
        grid_shape=grid_shape,
        width=width,
        num_prefix=num_prefix,
        **dict(hparams or {}),
    )
    return nnx.Dict({name: PositionParam(value) for name, value in arrays.items()})


def init_registers(rngs: nnx.Rngs, num_registers: int, width: int) -> NoDecay | None:
    """R register tokens (R, D) from N(0, ``REGISTER_INIT_STD``); None (no draw) for R = 0."""
    if not num_registers:
        return None
    return NoDecay(REGISTER_INIT_STD * jax.random.normal(rngs.params(), (num_registers, width)))


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
        position_hparams: Mapping[str, Any] | None = None,
        position_augment: Mapping[str, float] | None = None,
        share_pe_heads: bool = False,
        share_pe_layers: bool = False,
        head_zero_init: bool = True,
        layer_scale: float | None = None,
        gelu_approximate: bool = True,
        norm_eps: float = 1e-6,
        qkv_bias: bool = True,
        additive_prefix: bool = True,
        num_registers: int = 0,
        final_norm: bool = True,
        fc_norm: bool = False,
        patch_dropout: float = 0.0,
        attention: str = "xla",
        fold_mix: bool = True,
        dtype: Any = "float32",
        rngs: nnx.Rngs,
    ):
        """Build the model.

        Args:
          variant: ``variants.VARIANTS`` key with optional ``/patch``, e.g. ``"Ti/16"``,
            ``"mu/8"``; None with ``dims`` giving width, depth, num_heads and mlp_dim.
          dims: entries of ``variants.DIM_KEYS`` that override the variant's (``model_dims``).
          patch_size: int, (p, p) patches or (t, p, p) tubelets; overrides the variant's.
          image_shape: training input spatial shape, (H, W) or (D, H, W).
          channels: input channels C.
          num_classes: K, classifier outputs.
          pool: ``"cls"`` (class token), ``"mean"`` (mean of the patch tokens, no class token)
            or ``"mean_with_cls"`` (mean of the patch tokens, beside a class token that is not
            pooled: timm's ``"avg"`` with a class token).
          dropout: rate after the embedding, the attention output and in the MLP.
          pe: rotary or bias family, ``position_hook.pe_names()``.
          pe_hparams: the family's ``init`` keyword arguments.
          additive: ``"none"``, ``"ape"`` or ``"sincos"``, added to the tokens.
          additive_hparams: the additive family's ``init`` keyword arguments.
          position_convention: one of ``positions.CONVENTIONS``.
          position_hparams: the convention's keyword arguments (``positions.CONVENTION_HPARAMS``):
            ``temporal_spacing`` (delta) of ``"diagonal"``, VideoRoPE's Diagonal Layout;
            ``value_range`` of ``"normalized"``.
          position_augment: None, or ``positions.augment``'s ``shift``/``jitter``/``rescale``
            (DINOv3's coordinate augmentations) and ``randomize`` (RPE-2D's randomized
            positions from a grid that many times larger, ``positions.randomize``), drawn in
            training (``train=True``, positions
            not from ``pe_cache``) from the model's own ``augment`` RNG stream, created after
            every parameter (the parameters are those of the model without it); the train
            step reseeds it every step as it does dropout's. Image batches only: training on
            token batches (``classify_tokens``: NaFlex, packed rows, patch dropout) with it
            is an error, not a run without it.
          share_pe_heads: one set of encoder parameters for all heads (default: per head).
          share_pe_layers: one set of encoder parameters for all layers (default: per layer).
          head_zero_init: zero-initialise the classifier head.
          layer_scale: None, or LayerScale's initial value (``blocks.py``; timm's 1e-5).
          gelu_approximate: tanh-approximated GELU (default) or, False, the exact erf form.
          norm_eps: LayerNorm epsilon of every norm (1e-6; PyTorch's ``nn.LayerNorm`` 1e-5).
          qkv_bias: biases on the q, k and v projections (the output projection always has one).
          additive_prefix: the class token gets its own row of the additive table (ViT); False:
            the table covers the grid only (timm's ``no_embed_class``).
          num_registers: R learned register tokens after the class token (module docstring);
            0: none.
          final_norm: a LayerNorm on every token after the blocks, before pooling (default);
            False: none (timm's ``norm`` as an Identity, beside its ``fc_norm``).
          fc_norm: a LayerNorm on the pooled feature, before the head (timm's ``fc_norm``);
            False (default): none.
          attention: the attention backend, a ``backends.BACKENDS`` key: ``"xla"`` (the plain
            formula), ``"cudnn"`` (GPU), ``"pallas"`` (TPU), ``"chunked"`` (exact, O(T x
            block) memory, anywhere) or ``"xla_cpu"`` (the formula in batch chunks, the
            evaluation step's choice on one CPU device); ``backends.check_attention`` checks
            it against a platform.
          fold_mix: fold Cayley-STRING's P into the q/k projections once per step (default);
            False applies it to every token, as the reference code does (same logits; for the
            speed comparison in ``experiments/benchmarks/cayley_speed.py``).
          dtype: activation dtype, ``"float32"`` or ``"bfloat16"``; parameters are float32.
          rngs: ``nnx.Rngs``: ``params`` (or default) stream, and ``dropout`` when dropout > 0.
        """
        self.image_shape = check_image_shape(image_shape)
        dims, self.patch = model_dims(variant, dims, patch_size, len(self.image_shape))
        self.train_grid = token_grid(self.image_shape, self.patch, "image_shape")
        check_options(pe, pool, additive, position_convention, dropout)
        self.channels, self.pool, self.pe, self.additive = channels, pool, pe, additive
        self.position_convention = position_convention
        self.position_hparams = check_position_hparams(
            position_convention, position_hparams, pe_hparams
        )
        tokens.keep_count(1, patch_dropout)  # raises unless 0 <= patch_dropout < 1
        self.patch_dropout = float(patch_dropout)
        self.dtype = dt = activation_dtype(dtype)
        self.num_registers = check_registers(num_registers)
        for name, value in (("final_norm", final_norm), ("fc_norm", fc_norm)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be True or False")
        self.num_prefix = num_prefix = num_prefix_tokens(pool, num_registers)
        width, num_heads = dims["width"], dims["num_heads"]
        if width % num_heads:
            raise ValueError(f"width={width} is not divisible by num_heads={num_heads}")
        num_axes = len(self.image_shape)
        self.embed = nnx.Linear(math.prod(self.patch) * channels, width, dtype=dt, rngs=rngs)
        self.cls_1D = NoDecay(jnp.zeros((1, width))) if has_class_token(pool) else None
        self.additive_prefix = bool(additive_prefix)
        self.additive_params = init_additive_params(
            additive,
            rngs,
            self.train_grid,
            width,
            num_prefix if additive_prefix else 0,
            additive_hparams,
        )
        self.embed_dropout = nnx.Dropout(dropout, rngs=rngs if dropout > 0 else None)
        pe_kwargs = dict(num_heads=num_heads, head_dim=width // num_heads, num_axes=num_axes)
        self.pe_params = nnx.data(None)  # data: may hold a Dict of PositionParam below
        if share_pe_layers:
            encoder = position_hook.pe_encoder(
                pe, share_heads=share_pe_heads, hparams=pe_hparams, **pe_kwargs
            )
            self.pe_params = position_hook.init_pe_params(encoder, rngs.params())
        attention_kwargs = dict(
            num_axes=num_axes,
            pe=pe,
            pe_hparams=pe_hparams,
            share_pe_heads=share_pe_heads,
            own_pe=not share_pe_layers,
            num_prefix=num_prefix,
            qkv_bias=qkv_bias,
            attention=attention,
            fold_mix=fold_mix,
        )
        block_kwargs = dict(
            norm_eps=norm_eps, gelu_approximate=gelu_approximate, layer_scale=layer_scale
        )
        self.blocks = nnx.List(
            blocks.Block(
                width,
                num_heads,
                dims["mlp_dim"],
                dropout=dropout,
                dtype=dt,
                rngs=rngs,
                **block_kwargs,
                **attention_kwargs,
            )
            for _ in range(dims["depth"])
        )
        norm = lambda: nnx.LayerNorm(width, epsilon=norm_eps, dtype=dt, rngs=rngs)
        self.norm = norm() if final_norm else None
        self.fc_norm = norm() if fc_norm else None
        head_init = jax.nn.initializers.zeros if head_zero_init else xavier_uniform(0, 1)
        self.head = nnx.Linear(width, num_classes, kernel_init=head_init, dtype=dt, rngs=rngs)
        # drawn last: the other parameters are those of the model without registers
        self.reg_RD = init_registers(rngs, self.num_registers, width)
        self.position_augment = check_augment(position_augment)
        self.augment_rngs = nnx.data(None)
        if self.position_augment:
            self.augment_rngs = nnx.Rngs(augment=rngs.params())

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
        """Patch embedding, prefix tokens and additive table: (B, T, D), prefix tokens first."""
        x_BTD = self.embed(patchify(images.astype(self.dtype), self.patch))
        if self.additive != "none" and not self.additive_prefix:
            x_BTD = self._add_table(x_BTD, grid, num_prefix=0)  # timm's no_embed_class
        x_BTD = self._with_prefix(x_BTD)
        if self.additive != "none" and self.additive_prefix:
            x_BTD = self._add_table(x_BTD, grid, num_prefix=self.num_prefix)
        return x_BTD

    def _with_prefix(self, x_BTD: jax.Array) -> jax.Array:
        """The learned prefix tokens prepended: [class token, registers, x_BTD]."""
        rows = [v[...] for v in (self.cls_1D, self.reg_RD) if v is not None]
        if not rows:
            return x_BTD
        prefix_PD = rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=0)
        prefix_BPD = jnp.broadcast_to(prefix_PD, (x_BTD.shape[0], *prefix_PD.shape))
        prefix_BPD = _sharding.split_batch(prefix_BPD, _sharding.batch_axes(x_BTD))
        return jnp.concatenate([prefix_BPD.astype(x_BTD.dtype), x_BTD], axis=1)

    def embed_token_batch(self, batch: tokens.Tokens) -> jax.Array:
        """``embed_tokens`` for a padded mixed-size batch: (B, num_prefix + T, D).

        Padded patches are zeroed first (so that no value in them reaches a real token, not
        even a NaN); every example's additive table is its own grid's (``ADDITIVE[...].gather``).
        """
        real_BT1 = (batch.mask_BT > 0)[..., None]
        patches_BTC = jnp.where(real_BT1, batch.patches_BTC, 0).astype(self.dtype)
        x_BTD = self.embed(patches_BTC)
        if self.additive != "none" and not self.additive_prefix:
            x_BTD = x_BTD + self._gather_table(batch, x_BTD.shape[-1], 0).astype(x_BTD.dtype)
        x_BTD = self._with_prefix(x_BTD)
        if self.additive != "none" and self.additive_prefix:
            emb_BTD = self._gather_table(batch, x_BTD.shape[-1], self.num_prefix)
            x_BTD = x_BTD + emb_BTD.astype(x_BTD.dtype)
        return x_BTD

    def _gather_table(self, batch: tokens.Tokens, width: int, num_prefix: int) -> jax.Array:
        params = {k: v[...] for k, v in self.additive_params.items()}
        return encodings.ADDITIVE[self.additive].gather(
            params, batch.index_BTA, batch.grid_BA, width=width, num_prefix=num_prefix
        )

    def image_tokens(self, images: jax.Array) -> tokens.Tokens:
        """A batch of equally sized images as an unpadded ``tokens.Tokens`` batch."""
        return tokens.from_patches(patchify(images, self.patch), self.input_grid(images))

    def token_positions(self, batch: tokens.Tokens) -> jax.Array:
        """pos_BTA of a token batch under ``position_convention``, prefix tokens at 0 first."""
        pos_BTA = positions.index_positions(
            batch.index_BTA,
            batch.grid_BA,
            self.position_convention,
            train_grid=self.train_grid,
            anchor_grid=self.train_grid,
            **dict(self.position_hparams),
        )
        prefix_BPA = jnp.zeros((pos_BTA.shape[0], self.num_prefix, pos_BTA.shape[-1]))
        prefix_BPA = _sharding.split_batch(prefix_BPA, _sharding.batch_axes(pos_BTA))
        return jnp.concatenate([prefix_BPA, pos_BTA], axis=1)

    def classify_tokens(
        self,
        batch: tokens.Tokens | tokens.Packed,
        *,
        train: bool = False,
        patch_key: jax.Array | None = None,
    ) -> jax.Array:
        """Classify a padded batch of token sequences of mixed grid sizes (``tokens.Tokens``),
        or a packed batch of several images per row (``tokens.Packed``).

        Every example is classified as if it were alone at its own grid (``__call__`` on its
        image): each token's position is its own example's (``token_positions``, per-example
        encoder states), its additive table is its example's grid's, padded keys get no
        attention (the key mask, which each backend takes as its kernel does:
        ``Attention.__call__``) and padded tokens no pooling weight. In a packed row every
        image has its own prefix tokens and positions, attends within its own segment
        (``segment_BS``, each backend as its kernel takes it) and is pooled alone.

        Args:
          batch: ``tokens.Tokens`` of length T or ``tokens.Packed`` (prefix tokens are
            prepended here).
          train: apply dropout (the ``dropout`` RNG stream) and, with ``patch_key``, patch
            dropout (``Tokens`` only).
          patch_key: PRNG key of patch dropout; used when ``train`` and ``patch_dropout`` > 0
            (a random ``keep_count`` of the slots of each example, ``tokens.patch_dropout``).

        Returns:
          float32 logits (B, V); for a ``Packed`` batch (B, U, V), one per image slot of each
          row (an empty slot's are finite and meaningless).
        """
        if isinstance(batch, tokens.Packed):
            if train and self.patch_dropout > 0:
                raise ValueError(
                    f"patch_dropout={self.patch_dropout} is not available on packed batches "
                    "(naflex.pack); set model.patch_dropout=0 or turn packing off"
                )
            x_BSD, states, masks = self._packed_inputs(batch, train=train)
            x_BSD = self._blocks_forward(x_BSD, states, train=train, **masks)
            return self.classify_packed(x_BSD, batch.segment_BT, batch.grid_BUA.shape[1])
        if train and self.patch_dropout > 0:
            if patch_key is None:
                raise ValueError(
                    f"patch_dropout={self.patch_dropout} needs a patch_key in training"
                )
            keep = tokens.keep_count(batch.mask_BT.shape[1], self.patch_dropout)
            batch = tokens.patch_dropout(patch_key, batch, keep)
        x_BTD, states, masks = self._token_inputs(batch, train=train)
        x_BTD = self._blocks_forward(x_BTD, states, train=train, **masks)
        return self.classify_features(x_BTD, masks["key_mask_BS"][:, self.num_prefix :])

    def _token_inputs(
        self, batch: tokens.Tokens, *, train: bool
    ) -> tuple[jax.Array, list[State], dict[str, jax.Array]]:
        """A padded token batch's embedded tokens (prefix tokens first), block states and key
        mask (``{"key_mask_BS": ...}``, the prefix tokens real)."""
        self._check_no_augment(train, "a padded token batch")
        tokens.check_shapes(batch, patch=self.patch, channels=self.channels)
        tokens.check_tokens(batch)
        mask_BT = batch.mask_BT > 0
        # Padded slots and all-padding examples (an evaluation's zero-filled batch tail, grid 0)
        # get coordinate 0 of a grid of at least 1: finite positions and tables everywhere.
        batch = batch._replace(
            index_BTA=jnp.where(mask_BT[..., None], batch.index_BTA, 0),
            grid_BA=jnp.maximum(batch.grid_BA, 1),
        )
        states = self.pe_states(self.token_positions(batch))
        prefix_BP = jnp.ones((mask_BT.shape[0], self.num_prefix), bool)
        prefix_BP = _sharding.split_batch(prefix_BP, _sharding.batch_axes(mask_BT))
        mask_BS = jnp.concatenate([prefix_BP, mask_BT], 1)
        x_BTD = self.embed_dropout(self.embed_token_batch(batch), deterministic=not train)
        return x_BTD, states, {"key_mask_BS": mask_BS}

    def _check_no_augment(self, train: bool, what: str) -> None:
        if train and self.position_augment:
            raise ValueError(
                f"position_augment={dict(self.position_augment)} augments the positions of "
                f"image batches only; training on {what} (NaFlex, packed rows or patch dropout) "
                "would run without it: set position_augment=None there"
            )

    def _packed_inputs(
        self, batch: tokens.Packed, *, train: bool
    ) -> tuple[jax.Array, list[State], dict[str, jax.Array]]:
        """A packed batch's embedded tokens (every slot's prefix tokens first), block states
        and segments (``{"segment_BS": ...}``: an empty slot's prefix tokens in segment 0 with
        the padding)."""
        self._check_no_augment(train, "a packed batch")
        tokens.check_shapes(batch, patch=self.patch, channels=self.channels)
        tokens.check_packed(batch)
        slots = batch.grid_BUA.shape[1]
        states = self.pe_states(self.packed_positions(batch), num_prefix=slots * self.num_prefix)
        full_BU = batch.grid_BUA[..., 0] > 0
        slot_BU = jnp.where(full_BU, jnp.arange(1, slots + 1, dtype=jnp.int32)[None], 0)
        prefix_BP = jnp.repeat(slot_BU, self.num_prefix, axis=1)
        segment_BS = jnp.concatenate([prefix_BP, batch.segment_BT.astype(jnp.int32)], axis=1)
        x_BSD = self.embed_dropout(self.embed_packed(batch), deterministic=not train)
        return x_BSD, states, {"segment_BS": segment_BS}

    def packed_positions(self, batch: tokens.Packed) -> jax.Array:
        """pos_BSA of a packed batch: every slot's prefix tokens at 0 first (U num_prefix of
        them), then each token's position in its own image's grid (``tokens.slot_grids``)."""
        index_BTA = jnp.where(batch.segment_BT[..., None] > 0, batch.index_BTA, 0)
        pos_BT1A = positions.index_positions(
            index_BTA[..., None, :],
            tokens.slot_grids(batch),
            self.position_convention,
            train_grid=self.train_grid,
            anchor_grid=self.train_grid,
            **dict(self.position_hparams),
        )
        pos_BTA = pos_BT1A[..., 0, :]
        prefix = batch.grid_BUA.shape[1] * self.num_prefix
        prefix_BPA = jnp.zeros((pos_BTA.shape[0], prefix, pos_BTA.shape[-1]))
        prefix_BPA = _sharding.split_batch(prefix_BPA, _sharding.batch_axes(pos_BTA))
        return jnp.concatenate([prefix_BPA, pos_BTA], axis=1)

    def embed_packed(self, batch: tokens.Packed) -> jax.Array:
        """``embed_token_batch`` for a packed batch: (B, U num_prefix + T, D), the prefix
        tokens of slot 0 (class token, registers), of slot 1, ..., then the tokens; each token's
        additive table is its own image's grid's (``ADDITIVE[...].gather`` per token)."""
        real_BT = batch.segment_BT > 0
        patches_BTC = jnp.where(real_BT[..., None], batch.patches_BTC, 0).astype(self.dtype)
        x_BTD = self.embed(patches_BTC)
        slots, width = batch.grid_BUA.shape[1], x_BTD.shape[-1]
        index_BTA = jnp.where(real_BT[..., None], batch.index_BTA, 0)
        params = {k: v[...] for k, v in self.additive_params.items()}
        gather = lambda num_prefix: encodings.ADDITIVE[self.additive].gather(
            params, index_BTA, tokens.slot_grids(batch), width=width, num_prefix=num_prefix
        )
        if self.additive != "none" and not self.additive_prefix:
            x_BTD = x_BTD + gather(0).astype(x_BTD.dtype)
        prefix_BPD = self._with_prefix(x_BTD[:, :0])  # the prefix tokens alone (B, P, D)
        if self.additive != "none" and self.additive_prefix:
            emb_BSD = gather(self.num_prefix).astype(x_BTD.dtype)
            prefix_BPD = prefix_BPD + emb_BSD[:, : self.num_prefix]
            x_BTD = x_BTD + emb_BSD[:, self.num_prefix :]
        return jnp.concatenate([jnp.tile(prefix_BPD, (1, slots, 1)), x_BTD], axis=1)

    def _blocks_forward(
        self,
        x_BTD: jax.Array,
        states: Sequence[State],
        *,
        train: bool,
        take: Sequence[int] | None = None,
        **masks: jax.Array,
    ) -> jax.Array | list[jax.Array]:
        """The blocks on embedded tokens: the one block loop of every forward pass.

        Args:
          x_BTD: embedded tokens, prefix tokens first.
          states: one encoder state per block.
          train: apply dropout.
          take: None, or sorted layer indices whose outputs to return; the loop then stops
            after the last of them.
          **masks: ``key_mask_BS`` for padded token batches, ``segment_BS`` for packed ones
            (``Block.__call__``).

        Returns:
          the last block's output, or (``take``) the listed blocks' outputs.
        """
        stop = len(self.blocks) if take is None else max(take) + 1
        outputs = []
        for index in range(stop):
            x_BTD = self.blocks[index](x_BTD, states[index], train=train, **masks)
            if take is not None and index in take:
                outputs.append(x_BTD)
        return x_BTD if take is None else outputs

    def classify_features(self, x_BTD: jax.Array, mask_BT: jax.Array | None = None) -> jax.Array:
        """The head on the blocks' output: the final norm, pooling, ``fc_norm``, the classifier.

        Args:
          x_BTD: the last block's output, prefix tokens first.
          mask_BT: which patch tokens are real (``classify_tokens``'s padded batches), for the
            mean pools; None: every one.

        Returns:
          float32 logits (B, V).
        """
        if self.norm is not None:
            x_BTD = self.norm(x_BTD)
        if self.pool == "cls":
            pooled_BD = x_BTD[:, 0]
        elif mask_BT is None:  # the patch tokens (class token and registers are not pooled)
            pooled_BD = jnp.mean(x_BTD[:, self.num_prefix :], axis=1)
        else:  # mean over the real patch tokens only
            weight_BT1 = mask_BT[..., None].astype(x_BTD.dtype)
            count_B1 = jnp.maximum(jnp.sum(weight_BT1, axis=1), 1)
            pooled_BD = jnp.sum(x_BTD[:, self.num_prefix :] * weight_BT1, axis=1) / count_B1
        return self._classify_pooled(pooled_BD)

    def _classify_pooled(self, pooled_XD: jax.Array) -> jax.Array:
        """``fc_norm`` and the classifier on pooled features (..., D): float32 logits."""
        if self.fc_norm is not None:
            pooled_XD = self.fc_norm(pooled_XD)
        return self.head(pooled_XD).astype(jnp.float32)

    def classify_packed(self, x_BSD: jax.Array, segment_BT: jax.Array, slots: int) -> jax.Array:
        """``classify_features`` per image of a packed batch: float32 logits (B, U, V).

        Args:
          x_BSD: the last block's output, every slot's prefix tokens first
            (``embed_packed``).
          segment_BT: the tokens' slots, 1 to U, 0 for padding (``tokens.Packed``).
          slots: U.

        Returns:
          float32 logits (B, U, V): slot u's class token, or the mean of its own patch tokens.
        """
        if self.norm is not None:
            x_BSD = self.norm(x_BSD)
        prefix = slots * self.num_prefix
        if self.pool == "cls":  # slot u's class token is token u num_prefix
            pooled_BUD = x_BSD[:, 0 : prefix : self.num_prefix]
        else:
            own_BTU = segment_BT[..., None] == jnp.arange(1, slots + 1)[None, None]
            weight_BTU = own_BTU.astype(x_BSD.dtype)
            sum_BUD = jnp.einsum("BTU,BTD->BUD", weight_BTU, x_BSD[:, prefix:])
            count_BU1 = jnp.maximum(jnp.sum(weight_BTU, axis=1), 1)[..., None]
            pooled_BUD = sum_BUD / count_BU1
        return self._classify_pooled(pooled_BUD)

    def _add_table(self, x_BTD: jax.Array, grid: tuple[int, ...], num_prefix: int) -> jax.Array:
        params = {k: v[...] for k, v in self.additive_params.items()}
        emb_TD = encodings.ADDITIVE[self.additive].table(
            params, grid_shape=grid, width=x_BTD.shape[-1], num_prefix=num_prefix
        )
        return x_BTD + emb_TD.astype(x_BTD.dtype)[None]

    def positions(self, grid: Sequence[int]) -> jax.Array:
        """pos_TA of a token grid under ``position_convention``, prefix tokens at 0."""
        return positions.grid_positions(
            tuple(grid),
            self.position_convention,
            num_prefix=self.num_prefix,
            train_grid=self.train_grid,
            anchor_grid=self.train_grid,
            **dict(self.position_hparams),
        )

    def augmented_positions(self, grid: Sequence[int]) -> jax.Array:
        """Training positions under ``position_augment``, from the ``augment`` stream: RPE-2D's
        randomized positions (``randomize``, ``positions.randomize``) when asked for, then
        DINOv3's shift, jitter and rescale (``positions.augment``)."""
        settings = dict(self.position_augment)
        scale = settings.pop("randomize", None)
        key = self.augment_rngs.augment()
        if scale is None:
            pos_TA = self.positions(grid)
        else:
            key, key_random = jax.random.split(key)
            pos_TA = positions.randomize(
                key_random,
                tuple(grid),
                self.position_convention,
                scale=scale,
                num_prefix=self.num_prefix,
                train_grid=self.train_grid,
                anchor_grid=self.train_grid,
                **dict(self.position_hparams),
            )
        return positions.augment(key, pos_TA, num_prefix=self.num_prefix, **settings)

    def pe_states(
        self,
        pos_TA: jax.Array,
        scaling: extrapolation_lib.Scaling | None = None,
        *,
        num_prefix: int | None = None,
    ) -> list[State]:
        """One encoder state per block (``position_hook.precompute_pe``, ``encodings/state.py``).
        Layers that share parameters share one state, so shared generators cost one exponential
        per step, not one per layer; layers with their own parameters are computed one by one
        or together, by platform (``position_hook.LAYER_PLANS``). ``scaling``: an extrapolation
        tool (``precompute_pe``); ``num_prefix``: the prefix tokens when not the model's (a
        packed row's, U of them per image slot)."""
        kwargs = dict(scaling=scaling, num_prefix=num_prefix)
        if self.pe_params is not None:  # shared across layers
            state = self.blocks[0].attn.pe_state(pos_TA, pe_params=self.pe_params, **kwargs)
            return [state] * len(self.blocks)
        attn = self.blocks[0].attn
        return position_hook.layer_states(
            attn.encoder,
            [block.attn.pe_arrays() for block in self.blocks],
            pos_TA,
            num_prefix=attn.num_prefix if num_prefix is None else num_prefix,
            fold=attn.fold_mix,
            scaling=scaling,
        )

    def precompute_pe(
        self, grid: Sequence[int], extrapolation: str | None = None
    ) -> position_hook.PECache:
        """Encoder states at a token grid, to pass as ``pe_cache`` (evaluation at a resolution).

        They depend on the encoder parameters and the grid only, so an evaluation loop computes
        them once per resolution (e.g. ``jax.jit(model.precompute_pe, static_argnums=0)`` after
        ``nnx.split``/``merge``) and every batch then costs what a model with a cheap encoder
        does. Gradients do not flow into a cache computed outside the loss.

        Args:
          grid: tokens per axis, e.g. ``model.input_grid(images)``.
          extrapolation: None, or a tool for a grid larger than the training grid
            (``encodings/extrapolation.py``: ``"pi"``, ``"ntk"``, ``"yarn"``, ``"logit"``,
            ``"pi+logit"``, ``"ntk+logit"``), resolved from ``train_grid``; no retraining.

        Returns:
          the per-block states with their grid (``position_hook.PECache``, a sequence of
          states): a model given it for images of another grid refuses it.
        """
        grid = tuple(int(n) for n in grid)
        scaling = None
        if extrapolation is not None:
            scaling = extrapolation_lib.resolve(
                extrapolation,
                family=self.pe,
                grid=grid,
                train_grid=self.train_grid,
                convention=self.position_convention,
                num_prefix=self.num_prefix,
            )
        states = self.pe_states(self.positions(grid), scaling)
        return position_hook.PECache(tuple(states), grid)

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
    ) -> jax.Array:
        """Classify a batch at any resolution divisible by the patch size.

        Args:
          images: (B, H, W, C) or (B, D, H, W, C), matching ``image_shape``'s rank.
          train: apply dropout (uses the ``dropout`` RNG stream).
          pe_cache: ``precompute_pe(self.input_grid(images))`` computed beforehand (refused
            for another grid), a list of states of your own positions (``pe_states(pos_TA)``,
            unchecked), or None to compute the encoder states here.

        Returns:
          float32 logits (B, V).
        """
        x_BTD, states = self._image_inputs(images, train=train, pe_cache=pe_cache)
        return self.classify_features(self._blocks_forward(x_BTD, states, train=train))

    def _image_inputs(
        self, images: jax.Array, *, train: bool, pe_cache: Sequence[State] | None
    ) -> tuple[jax.Array, list[State]]:
        """A batch of images' embedded tokens (prefix tokens first) and block states: from
        ``pe_cache``, augmented positions in training (``position_augment``), or the grid's."""
        grid = self.input_grid(images)
        if isinstance(pe_cache, position_hook.PECache) and pe_cache.grid != tuple(grid):
            raise ValueError(
                f"pe_cache was computed for the token grid {pe_cache.grid}, the images make "
                f"{tuple(grid)} (use model.precompute_pe(model.input_grid(images)))"
            )
        if pe_cache is not None:
            states = list(pe_cache)
        elif train and self.position_augment:
            states = self.pe_states(self.augmented_positions(grid))
        else:
            states = self.precompute_pe(grid)
        if len(states) != len(self.blocks):
            raise ValueError(
                f"pe_cache has {len(states)} block states, the model has {len(self.blocks)} "
                "blocks (use model.precompute_pe(grid))"
            )
        x_BTD = self.embed_dropout(self.embed_tokens(images, grid), deterministic=not train)
        return x_BTD, states

    def features(
        self,
        inputs: jax.Array | tokens.Tokens | tokens.Packed,
        *,
        layers: int | Sequence[int] = 1,
        norm: bool = False,
        reshape: bool = False,
        train: bool = False,
        pe_cache: Sequence[State] | None = None,
    ) -> Features:
        """Dense and intermediate features: the patch tokens and prefix tokens of chosen layers.

        What DINOv3's ``get_intermediate_layers(x, n, reshape, return_class_token, norm)`` and
        timm's ``forward_intermediates(x, indices, norm, output_fmt, return_prefix_tokens)``
        return, from the same forward pass as ``__call__`` (the same embedding, states and
        block loop; the loop stops after the last layer asked for).

        Args:
          inputs: images as ``__call__`` takes them, or a token batch as ``classify_tokens``
            takes it (``tokens.Tokens`` or ``tokens.Packed``; every slot kept: no patch
            dropout).
          layers: an int n: the last n layers (DINOv3's ``n``; 1, the default: the last); or
            a sequence of layer indices, negative ones from the end (timm's ``indices``).
          norm: apply the model's final LayerNorm (``final_norm``) to every output, prefix
            tokens included, as both do; an error for a model without one.
          reshape: patch tokens as (B, *grid, D), channels last (DINOv3's ``reshape`` and
            timm's ``NCHW`` put D first: ``jnp.moveaxis(x, -1, 1)``); images only.
          train: apply dropout (and ``position_augment``'s positions), as ``__call__``.
          pe_cache: as ``__call__`` (images only).

        Returns:
          ``Features``: per layer, in the order asked for, ``patch`` (B, T, D) (or (B, *grid,
          D)) and ``prefix`` (B, num_prefix, D): the class token, then the registers. For a
          ``Packed`` batch ``patch`` is (B, T, D) (the batch's ``segment_BT`` says whose) and
          ``prefix`` (B, U, num_prefix, D), per image slot.
        """
        take = self._layer_indices(layers)
        if norm and self.norm is None:
            raise ValueError(
                "features(norm=True) needs the final norm; this model has "
                "final_norm=False (apply its fc_norm to a pooled feature instead)"
            )
        slots = None
        if isinstance(inputs, (tokens.Tokens, tokens.Packed)):
            if reshape or pe_cache is not None:
                raise ValueError(
                    "features of a token batch take neither reshape=True (its examples have "
                    f"their own grids) nor a pe_cache; got reshape={reshape}, "
                    f"pe_cache={'given' if pe_cache is not None else None}"
                )
            if isinstance(inputs, tokens.Packed):
                x_BTD, states, masks = self._packed_inputs(inputs, train=train)
                slots = inputs.grid_BUA.shape[1]
            else:
                x_BTD, states, masks = self._token_inputs(inputs, train=train)
            grid = None
        else:
            x_BTD, states = self._image_inputs(inputs, train=train, pe_cache=pe_cache)
            masks, grid = {}, self.input_grid(inputs)
        outputs = self._blocks_forward(x_BTD, states, train=train, take=sorted(set(take)), **masks)
        by_layer = dict(zip(sorted(set(take)), outputs, strict=True))
        patch, prefix = [], []
        num_prefix = self.num_prefix * (1 if slots is None else slots)
        for index in take:
            y_BTD = self.norm(by_layer[index]) if norm else by_layer[index]
            patch_BTD, prefix_BPD = y_BTD[:, num_prefix:], y_BTD[:, :num_prefix]
            if reshape:
                patch_BTD = patch_BTD.reshape(patch_BTD.shape[0], *grid, patch_BTD.shape[-1])
            if slots is not None:  # (B, U, P, D)
                prefix_BPD = prefix_BPD.reshape(
                    y_BTD.shape[0], slots, self.num_prefix, y_BTD.shape[-1]
                )
            patch.append(patch_BTD)
            prefix.append(prefix_BPD)
        return Features(patch=tuple(patch), prefix=tuple(prefix))

    def _layer_indices(self, layers: int | Sequence[int]) -> list[int]:
        """``features``' ``layers`` as absolute block indices, in the order asked for."""
        depth = len(self.blocks)
        if isinstance(layers, numbers.Integral) and not isinstance(layers, bool):
            if not 1 <= layers <= depth:
                raise ValueError(f"layers={layers} (the last n) must be in [1, {depth}]")
            return list(range(depth - int(layers), depth))
        if isinstance(layers, (str, bool)) or not isinstance(layers, Sequence) or not layers:
            raise ValueError(
                f"layers={layers!r} must be an int n (the last n layers) or a non-empty "
                "sequence of layer indices"
            )
        indices = []
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
                raise ValueError(f"layers={list(layers)}: {layer!r} is not a layer index")
            if not -depth <= layer < depth:
                raise ValueError(
                    f"layers={list(layers)}: index {layer} is outside [-{depth}, {depth - 1}] "
                    f"(the model has {depth} blocks)"
                )
            indices.append(int(layer) % depth)
        return indices


def config_fields() -> frozenset[str]:
    """The fields a ``config.model`` may hold: ``ViT``'s keyword arguments but ``rngs``."""
    return frozenset(inspect.signature(ViT.__init__).parameters) - {"self", "rngs"}


def check_config_fields(model_cfg: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming every field of `model_cfg` that is not a ViT argument (with
    the closest argument's name), as a field of a newer rope_lie or a misspelt one."""
    known = config_fields()
    unknown = sorted(set(model_cfg) - known)
    if not unknown:
        return
    close = {k: difflib.get_close_matches(k, sorted(known), n=1) for k in unknown}
    hints = "".join(f"; {k}: did you mean {m[0]!r}?" for k, m in close.items() if m)
    raise ValueError(
        f"config.model has {unknown}, which this rope_lie's ViT does not take: a field of a "
        "newer rope_lie (the workdir or config was written by one: load or resume it with that "
        f"version), or not a ViT argument (rope_lie/models/vit.py){hints}"
    )


def from_config(model_cfg: Mapping[str, Any], *, rngs: nnx.Rngs) -> ViT:
    """The ViT of a ``config.model`` (its keyword arguments), its fields checked first
    (``check_config_fields``)."""
    check_config_fields(model_cfg)
    return ViT(**model_cfg, rngs=rngs)
