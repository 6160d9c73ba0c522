"""Lie-group primitives shared by the rotary families.

- ``skew_from_upper``: a skew-symmetric matrix from the strict upper triangle of a raw array
  (LieRE's parameterisation: ``triu(W, 1) - triu(W, 1)^T``).
- ``cayley``: ``P = (I - S)(I + S)^-1``, orthogonal for skew-symmetric ``S`` (a pivoted
  Gauss-Jordan inverse in plain JAX: jaxlib's CPU LU deadlocks in multi-layer programs).
- ``rotate_pairs``: the 2x2 rotation of interleaved channel pairs (2j, 2j+1) by angles.
- ``apply_blocks``: left-multiplication of contiguous b x b blocks of channels by rotations.
- ``rotate_spectral``: a rotation diagonal in the Fourier basis over the channels
  (Circulant-STRING's), by FFT or by products with the real DFT's tables.

Everything is computed in float32 whatever the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rope_lie.encodings import _sharding

__all__ = [
    "apply_blocks",
    "cayley",
    "dft_tables",
    "pair_rotation_blocks",
    "rotate_pairs",
    "rotate_spectral",
    "skew_from_upper",
]

# Every float32 contraction here at full float32 precision: XLA:GPU contracts float32 in TF32 by
# default (a block product's error 5e-4 of its largest value on an H100, in an earlier run of
# experiments/benchmarks/device/) and a TPU in bfloat16 passes.
_HIGHEST = jax.lax.Precision.HIGHEST


def on_matrix_batch(fn, a_XHH: jax.Array) -> jax.Array:
    """``fn`` on the (Z, H, H) flattening of a (..., H, H) batch, reshaped back to (..., H, H)."""
    shape = a_XHH.shape
    return fn(a_XHH.reshape(-1, *shape[-2:])).reshape(shape)


def skew_from_upper(raw_XHH: jax.Array) -> jax.Array:
    """Skew-symmetric matrices ``U - U^T`` from the strict upper triangle ``U`` of ``raw``.

    Args:
      raw_XHH: array (..., H, H); entries on and below the diagonal are ignored.

    Returns:
      (..., H, H) skew-symmetric array of the same dtype.
    """
    upper = jnp.triu(raw_XHH, k=1)
    return upper - jnp.swapaxes(upper, -1, -2)


def _inverse_gauss_jordan(a_ZHH: jax.Array) -> jax.Array:
    """Inverses by Gauss-Jordan elimination with partial pivoting, in plain JAX operations.

    Not ``jnp.linalg.solve``: jaxlib 0.10's CPU LU kernel splits a batch over XLA's intra-op
    thread pool and blocks a pool thread until its parts finish, so a dozen independent batched
    LUs in one program (one per layer) occupy every thread of a 2-core pool and deadlock
    (reproduced: 12 solves of 3 x 64 x 64 in one jit hang on jax 0.10.2, 2 cores). H steps of
    O(H^2) work per matrix; the Cayley transform needs one per head per step.
    """
    h = a_ZHH.shape[-1]
    eye = jnp.eye(h, dtype=a_ZHH.dtype)
    aug = jnp.concatenate([a_ZHH, jnp.broadcast_to(eye, a_ZHH.shape)], axis=-1)  # (Z, H, 2H)
    rows = jnp.arange(h)

    def step(k, aug):
        col_ZH = aug[:, :, k]
        pivot_Z = jnp.argmax(jnp.where(rows >= k, jnp.abs(col_ZH), -1.0), axis=-1)
        # Swap rows k and pivot (a no-op when they are the same row).
        row_k = aug[:, k]
        row_p = jnp.take_along_axis(aug, pivot_Z[:, None, None], axis=1)[:, 0]
        swap_ZH = (rows == k).astype(aug.dtype)[None] - jax.nn.one_hot(pivot_Z, h, dtype=aug.dtype)
        aug = aug + swap_ZH[:, :, None] * (row_p - row_k)[:, None, :]
        pivot_row = aug[:, k] / aug[:, k, k][:, None]
        aug = aug - aug[:, :, k][:, :, None] * pivot_row[:, None, :]
        return aug.at[:, k].set(pivot_row)

    # unroll=4: faster on CPU than a rolled loop (benchmarks README, section 14).
    return jax.lax.fori_loop(0, h, step, aug, unroll=4)[:, :, h:]


@jax.custom_vjp
def _cayley(s_ZHH: jax.Array) -> jax.Array:
    return _cayley_fwd(s_ZHH)[0]


def _cayley_fwd(s_ZHH):
    # (I - S)(I + S)^-1 = (2I - (I + S))(I + S)^-1 = 2 M - I with M = (I + S)^-1.
    eye = jnp.eye(s_ZHH.shape[-1], dtype=s_ZHH.dtype)[None]  # (1, H, H)
    a_ZHH = eye + s_ZHH
    m_ZHH = _inverse_gauss_jordan(a_ZHH)
    # One Newton step M + M (I - A M), two products per head, halves the error left by the
    # elimination (benchmarks README, section 14); the float32 residual limits it beyond that.
    residual = eye - jnp.matmul(a_ZHH, m_ZHH, precision=_HIGHEST)
    m_ZHH = m_ZHH + jnp.matmul(m_ZHH, residual, precision=_HIGHEST)
    return 2.0 * m_ZHH - eye, m_ZHH


def _cayley_bwd(m_ZHH, p_bar_ZHH):
    # dP = 2 dM = -2 M dS M, so S_bar = -2 M^T P_bar M^T.
    m_t = jnp.matrix_transpose(m_ZHH)
    return (
        -2.0 * jnp.matmul(jnp.matmul(m_t, p_bar_ZHH, precision=_HIGHEST), m_t, precision=_HIGHEST),
    )


_cayley.defvjp(_cayley_fwd, _cayley_bwd)


@jax.jit
def cayley(s_XHH: jax.Array) -> jax.Array:
    """Cayley transform ``P = (I - S)(I + S)^-1`` of skew-symmetric ``S``, in float32.

    ``I + S`` is invertible for every real skew-symmetric ``S`` (its eigenvalues are 1 + i*l),
    and ``(I - S)`` commutes with ``(I + S)^-1``, so ``P = 2 (I + S)^-1 - I``. The inverse is a
    pivoted Gauss-Jordan elimination in plain JAX (no LAPACK call: see
    ``_inverse_gauss_jordan``); the VJP is ``-2 M^T P_bar M^T`` with ``M = (I + S)^-1``.

    Args:
      s_XHH: (..., H, H) skew-symmetric matrices.

    Returns:
      (..., H, H) float32 orthogonal matrices.
    """
    s_XHH = jnp.asarray(s_XHH, jnp.float32)
    if s_XHH.size == 0:
        return jnp.zeros(s_XHH.shape, jnp.float32)
    return on_matrix_batch(_cayley, s_XHH)


@jax.jit
def rotate_pairs(x_XH: jax.Array, angle_XF: jax.Array) -> jax.Array:
    """Rotate interleaved channel pairs (2j, 2j+1) by ``angle[..., j]``.

    (a, b) -> (a cos t - b sin t, a sin t + b cos t); channels past 2F are left unchanged.
    Computed as ``x * cos + swap(x) * sin`` with swap (a, b) -> (b, a) and sin's pair signs
    (-, +): one elementwise pass that XLA fuses, faster than slicing the pairs apart and
    stacking them again (benchmarks README, section 14).

    Args:
      x_XH: (..., H) array, any float dtype.
      angle_XF: (..., F) angles broadcastable against x's leading axes, F <= H // 2.

    Returns:
      (..., H) array in x's dtype; the rotation itself is computed in float32.
    """
    num_pairs = angle_XF.shape[-1]
    head_dim = x_XH.shape[-1]
    x32 = x_XH.astype(jnp.float32)
    angle = angle_XF.astype(jnp.float32)
    # Angles may lack x's leading axes (shared by the batch): prepend them, of size 1.
    angle = jnp.expand_dims(angle, tuple(range(x32.ndim - angle.ndim)))
    cos_XH = jnp.repeat(jnp.cos(angle), 2, axis=-1)
    sin = jnp.sin(angle)
    sin_XH = jnp.stack([-sin, sin], axis=-1).reshape(*sin.shape[:-1], 2 * num_pairs)
    rotated = x32[..., : 2 * num_pairs]
    swapped = rotated.reshape(*rotated.shape[:-1], num_pairs, 2)[..., ::-1]
    rotated = rotated * cos_XH + swapped.reshape(rotated.shape) * sin_XH
    if 2 * num_pairs < head_dim:
        rotated = jnp.concatenate([rotated, x32[..., 2 * num_pairs :]], axis=-1)
    return rotated.astype(x_XH.dtype)


def pair_rotation_blocks(angle_XF: jax.Array) -> jax.Array:
    """The 2x2 rotation matrices [[cos, -sin], [sin, cos]] for angles, shape (..., F, 2, 2)."""
    cos, sin = jnp.cos(angle_XF), jnp.sin(angle_XF)
    return jnp.stack([jnp.stack([cos, -sin], -1), jnp.stack([sin, cos], -1)], -2)


# Which product multiplies the b x b blocks, per platform (``jax.lax.platform_dependent``: the
# program lowered for a platform holds that platform's product alone; nothing is read from the
# host while tracing, so an export for another platform gets that platform's):
# - "einsum": one ``dot_general`` per call (TNKij,BTNKj->BTNKi), XLA:CPU's path;
# - "broadcast": ``sum_j r[..., i, j] x[..., j]`` as a broadcast multiply and a sum over j,
#   elementwise work that XLA fuses with x's load and conversion into one loop (no
#   ``dot_general``, no layout copies of x). On a GPU the einsum is a batched product of
#   T x N x K tiny matrices with the batch axis moved inside.
# - "adds": ``sum_j r[..., :, j] x[..., j]`` as b multiply-adds of r's column j by x's channel
#   j: elementwise work with no reduction over a minor axis of size b. An option for GPUs: on
#   an H200 the broadcast's forward and backward held about 2 ms a ViT-B/16 step of layout
#   copies of x (``input_transpose_fusion``; benchmarks README, section 13), which a sum of
#   slices may not need. The device queue times it (the variant ``product=adds``).
# - "by_size": the broadcast for blocks up to ``BROADCAST_MAX_BLOCK``, the einsum above. GPUs'
#   and TPUs': on an H100 at ViT-B/16's shapes the two tied at 8 x 8 blocks, and at 64 x 64
#   (dense LieRE) the broadcast took 6x the einsum's time with the einsum in TF32, 3.7x with it
#   in float32 (benchmarks README, section 13).
# Read when a program is traced: a change needs ``jax.clear_caches()`` to reach ``apply_blocks``.
BLOCK_PRODUCTS: dict[str, str] = {"cpu": "einsum", "default": "by_size"}
BROADCAST_MAX_BLOCK = 16


def _blocks_einsum(r32: jax.Array, xb_BTNKb: jax.Array) -> jax.Array:
    """r x per block with one ``einsum``: r32 (T, N|1, K, b, b) or (B, T, N|1, K, b, b)."""
    heads = "N" if r32.shape[-4] == xb_BTNKb.shape[2] else ""
    if not heads:  # one set of rotations for all heads
        r32 = jnp.squeeze(r32, axis=-4)
    spec = ("" if r32.ndim == 4 + len(heads) else "B") + f"T{heads}Kij,BTNKj->BTNKi"
    return jnp.einsum(spec, r32, xb_BTNKb, precision=_HIGHEST)


def _blocks_broadcast(r32: jax.Array, xb_BTNKb: jax.Array) -> jax.Array:
    """r x per block as a broadcast multiply summed over j (``BLOCK_PRODUCTS``); N = 1 and
    shared rotations broadcast."""
    r_XTNKbb = r32 if r32.ndim == 6 else r32[None]
    return jnp.sum(r_XTNKbb * xb_BTNKb[..., None, :], axis=-1)


def _blocks_adds(r32: jax.Array, xb_BTNKb: jax.Array) -> jax.Array:
    """r x per block as b multiply-adds, column j of r by channel j of x (``BLOCK_PRODUCTS``);
    N = 1 and shared rotations broadcast."""
    r_XTNKbb = r32 if r32.ndim == 6 else r32[None]
    out = r_XTNKbb[..., 0] * xb_BTNKb[..., 0:1]
    for j in range(1, r_XTNKbb.shape[-1]):
        out = out + r_XTNKbb[..., j] * xb_BTNKb[..., j : j + 1]
    return out


def _blocks_by_size(r32: jax.Array, xb_BTNKb: jax.Array) -> jax.Array:
    """The broadcast for blocks up to ``BROADCAST_MAX_BLOCK``, the einsum above."""
    if r32.shape[-1] <= BROADCAST_MAX_BLOCK:
        return _blocks_broadcast(r32, xb_BTNKb)
    return _blocks_einsum(r32, xb_BTNKb)


_BLOCK_PRODUCT_FNS = {
    "einsum": _blocks_einsum,
    "broadcast": _blocks_broadcast,
    "adds": _blocks_adds,
    "by_size": _blocks_by_size,
}


def block_product(r32: jax.Array, xb_BTNKb: jax.Array) -> jax.Array:
    """``r @ x`` per block, float32, with the product ``BLOCK_PRODUCTS`` names for the platform
    the program is lowered for.

    Args:
      r32: (T, N, K, b, b) or (B, T, N, K, b, b) float32 rotations; N = 1 for every head.
      xb_BTNKb: (B, T, N, K, b) float32 channel blocks.

    Returns:
      (B, T, N, K, b) float32.
    """
    for platform, name in BLOCK_PRODUCTS.items():
        if name not in _BLOCK_PRODUCT_FNS:
            raise ValueError(
                f"BLOCK_PRODUCTS[{platform!r}]={name!r}; expected one of {list(_BLOCK_PRODUCT_FNS)}"
            )
    per_platform = {p: _BLOCK_PRODUCT_FNS[n] for p, n in BLOCK_PRODUCTS.items() if p != "default"}
    default = _BLOCK_PRODUCT_FNS[BLOCK_PRODUCTS["default"]]
    return jax.lax.platform_dependent(r32, xb_BTNKb, default=default, **per_platform)


@jax.jit
def apply_blocks(x_BTNH: jax.Array, r_XTNKbb: jax.Array) -> jax.Array:
    """Left-multiply contiguous b x b channel blocks of ``x`` by rotations.

    Block r acts on channels [r*b, (r+1)*b); channels past K*b are left unchanged. The product
    is the platform's (``BLOCK_PRODUCTS``; equal to float32 rounding).

    Args:
      x_BTNH: queries or keys, any float dtype.
      r_XTNKbb: (T, N, K, b, b) rotations shared by the batch, or (B, T, N, K, b, b) per example;
        N = 1 applies the same rotations to every head.

    Returns:
      (B, T, N, H) array in x's dtype, computed in float32.
    """
    num_blocks, block = r_XTNKbb.shape[-3], r_XTNKbb.shape[-1]
    used = num_blocks * block
    x32 = x_BTNH.astype(jnp.float32)
    xb = x32[..., :used].reshape(*x32.shape[:-1], num_blocks, block)
    r32 = r_XTNKbb.astype(jnp.float32)
    if r32.ndim == 6:  # per example: split as x is (Explicit mesh axes; else unchanged)
        r32 = _sharding.split_batch(r32, _sharding.batch_axes(x_BTNH))
    out = block_product(r32, xb).reshape(*x32.shape[:-1], used)
    if used < x32.shape[-1]:
        out = jnp.concatenate([out, x32[..., used:]], axis=-1)
    return out.astype(x_BTNH.dtype)


# How ``rotate_spectral`` moves x to the Fourier basis and back, per platform (the platform
# the program is lowered for; "default" for the others):
# - "fft": ``jnp.fft.rfft`` and ``irfft`` over the channels. Every platform's: the encoders'
#   numbers (goldens, studies) were made with it.
# - "dft": the same two transforms as float32 products with the real DFT's cosine and sine
#   tables (H x 2J in, 2J x H out; J = H // 2 + 1), which XLA fuses with x's conversion and the
#   phase product where an FFT is a call of its own (4 H^2 multiply-adds per channel vector
#   against the FFT's O(H log H)). Equal to "fft" to float32 rounding (tests). The device queue
#   times it against "fft" (its variant spectral=dft).
# Read when a program is traced: a change needs ``jax.clear_caches()`` to reach a step.
SPECTRAL_TRANSFORMS: dict[str, str] = {"default": "fft"}


def _batched(phase_XTNJ: jax.Array) -> jax.Array:
    """(T, N, J) phases as (1, T, N, J); (B, T, N, J) unchanged."""
    return jnp.expand_dims(phase_XTNJ, tuple(range(4 - phase_XTNJ.ndim)))


def _spectral_fft(x32: jax.Array, phase_XTNJ: jax.Array) -> jax.Array:
    spectrum_BTNJ = jnp.fft.rfft(x32, axis=-1)
    return jnp.fft.irfft(spectrum_BTNJ * _batched(phase_XTNJ), n=x32.shape[-1], axis=-1)


def dft_tables(head_dim: int) -> tuple[jax.Array, jax.Array]:
    """The real DFT's tables for length H: ``forward`` (H, 2J) with ``x @ forward`` =
    [Re rfft(x), Im rfft(x)], and ``inverse`` (2J, H) with ``[Re y, Im y] @ inverse`` =
    irfft(y, n=H) (irfft's weights: 1 for bin 0 and, for even H, bin H / 2, 2 for the others;
    the imaginary parts of those bins are ignored, as irfft ignores them). float32, from
    float64 angles."""
    import numpy as np

    bins = head_dim // 2 + 1
    angle = 2 * np.pi * np.outer(np.arange(head_dim), np.arange(bins)) / head_dim  # (H, J)
    weight = np.full(bins, 2.0)
    weight[0] = 1.0
    if head_dim % 2 == 0:
        weight[-1] = 1.0
    forward = np.concatenate([np.cos(angle), -np.sin(angle)], axis=1)
    inverse = np.concatenate([weight * np.cos(angle), -weight * np.sin(angle)], axis=1).T
    return jnp.asarray(forward, jnp.float32), jnp.asarray(inverse / head_dim, jnp.float32)


def _spectral_dft(x32: jax.Array, phase_XTNJ: jax.Array) -> jax.Array:
    phase = _batched(phase_XTNJ)
    forward, inverse = dft_tables(x32.shape[-1])
    bins = forward.shape[1] // 2
    spectrum = jnp.matmul(x32, forward, precision=_HIGHEST)
    re, im = spectrum[..., :bins], spectrum[..., bins:]
    p_re, p_im = jnp.real(phase), jnp.imag(phase)
    turned = jnp.concatenate([re * p_re - im * p_im, re * p_im + im * p_re], axis=-1)
    return jnp.matmul(turned, inverse, precision=_HIGHEST)


_SPECTRAL_FNS = {"fft": _spectral_fft, "dft": _spectral_dft}


def rotate_spectral(x_BTNH: jax.Array, phase_XTNJ: jax.Array) -> jax.Array:
    """``irfft(rfft(x) * phase)`` over the channels: a rotation diagonal in the Fourier basis
    (Circulant-STRING's), with the transform ``SPECTRAL_TRANSFORMS`` names for the platform.

    Args:
      x_BTNH: queries or keys, any float dtype.
      phase_XTNJ: (T, N, J) or (B, T, N, J) complex64 Hermitian multipliers of unit modulus
        (J = H // 2 + 1); N = 1 for every head.

    Returns:
      (B, T, N, H) array in x's dtype, computed in float32.
    """
    for platform, name in SPECTRAL_TRANSFORMS.items():
        if name not in _SPECTRAL_FNS:
            raise ValueError(
                f"SPECTRAL_TRANSFORMS[{platform!r}]={name!r}; expected one of {list(_SPECTRAL_FNS)}"
            )
    x32 = x_BTNH.astype(jnp.float32)
    if len(set(SPECTRAL_TRANSFORMS.values())) == 1:  # one transform: no platform switch
        out = _SPECTRAL_FNS[SPECTRAL_TRANSFORMS["default"]](x32, phase_XTNJ)
    else:
        per_platform = {
            p: _SPECTRAL_FNS[n] for p, n in SPECTRAL_TRANSFORMS.items() if p != "default"
        }
        default = _SPECTRAL_FNS[SPECTRAL_TRANSFORMS["default"]]
        out = jax.lax.platform_dependent(x32, phase_XTNJ, default=default, **per_platform)
    return out.astype(x_BTNH.dtype)
