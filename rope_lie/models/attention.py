"""Multi-head self-attention with one position-encoding hook.

    q_BTNH = x_BTD w_DNH + b_NH   (likewise k, v)
    q, k <- R(p) q, R(p) k         rotary families (``encodings.ROTARY``); v is never rotated
    o_BTNH = softmax(q k^T / sqrt(H) + bias_NTS) v   bias families (``encodings.BIAS``, ALiBi)
    y_BTD = o_BTNH w_NHD + b_D

Everything the hook needs that depends on the positions only is the encoder *state*
(``precompute_pe``): a family's ``precompute(params, pos)`` where it has one (LieRE's rotations,
RoPE-Mixed's angles), or its ``precompute_folded`` (Cayley-STRING: P, folded into the q/k
projection weights at every step, and the angles), the bias of a bias family, or else the
parameters and positions themselves. The ``ViT`` builds the states once per call (once for all
layers when the layers share parameters, so shared generators share their exponentials), or
takes them from a cache per resolution at evaluation (``ViT.precompute_pe``); ``Attention``
builds its own when given none. Without ``precompute`` (families whose rotations are cheap to
rebuild), ``apply`` runs on q and on k separately: concatenating them along the batch costs more
in the backward pass than the angles it would share (measured: ~300 ms of a 2.5 s ViT-Ti train
step on CPU, even for NoPE). Attention itself is ``attend``: the XLA path of
``jax.nn.dot_product_attention`` written out (see its docstring).

Encoder parameters live in ``PositionParam`` variables (an ``nnx.Param`` subclass, so that the
optimizer can exclude them from weight decay by type). Sharing is decided by config:

- per layer and per head (the default, as in the LieRE paper): every ``Attention`` owns its
  parameters, initialised for ``num_heads`` heads;
- ``share_pe_heads``: the family is initialised with ``num_heads=1`` and applied with the heads
  folded into the batch, (B, T, N, H) -> (N*B, T, 1, H), so all heads use the same rotation;
- shared across layers: the ``ViT`` owns one set and passes it to every block
  (``Attention(..., own_pe=False)`` and ``__call__(..., pe_params=...)``).

One code path either way: ``__call__`` uses the state passed in, or builds it from the
parameters passed in, or from its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rope_lie import encodings


class PositionParam(nnx.Param):
    """A position-encoding parameter (rotary frequencies/generators, ALiBi slopes, APE tables).

    A subclass of ``nnx.Param`` so that ``nnx.state(model, PositionParam)`` selects exactly the
    encoder parameters (e.g. to exclude them from weight decay).
    """


def pe_names() -> list[str]:
    """The valid values of ``pe``: every rotary and bias family."""
    return sorted(encodings.ROTARY) + sorted(encodings.BIAS)


def pe_module(pe: str) -> ModuleType:
    """The encoder module of a rotary or bias family.

    Args:
      pe: a key of ``encodings.ROTARY`` or ``encodings.BIAS``.

    Returns:
      the family's module (``init``/``apply`` or ``init``/``bias``).
    """
    if pe in encodings.ROTARY:
        return encodings.ROTARY[pe]
    if pe in encodings.BIAS:
        return encodings.BIAS[pe]
    raise ValueError(f"unknown pe={pe!r}; expected one of {pe_names()}")


def init_pe_params(
    pe: str,
    key: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_axes: int,
    share_heads: bool,
    hparams: Mapping[str, Any] | None = None,
) -> nnx.Dict:
    """Initialise one set of encoder parameters as ``PositionParam`` variables.

    Args:
      pe: family name (``pe_names()``).
      key: PRNG key.
      num_heads: N; the family is initialised with 1 head when ``share_heads``.
      head_dim: H.
      num_axes: A, position axes of the token grid.
      share_heads: one set of parameters for all heads.
      hparams: keyword arguments of the family's ``init``.

    Returns:
      ``nnx.Dict`` of ``PositionParam`` holding the family's arrays (empty for parameter-free
      families).
    """
    arrays = pe_module(pe).init(
        key,
        num_heads=1 if share_heads else num_heads,
        head_dim=head_dim,
        num_axes=num_axes,
        **dict(hparams or {}),
    )
    return nnx.Dict({name: PositionParam(value) for name, value in arrays.items()})


def apply_hparams(pe: str, hparams: Mapping[str, Any] | None) -> dict[str, Any]:
    """The subset of ``hparams`` that the family's ``apply``/``bias`` also takes."""
    names = getattr(pe_module(pe), "APPLY_HPARAMS", ())
    return {k: v for k, v in (hparams or {}).items() if k in names}


