"""Circulant-STRING (Schenck et al., arXiv:2502.02562): commuting circulant generators, by FFT.

For each position axis a and head n the generator is ``L_a = C_a - C_a^T`` with ``C_a`` the
circulant matrix whose first column is the learned vector ``c_a`` (``C[i, j] = c[(i - j) mod H]``),
and

    R(p) = expm(sum_a p_a L_a).

Circulant matrices commute and are diagonalised by the DFT, so R(p) is applied in O(H log H)
per token. ``L_a`` is circulant with first column ``g_a[i] = c_a[i] - c_a[(-i) mod H]``: real and
odd, so its eigenvalues ``fft(g_a)_k = i * theta_ak`` are purely imaginary, with
``theta_a(H-k) = -theta_ak`` and

    R(p) x = irfft(exp(i * sum_a p_a theta_ak) * rfft(x)),    k = 0, ..., H // 2.

Equivalently, Circulant-STRING is RoPE with learned frequencies ``theta_ak`` expressed in the
fixed orthogonal basis of the real DFT. Because the generators commute,
R(p)^T R(p') = R(p' - p) exactly: the encoding is translation invariant in every dimension.

Parameterisation: ``c_ANH`` holds the full first column of ``C_a`` as in the paper, but only
``floor((H - 1) / 2)`` combinations of it are effective: ``c_0`` cancels (``g_0 = 0``), ``c_i`` and
``c_(H-i)`` enter only through their difference, and for even H ``c_(H/2)`` cancels too (its
gradient is zero). So H = 1 and H = 2 give the identity; ``init`` rejects ``head_dim < 3``.
The DC bin (k = 0) and, for even H, the Nyquist bin (k = H/2) are never rotated.

Init: ``c ~ Normal(0, init_std^2)`` i.i.d. (default ``init_std = 0.1``; the paper does not fix
one). Each ``theta_ak = -2 sum_(0<i<H/2) g_ai sin(2 pi i k / H)`` then has standard deviation
about ``init_std * sqrt(2H)``, e.g. 1.1 rad per unit position at H = 64.

Conventions: R(p) multiplies q and k from the left (never v); positions are ``pos_TA`` shared by
the batch or ``pos_BTA``, axis order = the array order of the input; prefix (class) tokens sit
at position 0 and get R(0) = I, i.e. they are not rotated. Parameters per axis and head; FFTs
and phases in float32/complex64 whatever x's dtype, and the output has x's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rope_lie.encodings import _checks, family, state

_FAMILY = "circulant_string"
FAMILY = family.Family(
    name=_FAMILY,
    kind="rotary",
    convention="integer",
    relative=True,
    apply_defaults={},
    # c_ANH (A, N, H), of which floor((H - 1) / 2) per axis and head are effective
    stored_count=lambda num_heads, head_dim, num_axes, settings: num_axes * num_heads * head_dim,
    examples=(({}, (1, 2, 3)),),
)
APPLY_HPARAMS: tuple[str, ...] = tuple(FAMILY.apply_defaults)


def _check_head_dim(head_dim: int) -> None:
    if head_dim < 3:
        raise ValueError(
            f"{_FAMILY}: head_dim={head_dim} must be at least 3: for H <= 2 every circulant "
            "skew-symmetric generator is zero and R(p) would be the identity"
        )


def _check_params(params: dict[str, jax.Array]) -> jax.Array:
    family.bound(params, _FAMILY)  # tagged parameters of another family are an error
    if set(params) != {"c_ANH"}:
        raise ValueError(f"{_FAMILY} expects params with key 'c_ANH', got keys {sorted(params)}")
    c_ANH = params["c_ANH"]
    if c_ANH.ndim != 3:
        raise ValueError(f"{_FAMILY}: c_ANH must have shape (A, N, H), got {tuple(c_ANH.shape)}")
    return c_ANH


def init(
    key: jax.Array, *, num_heads: int, head_dim: int, num_axes: int, init_std: float = 0.1
) -> dict[str, jax.Array]:
    """Initialise the first columns of the circulant matrices ``C_a``, one per axis and head.

    Args:
      key: PRNG key.
      num_heads: number of heads N.
      head_dim: head dimension H >= 3 (odd or even).
      num_axes: number of position axes A.
      init_std: standard deviation of the i.i.d. normal init of ``c``.

    Returns:
      ``{"c_ANH": (A, N, H) float32}``.
    """
    _checks.check_shape_args(num_heads, head_dim, num_axes, _FAMILY)
    _check_head_dim(head_dim)
    init_std = _checks.check_real(init_std, "init_std", _FAMILY)
    c_ANH = init_std * jax.random.normal(key, (num_axes, num_heads, head_dim), jnp.float32)
    return family.params(
        _FAMILY,
        {"c_ANH": c_ANH},
        num_heads=num_heads,
        head_dim=head_dim,
        num_axes=num_axes,
        init_std=init_std,
    )


def generator_columns(c_ANH: jax.Array) -> jax.Array:
    """First columns ``g[i] = c[i] - c[(-i) mod H]`` of the generators ``C - C^T``.

    Args:
      c_ANH: (A, N, H) first columns of the circulant matrices C_a.

    Returns:
      (A, N, H) float32, odd under i -> -i mod H (so ``g[0] = 0``).
    """
    c_ANH = jnp.asarray(c_ANH, jnp.float32)
    # c[(-i) mod H]: reverse, then roll by one so that index 0 maps to itself.
    return c_ANH - jnp.roll(c_ANH[..., ::-1], 1, axis=-1)


def frequencies(params: dict[str, jax.Array]) -> jax.Array:
    """Eigen-angles ``theta_ak``: the eigenvalues of ``L_a`` are ``i * theta_ak``.

    Args:
      params: ``{"c_ANH": (A, N, H)}`` from ``init``.

    Returns:
      (A, N, H // 2 + 1) float32 angles per unit position for the rfft bins k = 0..H//2
      (bins H//2+1..H-1 carry the negated angles of bins H-k).
    """
    g_ANH = generator_columns(_check_params(params))
    # fft of a real odd sequence is purely imaginary: keep the imaginary part only.
    return jnp.fft.rfft(g_ANH, axis=-1).imag


def precompute(
    params: dict[str, jax.Array],
    pos: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_prefix: int = 0,
) -> state.SpectralPhases:
    """The per-token phases ``exp(i sum_a p_a theta_ak)`` of R(p) in the Fourier basis.

    Args:
      params: ``{"c_ANH": (A, N, H)}`` from ``init`` (N = 1: the same for every head).
      pos: positions ``pos_TA`` (T, A) shared by the batch, or ``pos_BTA`` (B, T, A).
      num_heads: N of the parameters.
      head_dim: H of the parameters.
      num_prefix: prefix tokens (at position 0: R = I).

    Returns:
      ``SpectralPhases`` of shape (T, N, H // 2 + 1), or (B, T, N, H // 2 + 1); complex64.
    """
    c_ANH = _check_params(params)
    _checks.check_state_args(num_heads, head_dim, num_prefix, _FAMILY)
    if c_ANH.shape[1:] != (num_heads, head_dim):
        raise ValueError(
            f"{_FAMILY}: c_ANH has shape {tuple(c_ANH.shape)} but num_heads={num_heads}, "
            f"head_dim={head_dim} (expected (A, {num_heads}, {head_dim}))"
        )
    pos32 = _checks.check_positions(pos, _FAMILY, c_ANH.shape[0]).astype(jnp.float32)
    theta_ANJ = frequencies(params)
    # Phases once per token (once for the whole batch when pos is shared), broadcast over B.
    spec = "TA,ANJ->TNJ" if pos32.ndim == 2 else "BTA,ANJ->BTNJ"
    angle_XTNJ = jnp.einsum(spec, pos32, theta_ANJ, precision=jax.lax.Precision.HIGHEST)
    return state.SpectralPhases(jax.lax.complex(jnp.cos(angle_XTNJ), jnp.sin(angle_XTNJ)))


def apply(params: dict[str, jax.Array], x_BTNH: jax.Array, pos: jax.Array) -> jax.Array:
    """Rotate queries or keys by ``R(p) = expm(sum_a p_a (C_a - C_a^T))`` via the FFT.

    Args:
      params: ``{"c_ANH": (A, N, H)}`` from ``init``.
      x_BTNH: queries or keys (B, T, N, H), any float dtype.
      pos: positions ``pos_TA`` (T, A) shared by the batch, or ``pos_BTA`` (B, T, A).

    Returns:
      (B, T, N, H) array in x's dtype.
    """
    c_ANH = _check_params(params)
    num_axes, num_heads, head_dim = c_ANH.shape
    _checks.check_x(x_BTNH, _FAMILY)
    _checks.check_heads(x_BTNH, num_heads, head_dim, _FAMILY)
    _checks.check_pos(pos, x_BTNH, _FAMILY, num_axes)
    pe = precompute(params, pos, num_heads=num_heads, head_dim=head_dim)
    # The multiplier is Hermitian (theta odd in k), so irfft of the half spectrum is R(p) x.
    return pe.rotate(x_BTNH)
