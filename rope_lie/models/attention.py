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
would share (measured: ~300 ms of a 2.5 s ViT-Ti train step on CPU, even for NoPE).

Attention itself is one function of (q, k, v, bias), chosen by the ``attention`` argument
(``config.model.attention``, ``ATTENTIONS``) and checked against the platform, dtype and
head_dim before the first step (``backends.check_attention``, ``vit.check_model_attention``):

- ``"xla"`` (default): ``attend``, the XLA path of ``jax.nn.dot_product_attention`` written out;
  at inference on one CPU device it cuts the batch into chunks, as a ``ChunkPlan`` decided
  outside ``jit`` (``chunk_plan``) and passed in says;
- ``"cudnn"``, ``"pallas"``, ``"chunked"``: cuDNN's fused attention (NVIDIA GPUs), the Pallas
  TPU flash-attention kernel, and exact attention in O(T x block) memory on any platform
  (``backends.py``: ``attend_cudnn``, ``attend_pallas``, ``attend_chunked``).

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

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rope_lie.encodings.state import State
from rope_lie.models import backends
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


def attend(
    q_BTNH: jax.Array,
    k_BTNH: jax.Array,
    v_BTNH: jax.Array,
    bias: jax.Array | None = None,
    *,
    loop_chunks: int = 1,
    batch_chunks: int = 1,
) -> jax.Array:
    """Scaled dot-product attention, ``softmax(q k^T / sqrt(H) + bias) v`` per head.

    The XLA path of ``jax.nn.dot_product_attention`` (same operations in the same order:
    float32 logits, scale, bias, float32 softmax, probabilities cast to v's dtype), written
    out without its grouped-query ``vmap``: XLA:CPU fused the size-1 group axis into slow
    five-dimensional kernels, and this form made a ViT train step 5-9 % faster on CPU
    (``experiments/benchmarks/vs_pytorch.py``). With ``implementation=None``,
    jax 0.10's dot_product_attention takes this same XLA path on every platform (its cuDNN
    kernel only when asked for), so nothing is lost on GPU.

    Chunks (``cpu_chunks`` chooses them): the batch is cut into ``loop_chunks`` groups that a
    ``lax.map`` loop attends one after the other, so that one group's logits stay in the CPU's
    cache through the softmax instead of streaming a whole batch's through memory several
    times; each group is cut into ``batch_chunks`` chunks attended as independent operations,
    which XLA:CPU's thunk executor runs on different cores at once. Chunks interleave the
    examples (example b is in group ``(b // batch_chunks) % loop_chunks`` and chunk
    ``b % batch_chunks``), so a batch sharded over devices in contiguous blocks would keep
    every chunk local. Every example's attention is computed with the same operations as
    without chunks, and the result is equal to float32 rounding (tested). It is not promised
    bitwise: how XLA:CPU fuses, tiles and vectorises a chunk depends on its shape and on the
    CPU's vector width (AVX2 and AVX-512 machines round a few elements differently).

    Args:
      q_BTNH: queries.
      k_BTNH: keys (S = T tokens).
      v_BTNH: values.
      bias: None or a logit bias broadcastable to (B, N, T, S); a per-example bias (leading
        axis B) is chunked with the examples.
      loop_chunks: L >= 1 groups attended in a loop.
      batch_chunks: P >= 1 concurrent chunks per group; L * P divides the batch B.

    Returns:
      (B, T, N, H) in v's dtype.
    """
    batch = q_BTNH.shape[0]
    if loop_chunks < 1 or batch_chunks < 1 or batch % (loop_chunks * batch_chunks):
        raise ValueError(
            f"loop_chunks={loop_chunks} x batch_chunks={batch_chunks} must be >= 1 and divide "
            f"the batch {batch}"
        )
    if loop_chunks == batch_chunks == 1:
        probs_BNTS = attention_probs(q_BTNH, k_BTNH, bias).astype(v_BTNH.dtype)
        return jnp.einsum("BNTS,BSNH->BTNH", probs_BNTS, v_BTNH)
    per_example = bias is not None and bias.ndim == 4 and bias.shape[0] == batch
    inner = batch // (loop_chunks * batch_chunks)

    def split(x):  # (B, ...) -> (L, inner, P, ...): example b = (i * L + l) * P + p
        x = x.reshape(inner, loop_chunks, batch_chunks, *x.shape[1:])
        return jnp.moveaxis(x, 1, 0)

    def group(arrays):  # one group's (inner, P, ...) q, k, v [, bias] -> (inner, P, T, N, H)
        q, k, v, *own_bias = arrays
        outs = [
            attend(q[:, p], k[:, p], v[:, p], own_bias[0][:, p] if own_bias else bias)
            for p in range(batch_chunks)
        ]
        return jnp.stack(outs, axis=1)

    arrays = tuple(split(x) for x in (q_BTNH, k_BTNH, v_BTNH, *([bias] if per_example else [])))
    if loop_chunks == 1:
        out = group([x[0] for x in arrays])[None]
    else:
        out = jax.lax.map(group, arrays)
    return jnp.moveaxis(out, 0, 1).reshape(batch, *out.shape[3:])


