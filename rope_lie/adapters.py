"""Any rope_lie encoder in someone else's Flax attention, in one line.

Both adapters are an ``attention_fn`` that owns the encoder's parameters, computes its state
once per call (``encodings/state.py``), rotates q and k (never v), adds ALiBi's bias, and then
runs Flax's own ``dot_product_attention``:

    # NNX
    attn = nnx.MultiHeadAttention(
        num_heads=6, in_features=384, decode=False, rngs=rngs,
        attention_fn=adapters.NNXAttention("liere", num_heads=6, head_dim=64, grid=(14, 14),
                                           num_prefix=1, rngs=rngs, block_size=8),
    )
    # Linen, inside a module
    attn = nn.MultiHeadDotProductAttention(
        num_heads=6,
        attention_fn=adapters.LinenAttention("liere", num_heads=6, head_dim=64, grid=(14, 14),
                                             num_prefix=1, settings={"block_size": 8}),
    )

``grid`` is the token grid of the inputs (rows, cols) or (time, rows, cols), after
``num_prefix`` prefix tokens (class, registers) at position 0; the positions follow the
family's reference convention (``Family.convention``) unless ``convention`` says otherwise, or
come as ``positions`` directly (``pos_TA`` or ``pos_BTA``). Both keep the inputs' layout, Flax's
(batch, length, heads, head_dim). A position-independent P (Cayley-STRING, ComRoPE) is applied
to every token here, as the reference codes do; rope_lie's own ViT folds it into its q/k
projections instead (``docs/encoders.md``, section 3): the same logits to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from rope_lie import encodings
from rope_lie.encodings import positions as positions_lib
from rope_lie.models import position_hook
from rope_lie.models.position_hook import PositionParam


def num_axes_of(name: str, grid: Sequence[int] | None, positions: jax.Array | None) -> int:
    """A, from the grid or the positions: exactly one of them is given."""
    if (grid is None) == (positions is None):
        raise ValueError(
            f"{name}: give the token grid or the positions, one of them; got "
            f"grid={grid!r}, positions={'None' if positions is None else 'an array'}"
        )
    return len(grid) if grid is not None else int(jnp.shape(positions)[-1])


def token_positions(
    encoder: encodings.Encoder,
    *,
    grid: Sequence[int] | None,
    num_prefix: int,
    convention: str | None,
    positions: jax.Array | None,
) -> jax.Array:
    """``pos_TA`` (or the ``pos_BTA`` given) of an adapter: from ``grid`` under the family's
    convention, or ``positions`` as given (then ``grid`` and ``convention`` must be None)."""
    num_axes_of(encoder.name, grid, positions)
    if positions is not None:
        if convention is not None:
            raise ValueError(f"convention={convention!r} is for a grid; positions were given")
        return jnp.asarray(positions, jnp.float32)
    return positions_lib.grid_positions(
        grid, convention or encoder.convention, num_prefix=num_prefix
    )


def attend(
    encoder: encodings.Encoder,
    params: Mapping[str, jax.Array],
    pos: jax.Array,
    num_prefix: int,
    attention_fn,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    **kwargs,
) -> jax.Array:
    """Flax's ``attention_fn(q', k', value, bias', ...)`` with q and k encoded by ``encoder``.

    Args:
      encoder: the encoder (``encodings.encoder``).
      params: its parameters.
      pos: token positions ``pos_TA`` or ``pos_BTA``.
      num_prefix: prefix tokens at the start (for ALiBi's zero rows and columns).
      attention_fn: ``nnx.dot_product_attention`` or ``nn.dot_product_attention``.
      query, key, value: (B, T, N, H) as Flax's attention modules pass them.
      bias: the caller's logit bias, or None.
      **kwargs: the rest of Flax's arguments (mask, dropout, dtype, ...), passed on.

    Returns:
      the attention output (B, T, N, H).
    """
    if query.ndim != 4 or query.shape[1] != pos.shape[-2]:
        raise ValueError(
            f"{encoder.name}: the adapter's positions have T={pos.shape[-2]} tokens, but the "
            f"queries have shape {tuple(query.shape)} (B, T, N, H); build the adapter with the "
            "inputs' grid and num_prefix"
        )
    state = encoder.precompute(params, pos, num_prefix=num_prefix)
    query, key = state.rotate(query), state.rotate(key)
    if state.bias_BNTS is not None:
        pe_bias = state.bias_BNTS.astype(query.dtype)
        bias = pe_bias if bias is None else bias + pe_bias
    return attention_fn(query, key, value, bias=bias, **kwargs)


class NNXAttention(nnx.Module):
    """An ``attention_fn`` for ``nnx.MultiHeadAttention`` with a rope_lie encoder on q and k.

    Its parameters are ``PositionParam`` variables (``nnx.Param``s) of this module, so of the
    attention holding it: ``rope_lie.optim``'s weight-decay mask leaves them alone, as in
    rope_lie's own ViT, and ``nnx.state(model, PositionParam)`` selects them.
    """

    def __init__(
        self,
        name: str,
        *,
        num_heads: int,
        head_dim: int,
        grid: Sequence[int] | None = None,
        num_prefix: int = 0,
        convention: str | None = None,
        positions: jax.Array | None = None,
        share_heads: bool = False,
        rngs: nnx.Rngs,
        **settings: Any,
    ):
        """Build the encoder and its parameters.

        Args:
          name: a rotary or bias family (``encodings.ROTARY``, ``encodings.BIAS``).
          num_heads: N of the attention.
          head_dim: H.
          grid: the token grid after the prefix tokens; or None with ``positions``.
          num_prefix: prefix tokens (class, registers) at the start, at position 0.
          convention: positions' convention; None: the family's reference convention.
          positions: ``pos_TA`` or ``pos_BTA`` instead of a grid.
          share_heads: one set of parameters for all heads.
          rngs: ``nnx.Rngs`` with a ``params`` (or default) stream.
          **settings: the family's ``init`` settings.
        """
        self.encoder = encodings.encoder(
            name,
            num_heads=position_hook.encoder_heads(name, num_heads, share_heads, settings),
            head_dim=head_dim,
            num_axes=num_axes_of(name, grid, positions),
            **settings,
        )
        self.num_prefix = num_prefix
        self.pos = nnx.data(
            token_positions(
                self.encoder,
                grid=grid,
                num_prefix=num_prefix,
                convention=convention,
                positions=positions,
            )
        )
        arrays = self.encoder.init(rngs.params())
        self.params = nnx.Dict({k: PositionParam(v) for k, v in arrays.items()})

    def __call__(self, query, key, value, bias=None, mask=None, **kwargs) -> jax.Array:
        params = {k: v[...] for k, v in self.params.items()}
        return attend(
            self.encoder,
            params,
            self.pos,
            self.num_prefix,
            nnx.dot_product_attention,
            query,
            key,
            value,
            bias=bias,
            mask=mask,
            **kwargs,
        )


class LinenAttention(nn.Module):
    """An ``attention_fn`` for Linen's ``MultiHeadDotProductAttention`` with a rope_lie encoder.

    Its parameters are one Linen param, ``"pe"`` (a dict of the family's arrays), of this module.
    Leave them out of weight decay (a mask that is False under ``"pe"``): decay pulls the
    rotations towards the identity, i.e. towards NoPE.

    Attributes:
      family: a rotary or bias family (``encodings.ROTARY``, ``encodings.BIAS``).
      num_heads: N of the attention.
      head_dim: H.
      grid: the token grid after the prefix tokens; or None with ``positions``.
      num_prefix: prefix tokens (class, registers) at the start, at position 0.
      convention: positions' convention; None: the family's reference convention.
      positions: ``pos_TA`` or ``pos_BTA`` instead of a grid.
      share_heads: one set of parameters for all heads.
      settings: the family's ``init`` settings.
    """

    family: str
    num_heads: int
    head_dim: int
    grid: tuple[int, ...] | None = None
    num_prefix: int = 0
    convention: str | None = None
    positions: Any = None
    share_heads: bool = False
    settings: Mapping[str, Any] | None = None

    def _encoder(self) -> encodings.Encoder:
        return encodings.encoder(
            self.family,
            num_heads=position_hook.encoder_heads(
                self.family, self.num_heads, self.share_heads, self.settings
            ),
            head_dim=self.head_dim,
            num_axes=num_axes_of(self.family, self.grid, self.positions),
            **dict(self.settings or {}),
        )

    # Linen's attention passes only the arguments an attention_fn names in its signature, so
    # every one of nn.dot_product_attention's is named here (a **kwargs would drop dropout).
    @nn.compact
    def __call__(
        self,
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout=True,
        dropout_rng=None,
        dropout_rate=0.0,
        deterministic=False,
        dtype=None,
        precision=None,
        module=None,
        force_fp32_for_softmax=False,
        qk_attn_weights_einsum=None,
        attn_weights_value_einsum=None,
    ) -> jax.Array:
        encoder = self._encoder()
        params = self.param("pe", encoder.init)
        pos = token_positions(
            encoder,
            grid=self.grid,
            num_prefix=self.num_prefix,
            convention=self.convention,
            positions=self.positions,
        )
        return attend(
            encoder,
            params,
            pos,
            self.num_prefix,
            nn.dot_product_attention,
            query,
            key,
            value,
            bias=bias,
            mask=mask,
            broadcast_dropout=broadcast_dropout,
            dropout_rng=dropout_rng,
            dropout_rate=dropout_rate,
            deterministic=deterministic,
            dtype=dtype,
            precision=precision,
            module=module,
            force_fp32_for_softmax=force_fp32_for_softmax,
            qk_attn_weights_einsum=qk_attn_weights_einsum,
            attn_weights_value_einsum=attn_weights_value_einsum,
        )