def rotate_qk(
    module: ModuleType,
    params: Mapping[str, jax.Array],
    q_BTNH: jax.Array,
    k_BTNH: jax.Array,
    pos: jax.Array,
    *,
    share_heads: bool,
    hparams: Mapping[str, Any],
) -> tuple[jax.Array, jax.Array]:
    """Rotate queries and keys with the family's ``apply`` (one call each).

    Args:
      module: a rotary family module.
      params: its parameters (for 1 head when ``share_heads``).
      q_BTNH: queries.
      k_BTNH: keys, same shape.
      pos: ``pos_TA`` shared by the batch or ``pos_BTA`` per example.
      share_heads: fold the heads into the batch and rotate them all with the same parameters.
      hparams: the family's apply hyperparameters.

    Returns:
      (q_BTNH, k_BTNH) rotated, in their dtype.
    """
    return (
        _rotate_one(module, params, q_BTNH, pos, share_heads=share_heads, hparams=hparams),
        _rotate_one(module, params, k_BTNH, pos, share_heads=share_heads, hparams=hparams),
    )


def _rotate_one(module, params, x_BTNH, pos, *, share_heads: bool, hparams) -> jax.Array:
    """``module.apply`` on q or k; shared heads are folded into the batch (1-head params)."""
    if not share_heads:
        return module.apply(params, x_BTNH, pos, **hparams)
    batch, tokens, heads, head_dim = x_BTNH.shape
    x_MT1H = jnp.transpose(x_BTNH, (2, 0, 1, 3)).reshape(heads * batch, tokens, 1, head_dim)
    if pos.ndim == 3:
        pos = jnp.tile(pos, (heads, 1, 1))
    x_MT1H = module.apply(params, x_MT1H, pos, **hparams)
    return jnp.transpose(x_MT1H.reshape(heads, batch, tokens, head_dim), (1, 2, 0, 3))


def position_bias(
    module: ModuleType,
    params: Mapping[str, jax.Array],
    pos_TA: jax.Array,
    *,
    num_heads: int,
    num_prefix: int,
    hparams: Mapping[str, Any],
) -> jax.Array:
    """The attention-logit bias of a bias family, shaped for ``attend`` (B, N, T, S).

    Args:
      module: a bias family module (ALiBi).
      params: its parameters.
      pos_TA: token positions shared by the batch (queries and keys are the same tokens).
      num_heads: heads the parameters were initialised for (1 when shared across heads).
      num_prefix: prefix (class) tokens at the start of the sequence.
      hparams: the family's apply hyperparameters.

    Returns:
      (1, N, T, T) float32 bias (N = 1 broadcasts over the heads).
    """
    if pos_TA.ndim != 2:
        raise ValueError(
            f"bias families take positions shared by the batch, shape (T, A); got shape "
            f"{tuple(pos_TA.shape)}"
        )
    bias_NTS = module.bias(
        params, pos_TA, pos_TA, num_heads=num_heads, num_prefix=num_prefix, **hparams
    )
    return bias_NTS[None]


