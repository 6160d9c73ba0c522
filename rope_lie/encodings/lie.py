"""Lie-group primitives shared by the rotary families.

- ``skew_from_upper``: a skew-symmetric matrix from the strict upper triangle of a raw array
  (LieRE's parameterisation: ``triu(W, 1) - triu(W, 1)^T``).
- ``expm_skew``: the matrix exponential of skew-symmetric matrices, i.e. a rotation in SO(H).
  Scaling and squaring with a degree-15 Taylor polynomial evaluated by Paterson-Stockmeyer
  (6 matrix products), a per-matrix number of squarings (no fixed squaring limit, so no NaN or
  overflow at any finite norm, unlike ``jax.scipy.linalg.expm``), and a custom VJP whose backward
  pass is the Frechet derivative ``L_exp(A^T)[G]`` computed in forward mode (no stored
  intermediates).
- ``cayley``: ``P = (I - S)(I + S)^-1``, orthogonal for skew-symmetric ``S``.
- ``rotate_pairs``: the 2x2 rotation of interleaved channel pairs (2j, 2j+1) by angles.
- ``apply_blocks``: left-multiplication of contiguous b x b blocks of channels by rotations.

Everything is computed in float32 whatever the input dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Taylor degree and the bound on the spectral radius of the scaled matrix. For a normal matrix
# (skew-symmetric ones are) the truncation error in the spectral norm is at most
# theta^(m+1)/(m+1)! * e^theta = 2^16/16! * e^2 ~ 2.3e-8, below float32 resolution.
_DEGREE = 15
_THETA = 2.0
_MAX_SQUARINGS = 64  # only reached by non-finite input; keeps the loop finite
_TAYLOR_COEFFS = tuple(1.0 / math.factorial(k) for k in range(_DEGREE + 1))


def skew_from_upper(raw_XHH: jax.Array) -> jax.Array:
    """Skew-symmetric matrices ``U - U^T`` from the strict upper triangle ``U`` of ``raw``.

    Args:
      raw_XHH: array (..., H, H); entries on and below the diagonal are ignored.

    Returns:
      (..., H, H) skew-symmetric array of the same dtype.
    """
    upper = jnp.triu(raw_XHH, k=1)
    return upper - jnp.swapaxes(upper, -1, -2)


def _taylor_ps(b_XHH: jax.Array) -> jax.Array:
    """Degree-15 Taylor polynomial of exp at ``b`` by Paterson-Stockmeyer (6 products)."""
    eye = jnp.eye(b_XHH.shape[-1], dtype=b_XHH.dtype)
    b2 = b_XHH @ b_XHH
    b3 = b2 @ b_XHH
    b4 = b2 @ b2
    c = _TAYLOR_COEFFS

    def chunk(i):
        return c[4 * i] * eye + c[4 * i + 1] * b_XHH + c[4 * i + 2] * b2 + c[4 * i + 3] * b3

    poly = chunk(3)
    for i in (2, 1, 0):
        poly = chunk(i) + b4 @ poly
    return poly


def num_squarings(a_XHH: jax.Array) -> jax.Array:
    """Squarings s such that the spectral radius of ``a / 2^s`` is at most ``_THETA``.

    Uses ``rho(A) <= ||A||_F / sqrt(2)``, exact for a single rotation plane and valid for every
    real skew-symmetric matrix (its eigenvalues come in pairs +-i*lambda).

    Returns:
      int32 array with the batch shape of ``a``.
    """
    rho = jnp.sqrt(jnp.sum(jnp.square(a_XHH), axis=(-2, -1)) / 2.0)
    s = jnp.ceil(jnp.log2(jnp.maximum(rho, _THETA) / _THETA))
    s = jnp.where(jnp.isfinite(s), s, _MAX_SQUARINGS)
    return jnp.clip(s, 0, _MAX_SQUARINGS).astype(jnp.int32)


def _expm_skew_impl(a_XHH: jax.Array) -> jax.Array:
    s_X = num_squarings(a_XHH)
    scale_X = jnp.exp2(-s_X.astype(a_XHH.dtype))
    r_XHH = _taylor_ps(a_XHH * scale_X[..., None, None])

    def body(carry):
        k, r = carry
        squared = r @ r
        r = jnp.where((k < s_X)[..., None, None], squared, r)
        return k + 1, r

    # The loop runs max(s) times; matrices needing fewer squarings are masked.
    _, r_XHH = jax.lax.while_loop(lambda c: c[0] < jnp.max(s_X), body, (jnp.int32(0), r_XHH))
    return r_XHH


@jax.custom_vjp
def _expm_skew(a_XHH: jax.Array) -> jax.Array:
    return _expm_skew_impl(a_XHH)


def _expm_skew_fwd(a_XHH):
    return _expm_skew_impl(a_XHH), a_XHH


def _expm_skew_bwd(a_XHH, g_XHH):
    # <L_exp(A)[E], G> = <E, L_exp(A^T)[G]>: the adjoint is a Frechet derivative at A^T, which
    # forward mode computes through the same scaling and squaring without storing intermediates.
    _, grad = jax.jvp(_expm_skew_impl, (jnp.swapaxes(a_XHH, -1, -2),), (g_XHH,))
    return (grad,)


_expm_skew.defvjp(_expm_skew_fwd, _expm_skew_bwd)
# Compiled once per shape: called eagerly, the while loop would otherwise be retraced each call.
# Under an outer jit this is inlined.
_expm_skew_jit = jax.jit(_expm_skew)


def expm_skew(a_XHH: jax.Array) -> jax.Array:
    """Matrix exponential of (batched) skew-symmetric matrices, in float32.

    Accurate to float32 resolution times the number of squarings (about 1e-5 at norm 1e2 and
    1e-4 at norm 1e3, see tests); finite for every finite input.

    Args:
      a_XHH: (..., H, H) skew-symmetric matrices (not checked: the caller builds them skew).

    Returns:
      (..., H, H) float32 rotation matrices ``exp(a)``.
    """
    a_XHH = jnp.asarray(a_XHH)
    if a_XHH.ndim < 2 or a_XHH.shape[-1] != a_XHH.shape[-2]:
        raise ValueError(f"expm_skew expects (..., H, H) square matrices, got shape {a_XHH.shape}")
    return _expm_skew_jit(a_XHH.astype(jnp.float32))


@jax.jit
def cayley(s_XHH: jax.Array) -> jax.Array:
    """Cayley transform ``P = (I - S)(I + S)^-1`` of skew-symmetric ``S``, in float32.

    ``I + S`` is invertible for every real skew-symmetric ``S`` (its eigenvalues are 1 + i*l),
    and ``(I - S)`` commutes with ``(I + S)^-1``, so ``P = solve(I + S, I - S)``.

    Args:
      s_XHH: (..., H, H) skew-symmetric matrices.

    Returns:
      (..., H, H) float32 orthogonal matrices.
    """
    s_XHH = jnp.asarray(s_XHH, jnp.float32)
    eye = jnp.eye(s_XHH.shape[-1], dtype=jnp.float32)
    return jnp.linalg.solve(eye + s_XHH, jnp.broadcast_to(eye - s_XHH, s_XHH.shape))


@jax.jit
def rotate_pairs(x_XH: jax.Array, angle_XF: jax.Array) -> jax.Array:
    """Rotate interleaved channel pairs (2j, 2j+1) by ``angle[..., j]``.

    (a, b) -> (a cos t - b sin t, a sin t + b cos t); channels past 2F are left unchanged.

    Args:
      x_XH: (..., H) array, any float dtype.
      angle_XF: (..., F) angles broadcastable against x's leading axes, F <= H // 2.

    Returns:
      (..., H) array in x's dtype; the rotation itself is computed in float32.
    """
    num_pairs = angle_XF.shape[-1]
    head_dim = x_XH.shape[-1]
    x32 = x_XH.astype(jnp.float32)
    pairs = x32[..., : 2 * num_pairs].reshape(*x32.shape[:-1], num_pairs, 2)
    angle = angle_XF.astype(jnp.float32)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)
    rotated = rotated.reshape(*rotated.shape[:-2], 2 * num_pairs)
    if 2 * num_pairs < head_dim:
        rotated = jnp.concatenate([rotated, x32[..., 2 * num_pairs :]], axis=-1)
    return rotated.astype(x_XH.dtype)


def pair_rotation_blocks(angle_XF: jax.Array) -> jax.Array:
    """The 2x2 rotation matrices [[cos, -sin], [sin, cos]] for angles, shape (..., F, 2, 2)."""
    cos, sin = jnp.cos(angle_XF), jnp.sin(angle_XF)
    return jnp.stack([jnp.stack([cos, -sin], -1), jnp.stack([sin, cos], -1)], -2)


@jax.jit
def apply_blocks(x_BTNH: jax.Array, r_XTNKbb: jax.Array) -> jax.Array:
    """Left-multiply contiguous b x b channel blocks of ``x`` by rotations.

    Block r acts on channels [r*b, (r+1)*b); channels past K*b are left unchanged.

    Args:
      x_BTNH: queries or keys, any float dtype.
      r_XTNKbb: (T, N, K, b, b) rotations shared by the batch, or (B, T, N, K, b, b) per example.

    Returns:
      (B, T, N, H) array in x's dtype, computed in float32.
    """
    num_blocks, block = r_XTNKbb.shape[-3], r_XTNKbb.shape[-1]
    used = num_blocks * block
    x32 = x_BTNH.astype(jnp.float32)
    xb = x32[..., :used].reshape(*x32.shape[:-1], num_blocks, block)
    spec = "TNKij,BTNKj->BTNKi" if r_XTNKbb.ndim == 5 else "BTNKij,BTNKj->BTNKi"
    out = jnp.einsum(spec, r_XTNKbb.astype(jnp.float32), xb).reshape(*x32.shape[:-1], used)
    if used < x32.shape[-1]:
        out = jnp.concatenate([out, x32[..., used:]], axis=-1)
    return out.astype(x_BTNH.dtype)
