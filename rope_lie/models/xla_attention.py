"""The attention formula in XLA operations: the ``"xla"`` backend, and its CPU inference form.

    o_BTNH = softmax(q k^T / sqrt(H) + bias) v   per head, float32 logits and softmax

``attend`` is the XLA path of ``jax.nn.dot_product_attention`` written out; ``attention_probs``
its weights; ``with_key_mask`` adds a padding mask to the bias, ``with_segments`` the mask of
a packed batch (several images per row, each attending within its own segment).
``attend_cpu_batches`` (the ``"xla_cpu"`` backend) is the same formula with an inference batch
cut as ``cpu_chunks`` plans it for one XLA:CPU device: the evaluation step chooses it there
(``backends.inference_backend``, decided once where ``train.make_eval_fn`` makes the step).
``backends.py`` holds the table of every backend.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def bias_4d(bias: jax.Array | None) -> jax.Array | None:
    """A bias broadcastable to (B, N, T, S) as a 4-dimensional array (leading axes of 1)."""
    if bias is None or bias.ndim == 4:
        return bias
    return bias.reshape((1,) * (4 - bias.ndim) + bias.shape)


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
    five-dimensional kernels, which this form avoids (benchmarks README, section 14). With
    ``implementation=None``,
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
      loop_chunks: groups attended in a loop, >= 1.
      batch_chunks: concurrent chunks per group, >= 1; loop_chunks * batch_chunks divides the
        batch B.

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

    def split(x):  # (B, ...) -> (loops, inner, chunks, ...): b = (i * loops + l) * chunks + p
        x = x.reshape(inner, loop_chunks, batch_chunks, *x.shape[1:])
        return jnp.moveaxis(x, 1, 0)

    def group(arrays):  # (inner, chunks, ...) q, k, v [, bias] -> (inner, chunks, T, N, H)
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


# Largest logits, in bytes, of one group of ``cpu_chunks``'s loop (B / loop_chunks examples x
# N x T x S float32): small enough for the softmax's passes over them to stay in a 2-core
# machine's shared cache; larger groups, or the whole batch at once, stream the logits through
# memory on every pass (benchmarks README, sections 7 and 14).
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
    function of the shapes: whether to chunk at all is the choice of the ``"xla_cpu"`` backend,
    made outside ``jit`` from host facts (``backends.inference_backend``). Only the evaluation
    step makes that choice (``train.make_eval_fn``): in a training step the two chunks sped up
    an isolated step but not the training loop, whose host work already filled the idle core
    (benchmarks README, section 14), and they would move the gradients' float32 rounding, so
    training is left exactly as it was.

    Args:
      batch: B.
      num_heads: N.
      q_tokens: T.
      k_tokens: S.
      group_logits_bytes: the budget of one loop group's float32 logits; None:
        ``GROUP_LOGITS_BYTES``.

    Returns:
      (loop_chunks, batch_chunks), whose product divides B.
    """
    budget = GROUP_LOGITS_BYTES if group_logits_bytes is None else group_logits_bytes
    # At least two examples per chunk: XLA:CPU compiles a one-example product differently, and
    # its float32 rounding then differed from the whole batch's (benchmarks README, section 14).
    parallel = 2 if batch % 2 == 0 and batch >= 4 else 1
    per_example = num_heads * q_tokens * k_tokens * 4
    groups = batch // parallel
    loops = [n for n in range(1, groups + 1) if groups % n == 0 and groups // n >= 2] or [1]
    for loop in loops:
        if (batch // loop) * per_example <= budget:
            return loop, parallel
    return loops[-1], parallel


def attend_cpu_batches(
    q_BTNH: jax.Array,
    k_BTNH: jax.Array,
    v_BTNH: jax.Array,
    bias: jax.Array | None = None,
    *,
    group_logits_bytes: int | None = None,
) -> jax.Array:
    """``attend`` with the batch cut as ``cpu_chunks`` plans it from the shapes (``"xla_cpu"``).

    The inference form of the formula on one XLA:CPU device: the same result to float32
    rounding (``attend``'s Args and Returns; ``group_logits_bytes`` as ``cpu_chunks``).
    """
    (batch, tokens, heads, _), keys = q_BTNH.shape, k_BTNH.shape[1]
    loop, parallel = cpu_chunks(batch, heads, tokens, keys, group_logits_bytes)
    return attend(q_BTNH, k_BTNH, v_BTNH, bias, loop_chunks=loop, batch_chunks=parallel)


def attention_probs(
    q_BTNH: jax.Array, k_BTNH: jax.Array, bias: jax.Array | None = None
) -> jax.Array:
    """``softmax(q k^T / sqrt(H) + bias)`` in float32, (B, N, T, S): the weights ``attend``
    applies to the values (row t: how much query token t takes from each key token)."""
    logits_BNTS = jnp.einsum("BTNH,BSNH->BNTS", q_BTNH, k_BTNH, preferred_element_type=jnp.float32)
    logits_BNTS = logits_BNTS * jnp.float32(1 / math.sqrt(q_BTNH.shape[-1]))
    if bias is not None:
        logits_BNTS = (logits_BNTS + bias_4d(bias)).astype(jnp.float32)
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
    if bias is None:
        return mask_bias_B11S
    return bias_4d(bias).astype(jnp.float32) + mask_bias_B11S


def with_segments(bias: jax.Array | None, segment_BS: jax.Array | None) -> jax.Array | None:
    """``bias`` plus ``MASKED_KEY_LOGIT`` wherever query and key are in different segments.

    A packed row (``tokens.Packed``) holds several images; token t attends only to the keys of
    its own segment (its image; padding is segment 0 and attends among itself, its outputs
    unused), so each image is attended as if alone.

    Args:
      bias: None or a logit bias broadcastable to (B, N, T, S).
      segment_BS: None (one image per row: ``bias`` is returned as it is) or int (B, S), the
        segment of each token; self-attention, so queries and keys are the same tokens.

    Returns:
      None, ``bias``, or a (B, N', T, S) float32 bias.
    """
    if segment_BS is None:
        return bias
    same_BTS = segment_BS[:, :, None] == segment_BS[:, None, :]
    mask_bias_B1TS = jnp.where(same_BTS, 0.0, MASKED_KEY_LOGIT)[:, None].astype(jnp.float32)
    if bias is None:
        return mask_bias_B1TS
    return bias_4d(bias).astype(jnp.float32) + mask_bias_B1TS
