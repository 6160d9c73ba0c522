"""ALiBi (Press et al., arXiv:2108.12409), with CROMA's Euclidean distance on 2D/3D grids.

A bias added to the attention logits of head n (before the softmax), nothing added to q or k:

    bias[n, t, s] = -slope_n * ||p_t - p_s||_2,    slope_n = 2^(-8n/N) for N a power of two,

with ``||p_t - p_s|| = |i - j|`` in 1D and the Euclidean norm of the position difference for
A >= 2 (2D ALiBi of CROMA, Fuller et al., arXiv:2311.00566). The bias is symmetric (no causal
mask), zero on the diagonal and translation invariant. The slopes are ALiBi's reference
``get_slopes`` (Press et al., github.com/ofirpress/attention_with_linear_biases, also used by
CROMA): for N a power of two the geometric sequence 2^(-8/N), 2^(-16/N), ..., 2^(-8); for other
N the sequence of the next lower power of two, P = 2^floor(log2 N), followed by every other
slope of the sequence for 2P (its 1st, 3rd, ...) until there are N, so 3-, 6- and 12-head models
match published ones (N = 6: 2^-2, 2^-4, 2^-6, 2^-8, then 2^-1, 2^-3).

Bias-family contract:

- ``init(key, *, num_heads, head_dim, num_axes, learnable=False) -> params``: ``{}`` for fixed
  slopes; ``{"log_slopes_N"}`` initialised to log of the fixed slopes when ``learnable`` (the
  slopes ``exp(log_slopes)`` stay positive).
- ``bias(params, pos_TA, pos_SA, *, num_heads, num_prefix=0) -> bias_NTS`` (or
  ``pos_BTA, pos_BSA -> bias_BNTS``), float32. The model calls
  ``bias(params, pos_TA, pos_TA, num_heads=N, num_prefix=P)`` with the token positions of
  ``positions.grid_positions`` and adds the result to the logits of every layer that uses it.
  ``num_heads`` and ``num_prefix`` are model-level arguments it always passes, not config
  hyperparameters, so ``APPLY_HPARAMS = ()`` (``learnable`` is read off the params).

Prefix (class) tokens, the first ``num_prefix`` of both T and S, get zero bias against every
token: their rows and columns are zero (CROMA has no class token; zero is the neutral choice).
Axis order of positions = the array order of the input; 1 to 3 axes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from rope_lie.encodings import _checks, family, state

_FAMILY = "alibi"
FAMILY = family.Family(
    name=_FAMILY,
    kind="bias",
    convention="integer",
    relative=True,
    apply_defaults={},  # learnable is read off the parameters
    # log_slopes_N (N,) when learnable
    stored_count=lambda num_heads, head_dim, num_axes, settings: (
        num_heads if settings["learnable"] else 0
    ),
    examples=(({"learnable": True}, (1, 2, 3)), ({}, (1, 2, 3))),
)
APPLY_HPARAMS: tuple[str, ...] = tuple(FAMILY.apply_defaults)


def slopes(num_heads: int) -> np.ndarray:
    """The fixed ALiBi slopes of the reference ``get_slopes`` (module docstring), float64 (N,)."""
    _checks.check_positive_int(num_heads, "num_heads", _FAMILY)
    return np.asarray(_reference_slopes(num_heads), np.float64)


def _power_of_two_slopes(n: int) -> np.ndarray:
    return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)


def _reference_slopes(n: int) -> np.ndarray:
    lower = 2 ** int(math.floor(math.log2(n)))
    if lower == n:
        return _power_of_two_slopes(n)
    return np.concatenate(
        [_power_of_two_slopes(lower), _reference_slopes(2 * lower)[0::2][: n - lower]]
    )


def init(
    key: jax.Array, *, num_heads: int, head_dim: int, num_axes: int, learnable: bool = False
) -> dict[str, jax.Array]:
    """Validate the configuration; create learnable log-slopes if asked.

    Args:
      key: unused (the learnable init is deterministic).
      num_heads: number of heads N.
      head_dim: head dimension H (unused by the bias, validated for the common signature).
      num_axes: number of position axes A.
      learnable: whether the slopes are parameters.

    Returns:
      ``{}``, or ``{"log_slopes_N": (N,) float32}`` when ``learnable``.
    """
    del key
    _checks.check_shape_args(num_heads, head_dim, num_axes, _FAMILY)
    if not isinstance(learnable, bool):
        raise ValueError(f"{_FAMILY}: learnable={learnable!r} must be True or False")
    arrays = {}
    if learnable:
        arrays = {"log_slopes_N": jnp.asarray(np.log(slopes(num_heads)), jnp.float32)}
    return family.params(
        _FAMILY,
        arrays,
        num_heads=num_heads,
        head_dim=head_dim,
        num_axes=num_axes,
        learnable=learnable,
    )


def _slopes_from_params(params: dict[str, jax.Array], num_heads: int) -> jax.Array:
    _checks.check_positive_int(num_heads, "num_heads", _FAMILY)
    family.check_made_for(params, _FAMILY, num_heads=num_heads)
    made = getattr(params, "encoder", None)  # parameters from init know whether they learn
    if made is not None and made.hparams["learnable"]:
        _checks.param(params, "log_slopes_N", _FAMILY)
    if not params:
        return jnp.asarray(slopes(num_heads), jnp.float32)
    if set(params) != {"log_slopes_N"}:
        raise ValueError(
            f"{_FAMILY} expects params {{}} or with key 'log_slopes_N', got keys {sorted(params)}"
        )
    log_slopes_N = params["log_slopes_N"]
    if log_slopes_N.shape != (num_heads,):
        raise ValueError(
            f"{_FAMILY}: log_slopes_N has shape {tuple(log_slopes_N.shape)} but num_heads="
            f"{num_heads} (expected shape ({num_heads},))"
        )
    return jnp.exp(log_slopes_N.astype(jnp.float32))


def _check_positions(pos_q: jax.Array, pos_k: jax.Array, num_prefix: int) -> None:
    _checks.check_positions(pos_q, _FAMILY)
    _checks.check_positions(pos_k, _FAMILY)
    if pos_k.ndim != pos_q.ndim:
        raise ValueError(
            f"{_FAMILY}: query and key positions must both be (T, A) or both (B, T, A), got "
            f"shapes {tuple(pos_q.shape)} and {tuple(pos_k.shape)}"
        )
    if pos_q.shape[-1] != pos_k.shape[-1]:
        raise ValueError(
            f"{_FAMILY}: query positions have A={pos_q.shape[-1]} axes but key positions have "
            f"A={pos_k.shape[-1]}"
        )
    if pos_q.ndim == 3 and pos_q.shape[0] != pos_k.shape[0]:
        raise ValueError(
            f"{_FAMILY}: query positions have B={pos_q.shape[0]} but key positions have "
            f"B={pos_k.shape[0]}"
        )
    _checks.check_nonnegative_int(num_prefix, "num_prefix", _FAMILY)
    if num_prefix > min(pos_q.shape[-2], pos_k.shape[-2]):
        raise ValueError(
            f"{_FAMILY}: num_prefix={num_prefix} exceeds the number of tokens "
            f"(T={pos_q.shape[-2]}, S={pos_k.shape[-2]})"
        )


def _distance(pos_q: jax.Array, pos_k: jax.Array) -> jax.Array:
    """||p_t - p_s|| over the last axis, shape (..., T, S), with finite gradients at 0."""
    diff_XTSA = pos_q[..., :, None, :] - pos_k[..., None, :, :]
    if diff_XTSA.shape[-1] == 1:
        return jnp.abs(diff_XTSA[..., 0])
    sq_XTS = jnp.sum(jnp.square(diff_XTSA), axis=-1)
    # sqrt has an infinite derivative at 0 (the diagonal): take it of a safe value there. "!= 0",
    # not "> 0": a NaN position must give a NaN bias, never a finite 0.
    nonzero = sq_XTS != 0
    return jnp.where(nonzero, jnp.sqrt(jnp.where(nonzero, sq_XTS, 1.0)), 0.0)


def bias(
    params: dict[str, jax.Array],
    pos_TA: jax.Array,
    pos_SA: jax.Array,
    *,
    num_heads: int,
    num_prefix: int = 0,
) -> jax.Array:
    """Attention-logit bias ``-slope_n * ||p_t - p_s||``, zero for prefix rows and columns.

    Args:
      params: ``{}`` or ``{"log_slopes_N": (N,)}`` from ``init``.
      pos_TA: query positions (T, A), or ``pos_BTA`` (B, T, A) per example.
      pos_SA: key positions (S, A), or ``pos_BSA`` (B, S, A); the same rank as pos_TA.
      num_heads: number of heads N (must match learnable params).
      num_prefix: number of prefix (class) tokens at the start of both T and S.

    Returns:
      float32 ``bias_NTS`` (N, T, S), or ``bias_BNTS`` (B, N, T, S) for per-example positions.
    """
    slope_N = _slopes_from_params(params, num_heads)
    _check_positions(jnp.asarray(pos_TA), jnp.asarray(pos_SA), num_prefix)
    family.check_made_for(params, _FAMILY, num_axes=jnp.shape(pos_TA)[-1])
    pos_q, pos_k = jnp.asarray(pos_TA, jnp.float32), jnp.asarray(pos_SA, jnp.float32)
    dist_XTS = _distance(pos_q, pos_k)
    is_grid_T = jnp.arange(pos_q.shape[-2]) >= num_prefix
    is_grid_S = jnp.arange(pos_k.shape[-2]) >= num_prefix
    dist_XTS = jnp.where(is_grid_T[:, None] & is_grid_S[None, :], dist_XTS, 0.0)
    # Heads go before (T, S): (N, T, S) for shared positions, (B, N, T, S) per example.
    dist_XNTS = dist_XTS[..., None, :, :]
    slope_XN11 = slope_N.reshape((1,) * (dist_XNTS.ndim - 3) + (-1, 1, 1))
    return -slope_XN11 * dist_XNTS


def precompute(
    params: dict[str, jax.Array],
    pos: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_prefix: int = 0,
) -> state.LogitBias:
    """The encoder state: the logit bias between every pair of tokens (queries = keys).

    Args:
      params: ``{}`` or ``{"log_slopes_N": (N,)}`` from ``init``.
      pos: ``pos_TA`` shared by the batch, or ``pos_BTA`` per example.
      num_heads: N (1 when heads share the slopes: then every head gets the first slope).
      head_dim: H (unused by the bias, validated for the common signature).
      num_prefix: prefix (class) tokens at the start of the sequence: zero bias.

    Returns:
      ``LogitBias`` of shape (1, N, T, T), or (B, N, T, T) per example; float32.
    """
    _checks.check_state_args(num_heads, head_dim, num_prefix, _FAMILY)
    family.check_made_for(params, _FAMILY, head_dim=head_dim)
    bias_XNTS = bias(params, pos, pos, num_heads=num_heads, num_prefix=num_prefix)
    return state.LogitBias(bias_XNTS if bias_XNTS.ndim == 4 else bias_XNTS[None])
