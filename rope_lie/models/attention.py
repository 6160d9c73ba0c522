"""Multi-head self-attention with one position-encoding hook.

    q_BTNH = x_BTD w_DNH + b_NH   (likewise k, v)
    q, k <- R(p) q, R(p) k         rotary families (``encodings.ROTARY``); v is never rotated
    o_BTNH = softmax(q k^T / sqrt(H) + bias_NTS) v   bias families (``encodings.BIAS``, ALiBi)
    y_BTD = o_BTNH w_NHD + b_D

The hook lives in ``position_hook.py`` and is one contract for every family
(``docs/encoders.md``): the family's ``precompute(params, pos, ...)`` gives its encoder *state*
(``encodings/state.py``), everything that depends on the positions and parameters only
(RoPE's angles, LieRE's rotations, Cayley-STRING's angles and P, ALiBi's bias); the attention
folds the state's ``fold_NHH`` into the q/k projections when it has one, applies
``state.rotate`` to q and to k, and adds ``state.bias_BNTS`` to the logits when it has one. The
``ViT`` builds the states once per call (once for all layers when the layers share parameters,
so shared generators share their exponentials), or takes them from a cache per resolution at
evaluation (``ViT.precompute_pe``); ``Attention`` builds its own when given none. q and k are
rotated separately: concatenating them along the batch costs more in the backward pass than it
would share, even for NoPE (benchmarks README, section 14).

Attention itself is one function of (q, k, v, bias, key mask), chosen by the ``attention``
argument (``config.model.attention``) from the one table of backends, ``backends.BACKENDS``,
which also says where each runs and what it needs (checked before the first step,
``backends.check_attention``): the formula ``"xla"`` (default), ``"cudnn"``, ``"pallas"``,
``"chunked"``, and ``"xla_cpu"``, the formula with an inference batch cut for one CPU device,
which the evaluation step chooses there (``set_inference_backends``).

Encoder parameters live in ``PositionParam`` variables (an ``nnx.Param`` subclass, so that the
optimizer can exclude them from weight decay by type). Sharing is decided by config:

- per layer and per head (the default, as in the LieRE paper): every ``Attention`` owns its
  parameters, initialised for ``num_heads`` heads;
- ``share_pe_heads``: the family is initialised with ``num_heads=1``; its state (N = 1)
  broadcasts over the heads, so all heads use the same rotation;
- shared across layers: the ``ViT`` owns one set and passes it to every block
  (``Attention(..., own_pe=False)`` and ``__call__(..., pe_params=...)``).

One code path either way: ``__call__`` uses the state passed in, or builds it from the
parameters passed in, or from its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rope_lie.encodings.state import State
from rope_lie.models import backends, xla_attention
from rope_lie.models.position_hook import (
    fold_projection,
    init_pe_params,
    pe_encoder,
    precompute_pe,
)


def project(x_BTD: jax.Array, w_DNH: jax.Array, b_NH: jax.Array) -> jax.Array:
    """Per-head projection ``x w + b`` in x's dtype (parameters are stored in float32).

    Args:
      x_BTD: tokens.
      w_DNH: weights.
      b_NH: biases.

    Returns:
      (B, T, N, H) array in x's dtype.
    """
    w_DNH, b_NH = w_DNH.astype(x_BTD.dtype), b_NH.astype(x_BTD.dtype)
    return jnp.einsum("BTD,DNH->BTNH", x_BTD, w_DNH) + b_NH[None, None]


def _arrays(params: Mapping[str, Any]) -> dict[str, jax.Array]:
    """Encoder parameters (``PositionParam`` variables or arrays) as a dict of arrays."""
    return {name: jnp.asarray(value[...]) for name, value in params.items()}


def xavier_uniform(in_axis, out_axis) -> jax.nn.initializers.Initializer:
    """Glorot-uniform init over the given fan-in/fan-out axes (the ViT reference's init)."""
    return jax.nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis, out_axis)