def precompute_pe(
    module: ModuleType,
    params: Mapping[str, jax.Array],
    pos: jax.Array,
    *,
    num_heads: int,
    num_prefix: int,
    hparams: Mapping[str, Any],
) -> dict[str, Any]:
    """The encoder state for a position set: everything the hook needs that depends on the
    parameters and positions only, computed once and shared by every layer that shares them.

    Args:
      module: the family's module.
      params: its parameters (for 1 head when shared across heads).
      pos: ``pos_TA`` (or ``pos_BTA`` for rotary families).
      num_heads: heads the parameters were initialised for (bias families).
      num_prefix: prefix (class) tokens at the start of the sequence (bias families).
      hparams: the family's apply hyperparameters.

    Returns:
      {"bias_1NTS": bias} for bias families; for rotary families that define
      ``precompute_folded`` (Cayley-STRING) {"fold_NHH": P, "rotations": the rest}, P to fold
      into the q/k projections; {"rotations": module.precompute(params, pos)} for those that
      define ``precompute`` (LieRE, RoPE-Mixed); else {"params": params, "pos": pos}.
    """
    if module in encodings.BIAS.values():
        bias = position_bias(
            module, params, pos, num_heads=num_heads, num_prefix=num_prefix, hparams=hparams
        )
        return {"bias_1NTS": bias}
    if hasattr(module, "precompute_folded"):
        fold_NHH, rotations = module.precompute_folded(params, pos, **hparams)
        return {"fold_NHH": fold_NHH, "rotations": rotations}
    if hasattr(module, "precompute"):
        return {"rotations": module.precompute(params, pos, **hparams)}
    return {"params": dict(params), "pos": pos}


