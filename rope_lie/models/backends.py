"""The attention backends behind ``Attention``'s one seam, and their table (``BACKENDS``).

Each backend is a function of (q_BTNH, k_BTNH, v_BTNH, bias, key_mask_BS, segment_BS) -> o_BTNH
that computes the formula ``softmax(q k^T / sqrt(H) + bias) v`` per head
(``xla_attention.attend``) its own way, padded keys (``key_mask_BS``) and, in a packed batch,
the keys of other segments (``segment_BS``: other images of the row) left out:

- ``"xla"`` (default): the formula in XLA operations (``xla_attention.attend``);
- ``"xla_cpu"``: the same with an inference batch cut into chunks for one CPU device
  (``xla_attention.attend_cpu_batches``); the evaluation step's choice there
  (``inference_backend``);
- ``"chunked"``: exact, an online softmax over key blocks with a custom VJP; O(T x block)
  memory on any platform (``attend_chunked``);
- ``"cudnn"``: cuDNN's fused attention (NVIDIA GPUs, bfloat16/float16; ``attend_cudnn``; no
  packed batches);
- ``"pallas"``: the Pallas TPU flash-attention kernel (``attend_pallas``).

``BACKENDS`` names each one's function, the platforms it runs on and its checks of the dtype
and head_dim; ``check_attention`` (called outside ``jit`` before the first step) raises, naming
``model.attention`` and what it needs, where one cannot run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from rope_lie.models.xla_attention import (
    MASKED_KEY_LOGIT,
    attend,
    attend_cpu_batches,
    bias_4d,
    with_key_mask,
    with_segments,
)

# Keys per block of the "chunked" attention: its logits are (B, N, T, KEY_BLOCK) at a time.
KEY_BLOCK = 128


def attend_chunked(
    q_BTNH: jax.Array,
    k_BTNH: jax.Array,
    v_BTNH: jax.Array,
    bias: jax.Array | None = None,
    *,
    block: int = KEY_BLOCK,
    segment_BS: jax.Array | None = None,
) -> jax.Array:
    """Exact attention in O(T x block) memory: an online softmax over key blocks.

    ``softmax(q k^T / sqrt(H) + bias) v`` as ``attend`` computes it, but the keys are visited
    ``block`` at a time in a ``lax.scan`` that carries the running row maximum, the running
    sum of exponentials and the unnormalised output (Milakov & Gimelshein, arXiv:1805.02867;
    Rabe & Staats, arXiv:2112.05682; the FlashAttention recurrence, arXiv:2205.14135), so no
    (B, N, T, S) array is ever formed (only the bias, when given, which the encoder state
    already holds). Gradients are a custom VJP that saves only the output and the row
    log-sum-exp and recomputes each block's probabilities in a second scan (FlashAttention's
    backward pass). Logits, statistics and accumulators are float32 whatever the inputs'
    dtype. Keys are padded to a multiple of ``block`` and the padding masked out. A packed
    batch's segments are compared per key block (``MASKED_KEY_LOGIT`` added where query and key
    differ, as ``with_segments`` does), so they too form no (T, S) array.

    Args:
      q_BTNH: queries.
      k_BTNH: keys (B, S, N, H).
      v_BTNH: values (B, S, N, H).
      bias: None or a logit bias broadcastable to (B, N, T, S).
      block: keys per block (the whole of S when S is smaller).
      segment_BS: None, or int (B, S) segments of a packed batch (self-attention: the
        queries' too, T = S); a query attends to the keys of its own segment only.

    Returns:
      (B, T, N, H) in v's dtype; equal to ``attend`` to float32 rounding.
    """
    if block < 1:
        raise ValueError(f"block={block} must be >= 1")
    keys = k_BTNH.shape[1]
    block = min(block, keys)
    num_blocks = -(-keys // block)
    pad = num_blocks * block - keys
    bias = bias_4d(bias)
    seg_q_BT = seg_k_BS = None
    if segment_BS is not None:
        if segment_BS.shape != (q_BTNH.shape[0], keys) or q_BTNH.shape[1] != keys:
            raise ValueError(
                f"segment_BS has shape {tuple(segment_BS.shape)}; expected (B, S) = "
                f"{(q_BTNH.shape[0], keys)} with as many queries as keys (self-attention)"
            )
        seg_q_BT = seg_k_BS = segment_BS.astype(jnp.int32)
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        k_BTNH, v_BTNH = jnp.pad(k_BTNH, widths), jnp.pad(v_BTNH, widths)
        if bias is not None and bias.shape[-1] != 1:
            bias = jnp.pad(bias, ((0, 0), (0, 0), (0, 0), (0, pad)))
        if seg_k_BS is not None:
            seg_k_BS = jnp.pad(seg_k_BS, ((0, 0), (0, pad)))
    return _chunked(q_BTNH, k_BTNH, v_BTNH, bias, seg_q_BT, seg_k_BS, block, keys)


def _key_blocks(x_BSNH: jax.Array, block: int) -> jax.Array:
    """(B, S, N, H) -> (S / block, B, block, N, H)."""
    b, s, n, h = x_BSNH.shape
    return jnp.moveaxis(x_BSNH.reshape(b, s // block, block, n, h), 1, 0)


def _bias_blocks(bias: jax.Array | None, block: int, num_blocks: int) -> jax.Array | None:
    """(b, n, t, S) -> (S / block, b, n, t, block); a bias constant along S is kept as is."""
    if bias is None:
        return None
    if bias.shape[-1] == 1:
        return jnp.broadcast_to(bias, (num_blocks, *bias.shape))
    b, n, t, s = bias.shape
    return jnp.moveaxis(bias.reshape(b, n, t, s // block, block), 3, 0)


def _segment_blocks(seg_k_BS: jax.Array | None, block: int) -> jax.Array | None:
    """(B, S) -> (S / block, B, block)."""
    if seg_k_BS is None:
        return None
    b, s = seg_k_BS.shape
    return jnp.moveaxis(seg_k_BS.reshape(b, s // block, block), 1, 0)


def _block_logits(q_BTNH, k_BSNH, bias_blk, valid_S, seg_q_BT=None, seg_k_BS=None):
    """One key block's float32 logits (B, N, T, S), padded keys at -inf, keys of another
    segment (packed batches) at ``MASKED_KEY_LOGIT`` added."""
    logits_BNTS = jnp.einsum("BTNH,BSNH->BNTS", q_BTNH, k_BSNH, preferred_element_type=jnp.float32)
    logits_BNTS = logits_BNTS * jnp.float32(1 / math.sqrt(q_BTNH.shape[-1]))
    if bias_blk is not None:
        logits_BNTS = (logits_BNTS + bias_blk).astype(jnp.float32)
    if seg_q_BT is not None:
        same_B1TS = (seg_q_BT[:, :, None] == seg_k_BS[:, None, :])[:, None]
        logits_BNTS = logits_BNTS + jnp.where(same_B1TS, 0.0, MASKED_KEY_LOGIT).astype(jnp.float32)
    return jnp.where(valid_S, logits_BNTS, -jnp.inf)


def _chunked_forward(q_BTNH, k_BTNH, v_BTNH, bias, seg_q_BT, seg_k_BS, block, keys):
    """(o_BTNH in v's dtype, lse_BNT float32) by the online softmax."""
    batch, tokens, heads, head_dim = q_BTNH.shape
    num_blocks = k_BTNH.shape[1] // block
    valid_blocks_S = (jnp.arange(num_blocks * block) < keys).reshape(num_blocks, block)

    def step(carry, xs):
        max_BNT, sum_BNT, acc_BTNH = carry
        k_BSNH, v_BSNH, bias_blk, valid_S, seg_k_BS = xs
        logits_BNTS = _block_logits(q_BTNH, k_BSNH, bias_blk, valid_S, seg_q_BT, seg_k_BS)
        new_max_BNT = jnp.maximum(max_BNT, jnp.max(logits_BNTS, axis=-1))
        correction_BNT = jnp.exp(max_BNT - new_max_BNT)
        p_BNTS = jnp.exp(logits_BNTS - new_max_BNT[..., None])
        sum_BNT = sum_BNT * correction_BNT + jnp.sum(p_BNTS, axis=-1)
        pv_BTNH = jnp.einsum(
            "BNTS,BSNH->BTNH",
            p_BNTS.astype(v_BSNH.dtype),
            v_BSNH,
            preferred_element_type=jnp.float32,
        )
        acc_BTNH = acc_BTNH * jnp.moveaxis(correction_BNT, 1, 2)[..., None] + pv_BTNH
        return (new_max_BNT, sum_BNT, acc_BTNH), None

    init = (
        jnp.full((batch, heads, tokens), -jnp.inf, jnp.float32),
        jnp.zeros((batch, heads, tokens), jnp.float32),
        jnp.zeros((batch, tokens, heads, head_dim), jnp.float32),
    )
    xs = (
        _key_blocks(k_BTNH, block),
        _key_blocks(v_BTNH, block),
        _bias_blocks(bias, block, num_blocks),
        valid_blocks_S,
        _segment_blocks(seg_k_BS, block),
    )
    (max_BNT, sum_BNT, acc_BTNH), _ = jax.lax.scan(step, init, xs)
    o_BTNH = (acc_BTNH / jnp.moveaxis(sum_BNT, 1, 2)[..., None]).astype(v_BTNH.dtype)
    return o_BTNH, max_BNT + jnp.log(sum_BNT)


def _sum_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sum ``x`` over the axes that ``shape`` broadcasts (size 1 there), keeping them."""
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape, strict=True)) if b == 1 != a)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _chunked(q_BTNH, k_BTNH, v_BTNH, bias, seg_q_BT, seg_k_BS, block, keys):
    return _chunked_forward(q_BTNH, k_BTNH, v_BTNH, bias, seg_q_BT, seg_k_BS, block, keys)[0]


def _chunked_fwd(q_BTNH, k_BTNH, v_BTNH, bias, seg_q_BT, seg_k_BS, block, keys):
    o_BTNH, lse_BNT = _chunked_forward(
        q_BTNH, k_BTNH, v_BTNH, bias, seg_q_BT, seg_k_BS, block, keys
    )
    return o_BTNH, (q_BTNH, k_BTNH, v_BTNH, bias, seg_q_BT, seg_k_BS, o_BTNH, lse_BNT)


def _chunked_bwd(block, keys, residuals, do_BTNH):
    q_BTNH, k_BTNH, v_BTNH, bias, seg_q_BT, seg_k_BS, o_BTNH, lse_BNT = residuals
    num_blocks = k_BTNH.shape[1] // block
    valid_blocks_S = (jnp.arange(num_blocks * block) < keys).reshape(num_blocks, block)
    scale = jnp.float32(1 / math.sqrt(q_BTNH.shape[-1]))
    # d logits = p * (dp - rowsum(do * o)), the softmax's backward pass per row.
    delta_BNT = jnp.einsum("BTNH,BTNH->BNT", do_BTNH, o_BTNH, preferred_element_type=jnp.float32)
    do_BTNH = do_BTNH.astype(v_BTNH.dtype)

    def step(dq_BTNH, xs):
        k_BSNH, v_BSNH, bias_blk, valid_S, seg_k_BS = xs
        logits_BNTS = _block_logits(q_BTNH, k_BSNH, bias_blk, valid_S, seg_q_BT, seg_k_BS)
        p_BNTS = jnp.exp(logits_BNTS - lse_BNT[..., None])
        dv_BSNH = jnp.einsum(
            "BNTS,BTNH->BSNH",
            p_BNTS.astype(do_BTNH.dtype),
            do_BTNH,
            preferred_element_type=jnp.float32,
        )
        dp_BNTS = jnp.einsum("BTNH,BSNH->BNTS", do_BTNH, v_BSNH, preferred_element_type=jnp.float32)
        ds_BNTS = p_BNTS * (dp_BNTS - delta_BNT[..., None])
        dbias = None if bias_blk is None else _sum_to(ds_BNTS, bias_blk.shape)
        ds_BNTS = (ds_BNTS * scale).astype(q_BTNH.dtype)
        dq_BTNH = dq_BTNH + jnp.einsum(
            "BNTS,BSNH->BTNH", ds_BNTS, k_BSNH, preferred_element_type=jnp.float32
        )
        dk_BSNH = jnp.einsum("BNTS,BTNH->BSNH", ds_BNTS, q_BTNH, preferred_element_type=jnp.float32)
        return dq_BTNH, (dk_BSNH, dv_BSNH, dbias)

    xs = (
        _key_blocks(k_BTNH, block),
        _key_blocks(v_BTNH, block),
        _bias_blocks(bias, block, num_blocks),
        valid_blocks_S,
        _segment_blocks(seg_k_BS, block),
    )
    dq_BTNH, (dk_blocks_BSNH, dv_blocks_BSNH, dbias_blocks) = jax.lax.scan(
        step, jnp.zeros(q_BTNH.shape, jnp.float32), xs
    )

    def unblock(x_blocks_BSNH, like):
        return jnp.moveaxis(x_blocks_BSNH, 0, 1).reshape(like.shape).astype(like.dtype)

    dbias = None
    if bias is not None:
        if bias.shape[-1] == 1:
            dbias = jnp.sum(dbias_blocks, axis=(0, -1))[..., None]
        else:
            dbias = jnp.moveaxis(dbias_blocks, 0, 3).reshape(bias.shape)
        dbias = _sum_to(dbias, bias.shape).astype(bias.dtype)
    # The segments are integers: no cotangent (None).
    dk_BTNH, dv_BTNH = unblock(dk_blocks_BSNH, k_BTNH), unblock(dv_blocks_BSNH, v_BTNH)
    return dq_BTNH.astype(q_BTNH.dtype), dk_BTNH, dv_BTNH, dbias, None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def attend_cudnn(
    q_BTNH: jax.Array,
    k_BTNH: jax.Array,
    v_BTNH: jax.Array,
    bias: jax.Array | None = None,
    key_mask_BS: jax.Array | None = None,
    segment_BS: jax.Array | None = None,
    *,
    implementation: str = "cudnn",
) -> jax.Array:
    """cuDNN's fused (flash) attention, ``jax.nn.dot_product_attention(implementation="cudnn")``.

    NVIDIA GPUs only, float16/bfloat16 q, k, v, head_dim a multiple of 8 up to 128 (256 on
    Hopper and later); ``check_attention`` checks these before a run. A bias (ALiBi) is passed
    as cuDNN's bias input, in q's dtype. cuDNN's backward pass refuses an odd token count (jax
    0.10's check: with a bias; jax 0.11 refused one without a bias too, benchmarks README,
    section 14), so an odd T (a class token: 14 x 14 + 1 = 197) is padded with one zero query
    and one key that the sequence lengths leave out; the padded query's output is dropped.

    The key mask goes in as cuDNN takes it, as sequence lengths (``key_value_seq_lengths``:
    cuDNN's padding mask, no bias array, beside ALiBi's bias in the same call). jax's other
    way, a boolean ``mask``, is folded into a bias in q's dtype (``combine_bias_and_mask``):
    a bias-free model would then carry a (B, 1, T, S) array (a (B, 1, 1, S) mask fails
    cuDNN's shape check unless broadcast over T, jax issue #28974). Lengths mask the keys past
    each example's count, so the real keys are first put before the padded ones (a stable sort
    of each example's keys and values, and of the bias's key axis; attention is a sum over
    keys, so the order changes nothing but the rounding, and the sort is the identity for
    ``tokens.pack``'s and ``patch_dropout``'s batches, whose padding is at the end). An example
    with no real key gets length 1 (finite, and unused).

    Packed batches (several images per row, ``segment_BS``) are refused: sequence lengths mask
    the keys past a count, the same keys for every query, so they cannot keep one image's
    queries off another's keys (``check_attention(..., packed=True)`` refuses it before a run).
    jax's private cuDNN wrapper has a packed layout (``q_offsets``/``kv_offsets``, each segment
    contiguous), which ``jax.nn.dot_product_attention`` does not expose and this does not use;
    a dense (B, 1, T, S) mask folded into cuDNN's bias would work but is not tested on a GPU.

    Args:
      q_BTNH: queries.
      k_BTNH: keys.
      v_BTNH: values.
      bias: None or a logit bias broadcastable to (B, N, T, S).
      key_mask_BS: None, or (B, S) with 0 at padded keys, which no query then attends to.
      segment_BS: must be None (packed batches are refused, above).
      implementation: ``jax.nn.dot_product_attention``'s; ``"xla"`` runs jax's reference of
        the same call (same bias, key order and lengths) on any platform and dtype: how the
        CPU tests check this wrapper.

    Returns:
      (B, T, N, H) in v's dtype.
    """
    if segment_BS is not None:
        raise ValueError(PACKED_REFUSED.format(name="cudnn"))
    bias = bias_4d(bias)
    bias = None if bias is None else bias.astype(q_BTNH.dtype)
    lengths_B = None
    if key_mask_BS is not None:
        k_BTNH, v_BTNH, bias, lengths_B = _real_keys_first(k_BTNH, v_BTNH, bias, key_mask_BS)
    tokens = q_BTNH.shape[1]
    if tokens % 2:
        q_BTNH, k_BTNH, v_BTNH, bias, lengths_B = _pad_to_even(
            q_BTNH, k_BTNH, v_BTNH, bias, lengths_B
        )
    o_BTNH = jax.nn.dot_product_attention(
        q_BTNH,
        k_BTNH,
        v_BTNH,
        bias=bias,
        key_value_seq_lengths=lengths_B,
        implementation=implementation,
    )
    return o_BTNH[:, :tokens]


def _pad_to_even(q_BTNH, k_BTNH, v_BTNH, bias, lengths_B):
    """One zero token after the last of q, k, v and the bias's query and key axes, and the
    sequence lengths (all T when None) that leave the padded key out of every softmax."""
    batch, tokens = q_BTNH.shape[:2]
    q_BTNH, k_BTNH, v_BTNH = (
        jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0))) for x in (q_BTNH, k_BTNH, v_BTNH)
    )
    if bias is not None:
        bias = jnp.pad(bias, ((0, 0), (0, 0), (0, bias.shape[2] > 1), (0, bias.shape[3] > 1)))
    if lengths_B is None:
        lengths_B = jnp.full((batch,), tokens, jnp.int32)
    return q_BTNH, k_BTNH, v_BTNH, bias, lengths_B


def _real_keys_first(k_BSNH, v_BSNH, bias, key_mask_BS):
    """Keys, values and the bias's key axis with each example's real keys first (a stable
    sort), and the count of real keys per example (at least 1), int32 (B,)."""
    real_BS = key_mask_BS > 0
    order_BS = jnp.argsort(jnp.logical_not(real_BS), axis=1, stable=True)
    k_BSNH = jnp.take_along_axis(k_BSNH, order_BS[:, :, None, None], axis=1)
    v_BSNH = jnp.take_along_axis(v_BSNH, order_BS[:, :, None, None], axis=1)
    if bias is not None and bias.shape[-1] != 1:
        bias = jnp.broadcast_to(bias, (order_BS.shape[0], *bias.shape[1:]))
        bias = jnp.take_along_axis(bias, order_BS[:, None, None, :], axis=3)
    lengths_B = jnp.maximum(jnp.sum(real_BS, axis=1, dtype=jnp.int32), 1)
    return k_BSNH, v_BSNH, bias, lengths_B


# Token blocks of the Pallas TPU kernel: sequences are padded to a multiple of its lane width
# (128) and the padding masked with segment ids. Its default blocks are 128 tokens whatever the
# sequence (``BlockSizes.get_default``), which jax-ml/jax#24633 found slow on a TPU (benchmarks
# README, section 14); here a block is the whole padded sequence up to ``PALLAS_MAX_BLOCK``
# tokens (ViT-B/16 at 224 px: 197 tokens, one block of 256), else the largest multiple of 128 up
# to it that divides the padded length. No TPU has timed this choice here.
PALLAS_BLOCK = 128
PALLAS_MAX_BLOCK = 512


def pallas_block(padded: int) -> int:
    """The token block for a sequence padded to ``padded`` (a multiple of ``PALLAS_BLOCK``)."""
    if padded < PALLAS_BLOCK or padded % PALLAS_BLOCK:
        raise ValueError(f"padded={padded} must be a positive multiple of {PALLAS_BLOCK}")
    if padded <= PALLAS_MAX_BLOCK:
        return padded
    return max(
        b for b in range(PALLAS_BLOCK, PALLAS_MAX_BLOCK + 1, PALLAS_BLOCK) if padded % b == 0
    )


def pallas_block_sizes(padded_t: int, padded_s: int):
    """The Pallas flash kernel's ``BlockSizes`` for query and key lengths padded to 128:
    ``pallas_block`` of each, forward and backward alike, one example per block."""
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash

    block_q, block_k = pallas_block(padded_t), pallas_block(padded_s)
    return pallas_flash.BlockSizes(
        block_q=block_q,
        block_k_major=block_k,
        block_k=block_k,
        block_b=1,
        block_q_major_dkv=block_q,
        block_k_major_dkv=block_k,
        block_k_dkv=block_k,
        block_q_dkv=block_q,
        block_k_major_dq=block_k,
        block_k_dq=block_k,
        block_q_dq=block_q,
    )


def attend_pallas(
    q_BTNH: jax.Array,
    k_BTNH: jax.Array,
    v_BTNH: jax.Array,
    bias: jax.Array | None = None,
    key_mask_BS: jax.Array | None = None,
    segment_BS: jax.Array | None = None,
) -> jax.Array:
    """Pallas's TPU flash-attention kernel (``jax.experimental.pallas.ops.tpu.flash_attention``).

    That kernel takes a bias (its ``ab`` input, (B, N, T, S)), so ALiBi goes through it; the
    other Pallas TPU kernel, splash attention (``ops.tpu.splash_attention``), takes masks but no
    bias, so it is not used here. The kernel computes ``softmax((q k^T + ab) * sm_scale)``, so
    the bias is passed divided by the scale. It needs sequence lengths divisible by its
    blocks: T and S are padded to a multiple of ``PALLAS_BLOCK``, and the blocks follow the
    padded lengths (``pallas_block_sizes``) instead of the kernel's 128 defaults. Padding is
    masked with the kernel's segment ids (a query attends to the keys of its own segment):
    every query of the sequence is in segment 1, and so is every key except the block padding
    and the keys that ``key_mask_BS`` marks as padded (segment 0); no bias array carries the
    mask. A packed batch's segments (``segment_BS``, padding in segment 0) are the kernel's
    segment ids as they are, the block padding in a segment of its own (-2): every query has a
    key of its own segment (itself), and a key that ``key_mask_BS`` marks as padded goes to
    segment -1, which no query is in. TPU only (Mosaic); on CPU it runs under
    ``jax.experimental.pallas.tpu.force_tpu_interpret_mode()`` (the tests do).

    Args:
      q_BTNH: queries.
      k_BTNH: keys.
      v_BTNH: values.
      bias: None or a logit bias broadcastable to (B, N, T, S).
      key_mask_BS: None, or (B, S) with 0 at padded keys, which no query then attends to.
      segment_BS: None, or int (B, S) segments of a packed batch (self-attention: T = S); a
        query attends to the keys of its own segment only.

    Returns:
      (B, T, N, H) in v's dtype.
    """
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash

    batch, tokens, heads, head_dim = q_BTNH.shape
    keys = k_BTNH.shape[1]
    padded_t, padded_s = (-(-n // PALLAS_BLOCK) * PALLAS_BLOCK for n in (tokens, keys))

    def to_bnth(x_BTNH, padded):
        x_BNTH = jnp.swapaxes(x_BTNH, 1, 2)
        return jnp.pad(x_BNTH, ((0, 0), (0, 0), (0, padded - x_BNTH.shape[2]), (0, 0)))

    q, k, v = to_bnth(q_BTNH, padded_t), to_bnth(k_BTNH, padded_s), to_bnth(v_BTNH, padded_s)
    scale = 1 / math.sqrt(head_dim)
    ab = None
    if bias is not None:
        ab = jnp.broadcast_to(bias_4d(bias), (batch, heads, tokens, keys)) * (1 / scale)
        ab = jnp.pad(ab, ((0, 0), (0, 0), (0, padded_t - tokens), (0, padded_s - keys)))
        ab = ab.astype(jnp.float32)
    segments = None
    if segment_BS is not None:
        if segment_BS.shape != (batch, keys) or tokens != keys:
            raise ValueError(
                f"segment_BS has shape {tuple(segment_BS.shape)}; expected (B, S) = "
                f"{(batch, keys)} with as many queries as keys (self-attention)"
            )
        # The block padding in a segment of its own (-2), so that the row's padding (segment
        # 0) attends among itself as in "xla"; keys the key mask drops in -1, no query's.
        ids_q = jnp.pad(
            segment_BS.astype(jnp.int32), ((0, 0), (0, padded_t - tokens)), constant_values=-2
        )
        ids_kv = segment_BS.astype(jnp.int32)
        if key_mask_BS is not None:
            ids_kv = jnp.where(key_mask_BS > 0, ids_kv, -1)
        ids_kv = jnp.pad(ids_kv, ((0, 0), (0, padded_s - keys)), constant_values=-2)
        segments = pallas_flash.SegmentIds(q=ids_q, kv=ids_kv)
    elif key_mask_BS is not None or (padded_t, padded_s) != (tokens, keys):
        ids_q = jnp.broadcast_to(jnp.arange(padded_t) < tokens, (batch, padded_t))
        ids_kv = jnp.broadcast_to(jnp.arange(padded_s) < keys, (batch, padded_s))
        if key_mask_BS is not None:
            ids_kv = ids_kv & jnp.pad(key_mask_BS > 0, ((0, 0), (0, padded_s - keys)))
        segments = pallas_flash.SegmentIds(q=ids_q.astype(jnp.int32), kv=ids_kv.astype(jnp.int32))
    block_sizes = pallas_block_sizes(padded_t, padded_s)
    o_BNTH = pallas_flash.flash_attention(
        q, k, v, ab, segments, sm_scale=scale, block_sizes=block_sizes
    )
    return jnp.swapaxes(o_BNTH[:, :, :tokens], 1, 2).astype(v_BTNH.dtype)


def _check_cudnn(where: str, dtype: jnp.dtype, head_dim: int) -> None:
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"{where} needs model.dtype 'bfloat16' or 'float16'; got {dtype.name}")
    if head_dim % 8 or head_dim > 256:
        raise ValueError(
            f"{where} needs head_dim (width / num_heads) a multiple of 8 and <= 128 "
            f"(<= 256 on Hopper and later); got {head_dim}"
        )


def _check_pallas(where: str, dtype: jnp.dtype, head_dim: int) -> None:
    del dtype
    if head_dim > 128 and head_dim % 128:
        raise ValueError(
            f"{where} needs head_dim (width / num_heads) <= 128 or a multiple of 128 (the "
            f"kernel's lane width); got {head_dim}"
        )


@dataclasses.dataclass(frozen=True)
class Backend:
    """One attention backend.

    Attributes:
      attend: (q_BTNH, k_BTNH, v_BTNH, bias or None, key_mask_BS or None, segment_BS or
        None) -> o_BTNH in v's dtype; ``key_mask_BS`` (B, S) is 0 at padded keys,
        ``segment_BS`` (B, S) the segments of a packed batch (a query attends within its own).
      platforms: the ``jax.default_backend()`` names it runs on.
      check: None, or (where, dtype, head_dim) -> None, raising ``ValueError`` that starts with
        ``where`` when the activation dtype or head_dim rules it out.
      packs: whether it keeps the segments of a packed batch apart (``check_attention``
        refuses packed batches where it does not).
    """

    attend: Callable[..., jax.Array]
    platforms: tuple[str, ...]
    check: Callable[[str, jnp.dtype, int], None] | None = None
    packs: bool = True


EVERYWHERE = ("cpu", "gpu", "cuda", "rocm", "tpu")
PACKED_REFUSED = (
    "model.attention={name!r} cannot keep the images of a packed batch apart (its key mask is "
    "sequence lengths, padding only, not segments); use 'xla', 'chunked' or 'pallas' with "
    "naflex.pack, or turn packing off"
)


def _masked(bias, mask, segments):
    """The bias with the key mask and the segments added (``with_key_mask``,
    ``with_segments``): how "xla" and "xla_cpu" take them."""
    return with_segments(with_key_mask(bias, mask), segments)


# "xla" and "xla_cpu" add the key mask and the segments to the bias (``with_key_mask``,
# ``with_segments``), "chunked" the key mask and each key block's segments; "cudnn" takes the
# key mask as sequence lengths and refuses segments, "pallas" takes both as segment ids.
BACKENDS: dict[str, Backend] = {
    "xla": Backend(
        lambda q, k, v, bias, mask, seg: attend(q, k, v, _masked(bias, mask, seg)), EVERYWHERE
    ),
    "xla_cpu": Backend(
        lambda q, k, v, bias, mask, seg: attend_cpu_batches(q, k, v, _masked(bias, mask, seg)),
        ("cpu",),
    ),
    "chunked": Backend(
        lambda q, k, v, bias, mask, seg: attend_chunked(
            q, k, v, with_key_mask(bias, mask), segment_BS=seg
        ),
        EVERYWHERE,
    ),
    "cudnn": Backend(
        lambda q, k, v, bias, mask, seg: attend_cudnn(q, k, v, bias, mask, seg),
        ("gpu", "cuda"),
        _check_cudnn,
        packs=False,
    ),
    "pallas": Backend(
        lambda q, k, v, bias, mask, seg: attend_pallas(q, k, v, bias, mask, seg),
        ("tpu",),
        _check_pallas,
    ),
}


def check_attention_name(name: str) -> None:
    """``name`` must name a backend (a ``BACKENDS`` key)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention={name!r}; expected one of {sorted(BACKENDS)}")