class Attention(nnx.Module):
    """Multi-head self-attention with the position-encoding hook (see the module docstring)."""

    def __init__(
        self,
        width: int,
        num_heads: int,
        *,
        num_axes: int,
        pe: str = "nope",
        pe_hparams: Mapping[str, Any] | None = None,
        share_pe_heads: bool = False,
        own_pe: bool = True,
        num_prefix: int = 0,
        qkv_bias: bool = True,
        attention: str = "xla",
        fold_mix: bool = True,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        """Build the projections and, when ``own_pe``, this layer's encoder parameters.

        Args:
          width: D, model width; divisible by ``num_heads``.
          num_heads: N; the head dimension is H = D / N.
          num_axes: A, position axes of the token grid (1, 2 or 3).
          pe: rotary or bias family (``pe_names()``).
          pe_hparams: the family's ``init`` keyword arguments (``self.encoder`` holds them all,
            and ``precompute`` uses them).
          share_pe_heads: one set of encoder parameters for all heads.
          own_pe: False when the parameters are shared across layers and passed to
            ``__call__`` by the caller.
          num_prefix: prefix (class) tokens at the start of the sequence (for bias families).
          qkv_bias: biases on the q, k, v projections (False: none, as the LieRE reference's
            ``to_qkv``); the output projection always has one.
          attention: the attention backend, a ``backends.BACKENDS`` key (``"xla"``,
            ``"cudnn"``, ``"pallas"``, ``"chunked"``, ``"xla_cpu"``): where each runs and what
            it needs is in that table (``backends.check_attention``).
          fold_mix: fold a position-independent P (Cayley-STRING) into the q/k projections
            (default); False applies it to every token's q and k (``precompute_pe``'s
            ``fold``): the same logits, for benchmarks against the reference's way.
          dtype: activation dtype; parameters are float32.
          rngs: ``nnx.Rngs`` with a ``params`` (or default) stream.
        """
        if width % num_heads:
            raise ValueError(f"width={width} is not divisible by num_heads={num_heads}")
        backends.check_attention_name(attention)
        self.attention = attention
        self.fold_mix = bool(fold_mix)
        self.pe = pe
        self.num_heads = num_heads
        self.head_dim = head_dim = width // num_heads
        self.share_pe_heads = share_pe_heads
        self.num_prefix = num_prefix
        # Every setting of the family in one hashable value, static as nnx graph definitions
        # require: what init is given is what precompute uses.
        self.encoder = pe_encoder(
            pe,
            num_heads=num_heads,
            head_dim=head_dim,
            num_axes=num_axes,
            share_heads=share_pe_heads,
            hparams=pe_hparams,
        )
        self.dtype = dtype
        init_in, shape_DNH = xavier_uniform(0, (1, 2)), (width, num_heads, head_dim)
        self.wq_DNH = nnx.Param(init_in(rngs.params(), shape_DNH))
        self.wk_DNH = nnx.Param(init_in(rngs.params(), shape_DNH))
        self.wv_DNH = nnx.Param(init_in(rngs.params(), shape_DNH))
        # data: hold a Param when qkv_bias, None otherwise
        self.bq_NH, self.bk_NH, self.bv_NH = nnx.data(None), nnx.data(None), nnx.data(None)
        if qkv_bias:
            self.bq_NH, self.bk_NH, self.bv_NH = (
                nnx.Param(jnp.zeros((num_heads, head_dim))) for _ in range(3)
            )
        init_out = xavier_uniform((0, 1), 2)
        self.wo_NHD = nnx.Param(init_out(rngs.params(), (num_heads, head_dim, width)))
        self.bo_D = nnx.Param(jnp.zeros((width,)))
        self.pe_params = nnx.data(None)  # data: may hold a Dict of PositionParam below
        if own_pe:
            self.pe_params = init_pe_params(self.encoder, rngs.params())

    def pe_arrays(self) -> dict[str, jax.Array]:
        """This layer's own encoder parameters as arrays (empty without own parameters)."""
        return {} if self.pe_params is None else _arrays(self.pe_params)

    def pe_state(
        self,
        pos: jax.Array,
        *,
        pe_params: Mapping[str, Any] | None = None,
        scaling=None,
        num_prefix: int | None = None,
    ) -> State:
        """This layer's encoder state (``precompute_pe``) at positions ``pos``.

        Args:
          pos: ``pos_TA`` (or ``pos_BTA`` for rotary families); prefix tokens at position 0.
          pe_params: encoder parameters shared across layers (a mapping of ``PositionParam``
            or arrays); None uses this layer's own.
          scaling: None, or an extrapolation tool at an evaluation grid
            (``encodings.extrapolation.resolve``, ``ViT.precompute_pe``).
          num_prefix: prefix tokens at the start of the sequence; None: the layer's own (a
            packed row holds every image's, ``ViT.classify_tokens``).

        Returns:
          the family's state (``encodings/state.py``), a pytree of arrays.
        """
        if (pe_params is None) == (self.pe_params is None):
            raise ValueError(
                "Attention needs encoder parameters from exactly one place: its own "
                f"(own_pe=True) or pe_params passed to __call__; own={self.pe_params is not None}, "
                f"passed={pe_params is not None}"
            )
        params = self.pe_arrays() if pe_params is None else _arrays(pe_params)
        return precompute_pe(
            self.encoder,
            params,
            pos,
            fold=self.fold_mix,
            scaling=scaling,
            num_prefix=self.num_prefix if num_prefix is None else num_prefix,
        )

    def __call__(
        self,
        x_BTD: jax.Array,
        pos: jax.Array | None,
        *,
        pe_params: Mapping[str, Any] | None = None,
        pe_state: State | None = None,
        key_mask_BS: jax.Array | None = None,
        segment_BS: jax.Array | None = None,
    ) -> jax.Array:
        """Attend.

        Args:
          x_BTD: tokens, prefix tokens first.
          pos: ``pos_TA`` (or ``pos_BTA`` for rotary families); prefix tokens at position 0.
            Unused (may be None) when ``pe_state`` is given.
          pe_params: encoder parameters shared across layers (a mapping of ``PositionParam``
            or arrays); None uses this layer's own.
          pe_state: a precomputed encoder state (``pe_state``/``precompute_pe``) to use instead
            of building one from parameters and positions; excludes ``pe_params``.
          key_mask_BS: None, or (B, S) with 0 at padded keys: no token attends to them (a
            logit bias for "xla", "xla_cpu" and "chunked", ``with_key_mask``; sequence lengths
            for "cudnn", segment ids for "pallas").
          segment_BS: None, or int (B, S): the segment (image) of each token of a packed batch
            (``tokens.Packed``, padding in segment 0); a token attends only to the keys of its
            own segment (a logit bias for "xla" and "xla_cpu", per key block for "chunked",
            segment ids for "pallas"; "cudnn" refuses it).

        Returns:
          (B, T, D) array in the activation dtype.
        """
        q_BTNH, k_BTNH, v_BTNH, bias = self.qkv(x_BTD, pos, pe_params=pe_params, pe_state=pe_state)
        o_BTNH = backends.BACKENDS[self.attention].attend(
            q_BTNH, k_BTNH, v_BTNH, bias, key_mask_BS, segment_BS
        )
        y_BTD = jnp.einsum("BTNH,NHD->BTD", o_BTNH, self.wo_NHD[...].astype(self.dtype))
        return y_BTD + self.bo_D[...].astype(self.dtype)[None, None]

    def probs(self, x_BTD: jax.Array, pe_state: State) -> jax.Array:
        """The attention weights (B, N, T, T) of ``__call__`` (float32), e.g. for attention maps."""
        q_BTNH, k_BTNH, _, bias = self.qkv(x_BTD, None, pe_state=pe_state)
        return xla_attention.attention_probs(q_BTNH, k_BTNH, bias)

    def _bias(self, b_NH: nnx.Param | None) -> jax.Array:
        """A projection's bias, zeros when the layer has none (``qkv_bias=False``)."""
        if b_NH is None:
            return jnp.zeros((self.num_heads, self.head_dim), jnp.float32)
        return b_NH[...]

    def qkv(
        self,
        x_BTD: jax.Array,
        pos: jax.Array | None,
        *,
        pe_params: Mapping[str, Any] | None = None,
        pe_state: State | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """Queries and keys with the position encoding applied, values, and the logit bias.

        Arguments as ``__call__``. Returns (q_BTNH, k_BTNH, v_BTNH, bias or None).
        """
        if pe_state is None:
            pe_state = self.pe_state(pos, pe_params=pe_params)
        elif pe_params is not None:
            raise ValueError("Attention takes pe_params or pe_state, not both")
        x_BTD = x_BTD.astype(self.dtype)
        wq, wk, wv = self.wq_DNH[...], self.wk_DNH[...], self.wv_DNH[...]
        bq, bk, bv = (self._bias(b) for b in (self.bq_NH, self.bk_NH, self.bv_NH))
        if pe_state.fold_NHH is not None:  # a position-independent P: fold it, never per token
            (wq, bq), (wk, bk) = (
                fold_projection(pe_state.fold_NHH, w, b) for w, b in ((wq, bq), (wk, bk))
            )
        q_BTNH = pe_state.rotate(project(x_BTD, wq, bq))
        k_BTNH = pe_state.rotate(project(x_BTD, wk, bk))
        v_BTNH = project(x_BTD, wv, bv)
        bias = pe_state.bias_BNTS
        bias = None if bias is None else bias.astype(self.dtype)
        return q_BTNH, k_BTNH, v_BTNH, bias


def set_inference_backends(model: nnx.Module, platform: str, device_count: int) -> None:
    """Give every ``Attention`` of ``model`` its backend's inference choice on this host.

    ``backends.inference_backend``: on one CPU device the formula ``"xla"`` becomes
    ``"xla_cpu"``, which cuts an evaluation batch into chunks (the same logits to float32
    rounding); every other backend stays. Call it outside ``jit``, on the model an evaluation
    step is made from (``train.make_eval_fn``): the graph then holds the choice.

    Args:
      model: an NNX module holding ``Attention`` layers (a ``ViT``); changed in place.
      platform: where the step runs (``jax.default_backend()``, or an export target).
      device_count: devices of the step's mesh.
    """
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Attention):
            module.attention = backends.inference_backend(module.attention, platform, device_count)


def check_backends(model: nnx.Module, platform: str, *, packed: bool = False) -> None:
    """``backends.check_attention`` for every ``Attention`` of ``model`` on ``platform``.

    Call it before the first step, on the model as built (``nnx.eval_shape`` of it will do):
    its layers hold the backend, the activation dtype and head_dim, so nothing is worked out
    from the config again. ``packed``: the run trains on packed batches (``naflex.pack``).
    """
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Attention):
            backends.check_attention(
                module.attention,
                platform=platform,
                dtype=module.dtype,
                head_dim=module.head_dim,
                packed=packed,
            )