def fold_projection(
    fold_NHH: jax.Array, w_DNH: jax.Array, b_NH: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Weights and biases of ``P (x w + b)``: ``(w P^T, P b)`` per head, in float32.

    Args:
      fold_NHH: per-head P (N = 1: one P for every head).
      w_DNH: projection weights.
      b_NH: projection biases.

    Returns:
      (w_DNH, b_NH) folded.
    """
    p = fold_NHH.astype(jnp.float32)
    heads = "n" if p.shape[0] == w_DNH.shape[1] else ""
    p = p if heads else p[0]
    hi = jax.lax.Precision.HIGHEST
    w = jnp.einsum(f"{heads}ij,dnj->dni", p, w_DNH.astype(jnp.float32), precision=hi)
    b = jnp.einsum(f"{heads}ij,nj->ni", p, b_NH.astype(jnp.float32), precision=hi)
    return w, b


def apply_pe(
    module: ModuleType,
    state: Mapping[str, Any],
    q_BTNH: jax.Array,
    k_BTNH: jax.Array,
    *,
    share_heads: bool,
    hparams: Mapping[str, Any],
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Apply an encoder state from ``precompute_pe`` to queries and keys.

    Returns:
      (q_BTNH, k_BTNH, bias_1NTS or None).
    """
    if "bias_1NTS" in state:
        return q_BTNH, k_BTNH, state["bias_1NTS"]
    if "rotations" in state:
        # Precomputed rotations: q and k each cost only their application; rotations for one
        # head apply to every head.
        rot = state["rotations"]
        return module.apply_precomputed(rot, q_BTNH), module.apply_precomputed(rot, k_BTNH), None
    q_BTNH, k_BTNH = rotate_qk(
        module, state["params"], q_BTNH, k_BTNH, state["pos"], share_heads=share_heads,
        hparams=hparams,
    )  # fmt: skip
    return q_BTNH, k_BTNH, None


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
    return jnp.einsum("BTD,DNH->BTNH", x_BTD, w_DNH) + b_NH


def attend(
    q_BTNH: jax.Array, k_BTNH: jax.Array, v_BTNH: jax.Array, bias: jax.Array | None = None
) -> jax.Array:
    """Scaled dot-product attention, ``softmax(q k^T / sqrt(H) + bias) v`` per head.

    The XLA path of ``jax.nn.dot_product_attention`` (same operations in the same order:
    float32 logits, scale, bias, float32 softmax, probabilities cast to v's dtype), written
    out without its grouped-query ``vmap``: XLA:CPU fused the size-1 group axis into slow
    five-dimensional kernels, and this form made a ViT train step 5-9 % faster on CPU
    (``experiments/benchmarks/vs_pytorch.py``, issue 14). With ``implementation=None``,
    jax 0.10's dot_product_attention takes this same XLA path on every platform (its cuDNN
    kernel only when asked for), so nothing is lost on GPU.

    Args:
      q_BTNH: queries.
      k_BTNH: keys (S = T tokens).
      v_BTNH: values.
      bias: None or a logit bias broadcastable to (B, N, T, S).

    Returns:
      (B, T, N, H) in v's dtype.
    """
    probs_BNTS = attention_probs(q_BTNH, k_BTNH, bias).astype(v_BTNH.dtype)
    return jnp.einsum("BNTS,BSNH->BTNH", probs_BNTS, v_BTNH)


def attention_probs(
    q_BTNH: jax.Array, k_BTNH: jax.Array, bias: jax.Array | None = None
) -> jax.Array:
    """``softmax(q k^T / sqrt(H) + bias)`` in float32, (B, N, T, S): the weights ``attend``
    applies to the values (row t: how much query token t takes from each key token)."""
    logits_BNTS = jnp.einsum("BTNH,BSNH->BNTS", q_BTNH, k_BTNH, preferred_element_type=jnp.float32)
    logits_BNTS = logits_BNTS * jnp.float32(1 / math.sqrt(q_BTNH.shape[-1]))
    if bias is not None:
        logits_BNTS = (logits_BNTS + bias).astype(jnp.float32)
    return jax.nn.softmax(logits_BNTS, axis=-1)


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
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        """Build the projections and, when ``own_pe``, this layer's encoder parameters.

        Args:
          width: D, model width; divisible by ``num_heads``.
          num_heads: N; the head dimension is H = D / N.
          num_axes: A, position axes of the token grid (1, 2 or 3).
          pe: rotary or bias family (``pe_names()``).
          pe_hparams: the family's ``init`` keyword arguments (its ``APPLY_HPARAMS`` are also
            passed to ``apply``/``bias``).
          share_pe_heads: one set of encoder parameters for all heads.
          own_pe: False when the parameters are shared across layers and passed to
            ``__call__`` by the caller.
          num_prefix: prefix (class) tokens at the start of the sequence (for bias families).
          dtype: activation dtype; parameters are float32.
          rngs: ``nnx.Rngs`` with a ``params`` (or default) stream.
        """
        if width % num_heads:
            raise ValueError(f"width={width} is not divisible by num_heads={num_heads}")
        self.pe = pe
        self.is_bias = pe in encodings.BIAS
        self.num_heads = num_heads
        self.head_dim = head_dim = width // num_heads
        self.share_pe_heads = share_pe_heads
        self.num_prefix = num_prefix
        # Static and hashable, as nnx graph definitions require.
        self.hparams = tuple(sorted(apply_hparams(pe, pe_hparams).items()))
        self.dtype = dtype
        init_in, shape_DNH = xavier_uniform(0, (1, 2)), (width, num_heads, head_dim)
        self.wq_DNH = nnx.Param(init_in(rngs.params(), shape_DNH))
        self.wk_DNH = nnx.Param(init_in(rngs.params(), shape_DNH))
        self.wv_DNH = nnx.Param(init_in(rngs.params(), shape_DNH))
        self.bq_NH, self.bk_NH, self.bv_NH = (
            nnx.Param(jnp.zeros((num_heads, head_dim))) for _ in range(3)
        )
        init_out = xavier_uniform((0, 1), 2)
        self.wo_NHD = nnx.Param(init_out(rngs.params(), (num_heads, head_dim, width)))
        self.bo_D = nnx.Param(jnp.zeros((width,)))
        self.pe_params = nnx.data(None)  # data: may hold a Dict of PositionParam below
        if own_pe:
            self.pe_params = init_pe_params(
                pe, rngs.params(), num_heads=num_heads, head_dim=head_dim, num_axes=num_axes,
                share_heads=share_pe_heads, hparams=pe_hparams,
            )  # fmt: skip

    def pe_state(
        self, pos: jax.Array, *, pe_params: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """This layer's encoder state (``precompute_pe``) at positions ``pos``.

        Args:
          pos: ``pos_TA`` (or ``pos_BTA`` for rotary families); prefix tokens at position 0.
          pe_params: encoder parameters shared across layers (a mapping of ``PositionParam``
            or arrays); None uses this layer's own.

        Returns:
          the state dict, a pytree of arrays.
        """
        if (pe_params is None) == (self.pe_params is None):
            raise ValueError(
                "Attention needs encoder parameters from exactly one place: its own "
                f"(own_pe=True) or pe_params passed to __call__; own={self.pe_params is not None}, "
                f"passed={pe_params is not None}"
            )
        params = self.pe_params if pe_params is None else pe_params
        params = {name: jnp.asarray(value[...]) for name, value in params.items()}
        heads = 1 if self.share_pe_heads else self.num_heads
        return precompute_pe(
            pe_module(self.pe), params, pos, num_heads=heads, num_prefix=self.num_prefix,
            hparams=dict(self.hparams),
        )  # fmt: skip

    def __call__(
        self,
        x_BTD: jax.Array,
        pos: jax.Array | None,
        *,
        pe_params: Mapping[str, Any] | None = None,
        pe_state: Mapping[str, Any] | None = None,
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

        Returns:
          (B, T, D) array in the activation dtype.
        """
        q_BTNH, k_BTNH, v_BTNH, bias = self.qkv(x_BTD, pos, pe_params=pe_params, pe_state=pe_state)
        o_BTNH = attend(q_BTNH, k_BTNH, v_BTNH, bias)
        y_BTD = jnp.einsum("BTNH,NHD->BTD", o_BTNH, self.wo_NHD[...].astype(self.dtype))
        return y_BTD + self.bo_D[...].astype(self.dtype)

    def probs(self, x_BTD: jax.Array, pe_state: Mapping[str, Any]) -> jax.Array:
        """The attention weights (B, N, T, T) of ``__call__`` (float32), e.g. for attention maps."""
        q_BTNH, k_BTNH, _, bias = self.qkv(x_BTD, None, pe_state=pe_state)
        return attention_probs(q_BTNH, k_BTNH, bias)

    def qkv(
        self,
        x_BTD: jax.Array,
        pos: jax.Array | None,
        *,
        pe_params: Mapping[str, Any] | None = None,
        pe_state: Mapping[str, Any] | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """Queries and keys with the position encoding applied, values, and the logit bias.

        Arguments as ``__call__``. Returns (q_BTNH, k_BTNH, v_BTNH, bias or None).
        """
        if pe_state is None:
            pe_state = self.pe_state(pos, pe_params=pe_params)
        elif pe_params is not None:
            raise ValueError("Attention takes pe_params or pe_state, not both")
        x_BTD = x_BTD.astype(self.dtype)
        wq, bq, wk, bk = self.wq_DNH[...], self.bq_NH[...], self.wk_DNH[...], self.bk_NH[...]
        if "fold_NHH" in pe_state:  # a position-independent P: fold it, never apply per token
            (wq, bq), (wk, bk) = (fold_projection(pe_state["fold_NHH"], w, b)
                                  for w, b in ((wq, bq), (wk, bk)))  # fmt: skip
        q_BTNH = project(x_BTD, wq, bq)
        k_BTNH = project(x_BTD, wk, bk)
        v_BTNH = project(x_BTD, self.wv_DNH[...], self.bv_NH[...])
        q_BTNH, k_BTNH, bias = apply_pe(
            pe_module(self.pe), pe_state, q_BTNH, k_BTNH, share_heads=self.share_pe_heads,
            hparams=dict(self.hparams),
        )  # fmt: skip
        bias = None if bias is None else bias.astype(self.dtype)
        return q_BTNH, k_BTNH, v_BTNH, bias