def check_attention(
    name: str,
    *,
    platform: str,
    dtype: Any,
    head_dim: int,
    packed: bool = False,
) -> None:
    """Raise, naming ``model.attention`` and what it needs, where a backend cannot run.

    Called outside ``jit`` before the first step (``train.train_and_evaluate``, from the
    model; ``options.check_model_attention``, from a config), so that a run fails at once and
    not in the middle of compiling. No backend restricts the token count: ``attend_cudnn`` pads
    an odd one, ``attend_pallas`` pads to its blocks.

    Args:
      name: a ``BACKENDS`` key.
      platform: the backend the steps run on (``jax.default_backend()``, or an export target).
      dtype: the activation dtype.
      head_dim: H.
      packed: the run attends packed batches (several images per row, ``naflex.pack``):
        refused where the backend cannot keep their segments apart (``Backend.packs``).
    """
    check_attention_name(name)
    backend, where = BACKENDS[name], f"model.attention={name!r}"
    if platform not in backend.platforms:
        raise ValueError(
            f"{where} needs platform in {list(backend.platforms)}; this run is on "
            f"{platform!r} (use 'xla' or 'chunked', which run everywhere)"
        )
    if backend.check is not None:
        backend.check(where, jnp.dtype(dtype), head_dim)
    if packed and not backend.packs:
        raise ValueError(PACKED_REFUSED.format(name=name))


def inference_backend(name: str, platform: str, device_count: int) -> str:
    """The backend an evaluation step uses for a model trained with ``name``, on this host.

    One XLA:CPU device: ``"xla_cpu"`` for ``"xla"`` (the formula with the batch cut to fit the
    CPU's cache and use both cores; the same logits to float32 rounding). Anywhere else, and
    for every other backend, ``name`` itself (no gain measured or expected on GPU/TPU or over
    several devices). Decided outside ``jit``, from host facts.

    Args:
      name: the model's backend (``config.model.attention``).
      platform: where the step runs, e.g. ``"cpu"``, ``"gpu"``, ``"tpu"``.
      device_count: devices of the step's mesh.
    """
    if name == "xla" and platform == "cpu" and device_count == 1:
        return "xla_cpu"
    return name