# Largest logits, in bytes, of one group of ``cpu_chunks``'s loop (B/L examples x N x T x S
# float32): small enough for the softmax's passes over them to stay in a 2-core machine's
# shared cache (32 MiB here). On our AMD EPYC a mu/8 forward at 401 tokens ran 4.5x faster with
# groups of 4 examples (10 MiB) than with the whole batch of 256 at once (660 MiB), and slower
# with groups of 8 or 16 (``experiments/benchmarks/attention_chunks.py`` has the rule's own
# numbers).
GROUP_LOGITS_BYTES = 12 * 2**20


def cpu_chunks(
    batch: int,
    num_heads: int,
    q_tokens: int,
    k_tokens: int,
    group_logits_bytes: int | None = None,
) -> tuple[int, int]:
    """``attend``'s (loop_chunks, batch_chunks) for an inference call on one XLA:CPU device.

    Two concurrent chunks when the batch is even and >= 4 (XLA:CPU runs most of an attention's
    small batched products and reductions on one thread each; two independent chunks keep both
    cores busy), and the fewest loop groups whose logits fit ``group_logits_bytes``. A pure
    function of the shapes: whether to chunk at all is the ``ChunkPlan``'s decision, made
    outside ``jit`` from host facts (``chunk_plan``). Only inference calls chunk
    (``Attention.__call__(..., train=False)``): in a training step the two chunks sped an
    isolated mu/8 step up by 7-12 % but the training loop not at all (quickstart: 2 min 55 s
    against 2 min 57 s; the loop's host work already filled the idle core), and they would move
    the gradients' float32 rounding, so training is left exactly as it was.

    Args:
      batch: B.
      num_heads: N.
      q_tokens: T.
      k_tokens: S.
      group_logits_bytes: the budget of one loop group's float32 logits; None:
        ``GROUP_LOGITS_BYTES``.

    Returns:
      (L, P) with L * P dividing B.
    """
    budget = GROUP_LOGITS_BYTES if group_logits_bytes is None else group_logits_bytes
    # At least two examples per chunk: XLA:CPU compiles a one-example product differently, and
    # its float32 rounding then differed from the whole batch's (measured at 401 tokens).
    parallel = 2 if batch % 2 == 0 and batch >= 4 else 1
    per_example = num_heads * q_tokens * k_tokens * 4
    groups = batch // parallel
    loops = [n for n in range(1, groups + 1) if groups % n == 0 and groups // n >= 2] or [1]
    for loop in loops:
        if (batch // loop) * per_example <= budget:
            return loop, parallel
    return loops[-1], parallel


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """How the ``"xla"`` attention cuts an inference batch: decided once, outside ``jit``.

    Static and hashable; passed to ``ViT.__call__``/``Attention.__call__`` as the encoder
    caches are, so that the model itself reads no host facts while tracing. The default plan
    (``ChunkPlan()``) never chunks.

    Attributes:
      chunk: cut inference batches with ``cpu_chunks`` (one XLA:CPU device).
      group_logits_bytes: ``cpu_chunks``'s budget for one loop group's logits.
    """

    chunk: bool = False
    group_logits_bytes: int = GROUP_LOGITS_BYTES

    def chunks(self, batch: int, num_heads: int, q_tokens: int, k_tokens: int) -> tuple[int, int]:
        """(loop_chunks, batch_chunks) for ``attend``; (1, 1) unless ``chunk``."""
        if not self.chunk:
            return 1, 1
        return cpu_chunks(batch, num_heads, q_tokens, k_tokens, self.group_logits_bytes)


def chunk_plan(platform: str | None = None, device_count: int | None = None) -> ChunkPlan:
    """The inference ``ChunkPlan`` for this host (call outside ``jit``).

    Chunks only on a single XLA:CPU device (no gain measured or expected on GPU/TPU or over
    several devices).

    Args:
      platform: the backend, e.g. ``"cpu"``, ``"gpu"``, ``"tpu"``; None: ``jax.default_backend()``.
      device_count: devices of the computation; None: ``jax.device_count()``.

    Returns:
      the plan.
    """
    platform = jax.default_backend() if platform is None else platform
    device_count = jax.device_count() if device_count is None else device_count
    return ChunkPlan(chunk=platform == "cpu" and device_count == 1)


def attention_probs(
    q_BTNH: jax.Array, k_BTNH: jax.Array, bias: jax.Array | None = None
) -> jax.Array:
    """``softmax(q k^T / sqrt(H) + bias)`` in float32, (B, N, T, S): the weights ``attend``
    applies to the values (row t: how much query token t takes from each key token)."""
    logits_BNTS = jnp.einsum("BTNH,BSNH->BNTS", q_BTNH, k_BTNH, preferred_element_type=jnp.float32)
    logits_BNTS = logits_BNTS * jnp.float32(1 / math.sqrt(q_BTNH.shape[-1]))
    if bias is not None:
        logits_BNTS = (logits_BNTS + backends.bias_4d(bias)).astype(jnp.float32)
    return jax.nn.softmax(logits_BNTS, axis=-1)


# Logit added at a padded key: exp(-1e9 + logit - max) underflows to exactly 0 in float32, and
# the sum with any ALiBi bias stays finite (no -inf, so no NaN where a row is all padding).
MASKED_KEY_LOGIT = -1e9


def with_key_mask(bias: jax.Array | None, key_mask_BS: jax.Array | None) -> jax.Array | None:
    """``bias`` plus ``MASKED_KEY_LOGIT`` at the padded keys (``key_mask_BS`` 0), float32.

    Args:
      bias: None or a logit bias broadcastable to (B, N, T, S).
      key_mask_BS: None (no padding: ``bias`` is returned as it is) or (B, S), 1 (or True)
        for a real key.

    Returns:
      None, ``bias``, or a (B, N', T', S) float32 bias.
    """
    if key_mask_BS is None:
        return bias
    mask_bias_B11S = jnp.where(key_mask_BS > 0, 0.0, MASKED_KEY_LOGIT)[:, None, None, :]
    mask_bias_B11S = mask_bias_B11S.astype(jnp.float32)
    return mask_bias_B11S if bias is None else bias.astype(jnp.float32) + mask_bias_B11S


def _attend_xla(q_BTNH, k_BTNH, v_BTNH, bias, key_mask_BS, chunks):
    bias = with_key_mask(bias, key_mask_BS)
    return attend(q_BTNH, k_BTNH, v_BTNH, bias, loop_chunks=chunks[0], batch_chunks=chunks[1])


def _attend_chunked(q_BTNH, k_BTNH, v_BTNH, bias, key_mask_BS, chunks):
    return backends.attend_chunked(q_BTNH, k_BTNH, v_BTNH, with_key_mask(bias, key_mask_BS))


# name -> (q, k, v, bias, key_mask_BS, (loop_chunks, batch_chunks)) -> o_BTNH. "xla" and
# "chunked" add the key mask to the bias (``with_key_mask``); "cudnn" and "pallas" take it as
# their kernels do (sequence lengths, segment ids). Only "xla" uses the chunks.
ATTENTIONS: dict[str, Callable[..., jax.Array]] = {
    "xla": _attend_xla,
    "cudnn": lambda q, k, v, bias, mask, chunks: backends.attend_cudnn(q, k, v, bias, mask),
    "pallas": lambda q, k, v, bias, mask, chunks: backends.attend_pallas(q, k, v, bias, mask),
    "chunked": _attend_chunked,
}


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
          attention: the attention backend, an ``ATTENTIONS`` key (``"xla"``, ``"cudnn"``,
            ``"pallas"``, ``"chunked"``); ``backends.check_attention`` says where each runs.
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

    def pe_state(
        self, pos: jax.Array, *, pe_params: Mapping[str, Any] | None = None, scaling=None
    ) -> State:
        """This layer's encoder state (``precompute_pe``) at positions ``pos``.

        Args:
          pos: ``pos_TA`` (or ``pos_BTA`` for rotary families); prefix tokens at position 0.
          pe_params: encoder parameters shared across layers (a mapping of ``PositionParam``
            or arrays); None uses this layer's own.
          scaling: None, or an extrapolation tool at an evaluation grid
            (``encodings.extrapolation.resolve``, ``ViT.precompute_pe``).

        Returns:
          the family's state (``encodings/state.py``), a pytree of arrays.
        """
        if (pe_params is None) == (self.pe_params is None):
            raise ValueError(
                "Attention needs encoder parameters from exactly one place: its own "
                f"(own_pe=True) or pe_params passed to __call__; own={self.pe_params is not None}, "
                f"passed={pe_params is not None}"
            )
        params = self.pe_params if pe_params is None else pe_params
        params = {name: jnp.asarray(value[...]) for name, value in params.items()}
        return precompute_pe(
            self.encoder, params, pos, num_prefix=self.num_prefix, fold=self.fold_mix,
            scaling=scaling,
        )  # fmt: skip

    def __call__(
        self,
        x_BTD: jax.Array,
        pos: jax.Array | None,
        *,
        pe_params: Mapping[str, Any] | None = None,
        pe_state: State | None = None,
        train: bool = False,
        key_mask_BS: jax.Array | None = None,
        chunk_plan: ChunkPlan | None = None,
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
          train: a training call: attend the whole batch at once (``chunk_plan`` unused).
          chunk_plan: how the ``"xla"`` attention cuts an inference batch (``chunk_plan()``,
            decided outside ``jit``; the same result to float32 rounding); None: no chunks.
          key_mask_BS: None, or (B, S) with 0 at padded keys: no token attends to them (a
            logit bias for "xla" and "chunked", ``with_key_mask``; sequence lengths for
            "cudnn", segment ids for "pallas").

        Returns:
          (B, T, D) array in the activation dtype.
        """
        q_BTNH, k_BTNH, v_BTNH, bias = self.qkv(x_BTD, pos, pe_params=pe_params, pe_state=pe_state)
        (batch, tokens, heads, _), keys = q_BTNH.shape, k_BTNH.shape[1]
        chunks = (1, 1)
        if not train and chunk_plan is not None:
            chunks = chunk_plan.chunks(batch, heads, tokens, keys)
        o_BTNH = ATTENTIONS[self.attention](q_BTNH, k_BTNH, v_BTNH, bias, key_mask_BS, chunks)
        y_BTD = jnp.einsum("BTNH,NHD->BTD", o_BTNH, self.wo_NHD[...].astype(self.dtype))
        return y_BTD + self.bo_D[...].astype(self.dtype)[None, None]

    def probs(self, x_BTD: jax.Array, pe_state: State) -> jax.Array:
        """The attention weights (B, N, T, T) of ``__call__`` (float32), e.g. for attention maps."""
        q_BTNH, k_BTNH, _, bias = self.qkv(x_BTD, None, pe_state=pe_state)
        return attention_probs(q_BTNH, k_BTNH, bias)

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
            (wq, bq), (wk, bk) = (fold_projection(pe_state.fold_NHH, w, b)
                                  for w, b in ((wq, bq), (wk, bk)))  # fmt: skip
        q_BTNH = pe_state.rotate(project(x_BTD, wq, bq))
        k_BTNH = pe_state.rotate(project(x_BTD, wk, bk))
        v_BTNH = project(x_BTD, wv, bv)
        bias = pe_state.bias_BNTS
        bias = None if bias is None else bias.astype(self.dtype)
        return q_BTNH, k_BTNH, v_BTNH, bias
