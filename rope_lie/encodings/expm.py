"""The matrix exponential of skew-symmetric matrices (rotations in SO(H)), fast on CPU.

- ``expm_skew``: exp of (batched) skew-symmetric matrices.
- ``expm_skew_combination``: ``exp(sum_a c[x, a] G[a, y])`` for many coefficient vectors and a
  few generators (LieRE's ``R(p) = expm(sum_a p_a G_a)``), sharing work between tokens.
- ``num_squarings``: the squarings scaling and squaring needs for given matrices.

How the exponentials are computed (scaling and squaring: Higham, SIAM J. Matrix Anal. Appl. 26,
2005):

- H <= 4 in closed form: Rodrigues for H = 2, 3; for H = 4 the split A = A+ + A- into commuting
  self-dual and anti-self-dual parts with (A+-)^2 = -r+-^2 I, so exp(A+-) = cos r I + sinc r A+-.
  Differentiated directly.
- Otherwise a Taylor polynomial of exp(A / 2^s), then s squarings, s per matrix from a bound
  on the spectral radius (the loop runs max(s) times, masked), never capped below 128, so every
  finite input gives a finite rotation.
- ``expm_skew``: degree 15 by Paterson-Stockmeyer (6 products; A^2 and A^4 also give the bound
  rho(A) <= ||A^4||_F^(1/4), within a few percent of rho). VJP: the Frechet derivative at A^T,
  in forward mode through the same computation (no stored intermediates).
- ``expm_skew_combination``: the Taylor polynomial of B = sum_a b_a G_a written in monomials of
  b: sum_k B^k / k! = sum_alpha b^alpha M_alpha, M_alpha = (sum of the words in the G_a with
  letter counts alpha) / |alpha|!. The M_alpha are computed once per generator set; every row
  then costs one row of a single large matrix product, which runs near peak speed (batched small
  products do not). s bounds sum_a |b_a| rho(G_a), so no monomial term exceeds the Taylor terms
  at norm theta. Same VJP as ``expm_skew``, per row.

Batched products up to 32 x 32 on CPU (16 elsewhere) are broadcast multiply-adds, which XLA
fuses into one multithreaded loop (3-100x faster than XLA:CPU's batched dot below 8 x 8, 1.5-2x
up to 32 x 32, measured); larger ones are dots, run in one independent chunk per CPU core on CPU
(XLA:CPU runs one batched dot on one core, independent ones concurrently: 1.7x on 2 cores).
These choices depend on the machine, so they are made from a ``Host`` (platform and cores)
decided outside the jitted code and passed in as a static argument: ``this_host()`` once per
process by default, or any ``Host`` given to ``expm_skew``/``expm_skew_combination`` (e.g. to
trace for another machine). Everything is computed in float32 whatever the input dtype.
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_HIGHEST = jax.lax.Precision.HIGHEST
# Taylor truncation error bound theta^(m+1)/(m+1)! for normal matrices of spectral norm theta:
# 2^16/16! ~ 3e-9 for the degree-15 polynomial, below float32's unit roundoff 6e-8.
_THETA = 2.0
_DEGREE = 15
_MAX_SQUARINGS = 128  # 2^128 exceeds float32's range, so every finite input is covered
_TAYLOR_COEFFS = tuple(1.0 / math.factorial(k) for k in range(_DEGREE + 1))


class Host(NamedTuple):
    """The facts about the machine that shape the exponentials' program (static under jit).

    Thresholds: on CPU, broadcast products up to 32 x 32 and one chunk per core were measured
    (module docstring); on GPU and TPU the 16 x 16 threshold and a single chunk are *assumed*
    (no accelerator has measured them yet).
    """

    platform: str  # jax.default_backend(): "cpu", "gpu" or "tpu"
    cores: int  # CPU cores this process may run on (1 off CPU)

    @property
    def broadcast_max(self) -> int:
        """Largest H whose H x H products are fused broadcast multiply-adds."""
        return 32 if self.platform == "cpu" else 16

    def chunks(self, batch: int) -> int:
        """Independent chunks a batch of ``batch`` dot products is split into."""
        return max(1, min(self.cores, batch // 64)) if self.platform == "cpu" else 1


@functools.cache
def this_host() -> Host:
    """This process's ``Host``, decided once (first call; after ``jax.distributed`` is set up)."""
    platform = jax.default_backend()
    if platform != "cpu":
        return Host(platform, 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return Host(platform, cores or 1)


def _check_host(host) -> Host:
    if host is None:
        return this_host()
    if not isinstance(host, Host):
        raise TypeError(f"host={host!r} must be an expm.Host (platform, cores) or None")
    return host


def _broadcasts(h: int, host: Host) -> bool:
    """Whether H x H products are fused broadcast multiply-adds."""
    return h <= host.broadcast_max


def _product(a_ZHH: jax.Array, b_ZHH: jax.Array, host: Host) -> jax.Array:
    """Batched product, fastest form. Broadcast products are fused into their consumers, so an
    operand that is itself a product must come from ``_dot`` (else it is recomputed H times)."""
    if not _broadcasts(a_ZHH.shape[-1], host):
        return _dot(a_ZHH, b_ZHH)
    return _broadcast_product(a_ZHH, b_ZHH)


def _broadcast_product(a_ZHH: jax.Array, b_ZHH: jax.Array) -> jax.Array:
    """Batched product as H fused broadcast multiply-adds (the form for small H everywhere)."""
    h = a_ZHH.shape[-1]
    out = a_ZHH[..., :, 0, None] * b_ZHH[..., None, 0, :]
    for k in range(1, h):
        out = out + a_ZHH[..., :, k, None] * b_ZHH[..., None, k, :]
    return out


def _dot(a_ZHH: jax.Array, b_ZHH: jax.Array) -> jax.Array:
    """Batched product as a dot (materialised, never fused); below 8 x 8, zero-padded to 8 x 8,
    where XLA:CPU's batched dot is 20-100x slower."""
    h = a_ZHH.shape[-1]
    if h >= 8:
        return jnp.matmul(a_ZHH, b_ZHH, precision=_HIGHEST)
    pad = [(0, 0)] * (a_ZHH.ndim - 2) + [(0, 8 - h), (0, 8 - h)]
    out = jnp.matmul(jnp.pad(a_ZHH, pad), jnp.pad(b_ZHH, pad), precision=_HIGHEST)
    return out[..., :h, :h]


def _mt(a_ZHH: jax.Array) -> jax.Array:
    return jnp.swapaxes(a_ZHH, -1, -2)


def _chunked(fn, host: Host, *arrays_Z):
    """``fn`` on one chunk of the batch per CPU core, concatenated: XLA:CPU runs a batched dot on
    one core but independent ones concurrently. One chunk where products are broadcasts."""
    batch, h = arrays_Z[-1].shape[0], arrays_Z[-1].shape[-1]
    chunks = 1 if _broadcasts(h, host) else host.chunks(batch)
    if chunks == 1:
        return fn(*arrays_Z)
    split = [jnp.array_split(x, chunks) for x in arrays_Z]
    parts = [fn(*chunk) for chunk in zip(*split, strict=True)]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


def _square(host: Host, s_Z: jax.Array, r_ZHH: jax.Array) -> jax.Array:
    """R <- R^2, s_z times for matrix z (masked past s_z; the loop runs max(s) times)."""

    def body(carry):
        k, r = carry
        return k + 1, jnp.where((k < s_Z)[:, None, None], _product(r, r, host), r)

    return jax.lax.while_loop(lambda c: c[0] < jnp.max(s_Z), body, (jnp.int32(0), r_ZHH))[1]


def _squarings_for(rho: jax.Array, theta: float) -> jax.Array:
    """Smallest s >= 0 with rho / 2^s <= theta (int32; non-finite rho: the maximum)."""
    s = jnp.ceil(jnp.log2(jnp.maximum(rho, theta) / theta))
    s = jnp.where(jnp.isfinite(s), s, _MAX_SQUARINGS)
    return jnp.clip(s, 0, _MAX_SQUARINGS).astype(jnp.int32)


def _pow2_above(x: jax.Array) -> jax.Array:
    """log2 of a power of two >= x (0 for x <= 0): dividing by it is exact."""
    return jnp.ceil(jnp.log2(jnp.where(x > 0, x, 1.0)))


def _frobenius(a_ZHH: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(a_ZHH), axis=(-2, -1)))


def _closed_form(a_ZHH: jax.Array) -> jax.Array:
    """exp of skew-symmetric H x H matrices, H <= 4, in closed form (differentiable).

    Reads the skew part (A - A^T)/2, so the gradient is the one along skew directions.
    """
    h = a_ZHH.shape[-1]
    a_ZHH = 0.5 * (a_ZHH - _mt(a_ZHH))
    if h == 1:
        return jnp.ones_like(a_ZHH)
    if h == 4:
        return _closed_form_4x4(a_ZHH)
    # H = 2, 3: A^2 has eigenvalues -t^2 (and 0), t^2 = ||A||_F^2 / 2, so
    # exp(A) = I + sinc(t) A + (1 - cos t) / t^2 A^2 (Rodrigues; for H = 2, A^2 = -t^2 I).
    t2 = jnp.sum(jnp.square(a_ZHH), axis=(-2, -1)) / 2.0
    t = jnp.sqrt(jnp.where(t2 > 0, t2, 1.0))  # safe at 0 for gradients: t2 = 0 is masked
    f1 = jnp.where(t2 > 0, jnp.sinc(t / jnp.pi), 1.0)[..., None, None]
    f2 = jnp.where(t2 > 0, 0.5 * jnp.square(jnp.sinc(t / (2 * jnp.pi))), 0.5)[..., None, None]
    return jnp.eye(h) + f1 * a_ZHH + f2 * _broadcast_product(a_ZHH, a_ZHH)


def _isoclinic(p1: jax.Array, p2: jax.Array, p3: jax.Array, signs) -> tuple:
    """P = [[0, p1, p2, p3], [-p1, 0, s1 p3, s2 p2], [-p2, -s1 p3, 0, s3 p1], [-p3, ...]]
    with P^2 = -(p1^2 + p2^2 + p3^2) I, and (cos r, sinc r) of its exponential cos r + sinc r P."""
    s1, s2, s3 = signs
    zero = jnp.zeros_like(p1)
    rows = [
        [zero, p1, p2, p3],
        [-p1, zero, s1 * p3, s2 * p2],
        [-p2, -s1 * p3, zero, s3 * p1],
        [-p3, -s2 * p2, -s3 * p1, zero],
    ]
    p_Z44 = jnp.stack([jnp.stack(row, -1) for row in rows], -2)
    r2 = p1 * p1 + p2 * p2 + p3 * p3
    r = jnp.sqrt(jnp.where(r2 > 0, r2, 1.0))
    cos = jnp.where(r2 > 0, jnp.cos(r), 1.0)[..., None, None]
    sinc = jnp.where(r2 > 0, jnp.sinc(r / jnp.pi), 1.0)[..., None, None]
    return p_Z44, cos, sinc


def _closed_form_4x4(a_Z44: jax.Array) -> jax.Array:
    """exp(A) = exp(A+) exp(A-), A+- = (A +- *A)/2 (*: Hodge dual) commuting isoclinic parts."""
    a = {(i, j): a_Z44[..., i, j] for i in range(4) for j in range(i + 1, 4)}
    p, cp, sp = _isoclinic(
        (a[0, 1] + a[2, 3]) / 2, (a[0, 2] - a[1, 3]) / 2, (a[0, 3] + a[1, 2]) / 2, (1, -1, 1)
    )
    m, cm, sm = _isoclinic(
        (a[0, 1] - a[2, 3]) / 2, (a[0, 2] + a[1, 3]) / 2, (a[0, 3] - a[1, 2]) / 2, (-1, 1, -1)
    )
    return cp * cm * jnp.eye(4) + cp * sm * m + sp * cm * p + sp * sm * _broadcast_product(p, m)


def _rho_power_bound(a_ZHH: jax.Array, powers: int) -> jax.Array:
    """rho(A) <= ||A^(2^j)||_F^(2^-j) (rho(A)^n = rho(A^n) <= ||A^n||_F), on normalised powers."""
    norm = _frobenius(a_ZHH)
    x = a_ZHH / jnp.where(norm > 0, norm, 1.0)[..., None, None]
    log_ratio = jnp.zeros_like(norm)
    for j in range(powers):
        x = _dot(x, x)
        n = _frobenius(x)
        log_ratio = log_ratio + jnp.log(jnp.where(n > 0, n, 1.0)) / 2.0 ** (j + 1)
        x = x / jnp.where(n > 0, n, 1.0)[..., None, None]
    return norm * jnp.exp(log_ratio)


def num_squarings(a_XHH: jax.Array) -> jax.Array:
    """Squarings s such that the spectral radius of ``a / 2^s`` is at most ``_THETA``.

    Uses ``rho(A) <= ||A^4||_F^(1/4)``, within a few percent of rho for typical skew-symmetric
    matrices (``||A||_F / sqrt(2)`` overestimates it by 10-30 % at H = 8..64).

    Returns:
      int32 array with the batch shape of ``a``.
    """
    return _squarings_for(_rho_power_bound(jnp.asarray(a_XHH, jnp.float32), 2), _THETA)


def _taylor_ps(b, b2, b4):
    """exp(B) to degree 15 by Paterson-Stockmeyer from B, B^2, B^4 (4 more products)."""
    eye = jnp.eye(b.shape[-1], dtype=b.dtype)
    b3 = _dot(b2, b)
    c = _TAYLOR_COEFFS

    def chunk(i):
        return c[4 * i] * eye + c[4 * i + 1] * b + c[4 * i + 2] * b2 + c[4 * i + 3] * b3

    poly = chunk(3)
    for i in (2, 1, 0):
        poly = chunk(i) + _dot(b4, poly)
    return poly


def _expm_skew_impl(a_ZHH: jax.Array, host: Host) -> jax.Array:
    # Normalise by a power of two >= ||A||_F: every rescaling below is exact.
    log_scale = _pow2_above(_frobenius(a_ZHH))
    unit = a_ZHH * jnp.exp2(-log_scale)[:, None, None]
    unit2 = _dot(unit, unit)
    unit4 = _dot(unit2, unit2)
    rho = jnp.exp2(log_scale) * jnp.sqrt(jnp.sqrt(_frobenius(unit4)))
    s = jax.lax.stop_gradient(_squarings_for(rho, _THETA))
    scale = jnp.exp2(log_scale - s.astype(jnp.float32))[:, None, None]
    return _square(host, s, _taylor_ps(unit * scale, unit2 * scale**2, unit4 * scale**4))


def _expm_flat(fn, a_XHH):
    shape = a_XHH.shape
    return fn(a_XHH.reshape(-1, *shape[-2:])).reshape(shape)


def _expm_skew_chunked(host: Host, a_ZHH: jax.Array) -> jax.Array:
    return _chunked(functools.partial(_expm_skew_impl, host=host), host, a_ZHH)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _expm_skew(a_XHH: jax.Array, host: Host) -> jax.Array:
    return _expm_flat(functools.partial(_expm_skew_chunked, host), a_XHH)


def _expm_skew_fwd(a_XHH, host):
    return _expm_skew(a_XHH, host), a_XHH


def _expm_skew_bwd(host, a_XHH, g_XHH):
    # <L_exp(A)[E], G> = <E, L_exp(A^T)[G]>: the adjoint is a Frechet derivative at A^T, which
    # forward mode computes through the same scaling and squaring without storing intermediates.
    impl = functools.partial(_expm_flat, functools.partial(_expm_skew_chunked, host))
    _, grad = jax.jvp(impl, (_mt(a_XHH),), (g_XHH,))
    return (grad,)


_expm_skew.defvjp(_expm_skew_fwd, _expm_skew_bwd)
# Compiled once per shape and host: called eagerly, the while loop would otherwise be retraced
# each call. Under an outer jit this is inlined. Closed forms (H <= 4) are differentiated
# directly and the same on every host.
_expm_skew_jit = jax.jit(_expm_skew, static_argnums=1)
_closed_form_jit = jax.jit(functools.partial(_expm_flat, _closed_form))


def expm_skew(a_XHH: jax.Array, *, host: Host | None = None) -> jax.Array:
    """Matrix exponential of (batched) skew-symmetric matrices, in float32.

    Accurate to float32 resolution times the norm (max |R - R_f64| about 1e-6 at norm 1e2 and
    1e-5 at norm 1e3, see tests); finite for every finite input.

    Args:
      a_XHH: (..., H, H) skew-symmetric matrices (not checked: the caller builds them skew).
      host: the machine to shape the program for; None: ``this_host()``.

    Returns:
      (..., H, H) float32 rotation matrices ``exp(a)``.
    """
    a_XHH = jnp.asarray(a_XHH)
    if a_XHH.ndim < 2 or a_XHH.shape[-1] != a_XHH.shape[-2]:
        raise ValueError(f"expm_skew expects (..., H, H) square matrices, got shape {a_XHH.shape}")
    if a_XHH.size == 0:
        return jnp.zeros(a_XHH.shape, jnp.float32)
    if a_XHH.shape[-1] <= 4:
        return _closed_form_jit(a_XHH.astype(jnp.float32))
    return _expm_skew_jit(a_XHH.astype(jnp.float32), _check_host(host))


# Taylor degree of expm_skew_combination by number of axes: the per-token product has
# C(m + A, A) - 1 columns, so more axes get a lower degree (and a smaller theta, below).
_COMBINATION_DEGREE = {1: 15, 2: 15, 3: 12}
_COMBINATION_DEGREE_MANY_AXES = 8


def _combination_theta(degree: int) -> float:
    """Largest theta whose truncation bound theta^(m+1)/(m+1)! is 2^-25 (2.30 at m = 15)."""
    return (2.0**-25 * math.factorial(degree + 1)) ** (1.0 / (degree + 1))


@functools.cache
def _monomials(num_axes: int, degree: int):
    """Per degree k >= 1 and axis a, the index of alpha - e_a among the monomials of degree
    k - 1 (-1 where alpha_a = 0); and the (M, A) exponents of degree m down to 0."""
    levels = [[(0,) * num_axes]]
    for _ in range(degree):
        grown = {tuple(m[i] + (i == a) for i in range(num_axes)) for m in levels[-1]
                 for a in range(num_axes)}  # fmt: skip
        levels.append(sorted(grown, reverse=True))
    parents = []
    for k in range(1, degree + 1):
        index = {m: i for i, m in enumerate(levels[k - 1])}
        parents.append([np.array([index.get(tuple(m[i] - (i == a) for i in range(num_axes)), -1)
                                  for m in levels[k]]) for a in range(num_axes)])  # fmt: skip
    # Highest degree first, I last: the float32 product then adds the small terms before the
    # large ones (measured: max error 7e-8 instead of 2e-7 at theta = 2).
    exponents = np.array([m for level in levels[::-1] for m in level], dtype=np.int32)
    return parents, exponents


def _word_basis(gen_AYHH: jax.Array, degree: int) -> jax.Array:
    """(M, Y, H, H): M_alpha = (sum of words with letter counts alpha) / |alpha|!, for the
    monomials of ``_monomials`` (degree m down to 0).

    M_alpha = sum_a G_a M_(alpha - e_a) / |alpha| (the first letter of each word is some G_a).
    """
    num_axes, num_gen, h = gen_AYHH.shape[:3]
    parents, _ = _monomials(num_axes, degree)
    prev = prev_identity = jnp.broadcast_to(jnp.eye(h, dtype=gen_AYHH.dtype), (1, num_gen, h, h))
    levels = []
    for k, parent_A in enumerate(parents, start=1):
        prods = jnp.einsum("ayij,myjl->amyil", gen_AYHH, prev, precision=_HIGHEST) / k
        level = 0.0
        for a, idx in enumerate(parent_A):
            valid = jnp.asarray(idx >= 0)[:, None, None, None]
            level = level + jnp.where(valid, prods[a][np.maximum(idx, 0)], 0.0)
        levels.append(level)
        prev = level
    return jnp.concatenate([*levels[::-1], prev_identity])


def _combination_setup(coef_XA: jax.Array, gen_AYHH: jax.Array):
    """Per-row squarings s, scaled coefficients b = coef 2^(e_a - s), and the word basis of the
    generators G_a 2^-e_a, with 2^e_a >= max_y rho(G_a,y) (powers of two: exact rescalings).

    s bounds sum_a |coef_a| rho_a / 2^s <= theta: by the triangle inequality every monomial
    term is then at most as large as the Taylor terms of a matrix of norm theta, so summing
    the monomials costs no more accuracy than summing B^k / k!.
    """
    num_axes = gen_AYHH.shape[0]
    degree = _COMBINATION_DEGREE.get(num_axes, _COMBINATION_DEGREE_MANY_AXES)
    rho_A = jnp.max(jax.lax.stop_gradient(_rho_power_bound(gen_AYHH, 4)), axis=1)
    bound_X = jnp.sum(jnp.abs(jax.lax.stop_gradient(coef_XA)) * rho_A, axis=-1)
    s_X = _squarings_for(bound_X, _combination_theta(degree))
    log_scale_A = _pow2_above(rho_A)
    gen_unit = gen_AYHH * jnp.exp2(-log_scale_A)[:, None, None, None]
    b_XA = coef_XA * jnp.exp2(log_scale_A - s_X[:, None].astype(jnp.float32))
    return s_X, b_XA, _word_basis(gen_unit, degree), degree


def _taylor_rows(b_XA: jax.Array, basis_MYHH: jax.Array, degree: int) -> jax.Array:
    """exp(sum_a b_a G_a) for every row of b: one (X, M) x (M, Y*H*H) product; (X*Y, H, H)."""
    num_mono, num_gen, h = basis_MYHH.shape[:3]
    _, exponents_MA = _monomials(b_XA.shape[-1], degree)
    powers = [jnp.ones_like(b_XA)]
    for _ in range(degree):
        powers.append(powers[-1] * b_XA)
    powers_XAK = jnp.stack(powers, axis=-1)
    # coef[x, alpha] = prod_a b_a^alpha_a, gathered by one-hot products: a plain gather makes
    # XLA:CPU lay the coefficients out transposed and run the large product 2x slower.
    coef_XM = 1.0
    for a in range(b_XA.shape[-1]):
        one_hot_MK = jax.nn.one_hot(exponents_MA[:, a], degree + 1, dtype=b_XA.dtype)
        coef_XM = coef_XM * jnp.einsum(
            "xk,mk->xm", powers_XAK[:, a], one_hot_MK, precision=_HIGHEST
        )
    e = jnp.matmul(coef_XM, basis_MYHH.reshape(num_mono, -1), precision=_HIGHEST)
    return e.reshape(-1, h, h)


# Rows per group (their Taylor rows and squarings): about 4 MiB of rotations, so a group stays
# in cache through its squarings. Dense 64 x 64, 12 heads: 1.9x faster at 1024 tokens, linear in
# tokens (measured 2-16 MiB: 4 best). Broadcast products (b <= 8) are grouped only in the
# backward pass: there it is 1.4-2x faster (b = 8, 12 heads: 196 tokens 66 -> 49 ms, 1024
# tokens 391 -> 196 ms), in the forward pass 1.4-2x slower.
_GROUP_BYTES = 4 * 2**20


def _map_row_groups(
    fn, matrix_shape: tuple[int, int], host: Host, *arrays_X, group_broadcasts: bool = False
):
    """``fn`` on groups of rows (``lax.map``, padded with zero rows), each row holding
    ``num_gen`` H x H matrices (``matrix_shape = (H, num_gen)``); on all rows at once where the
    products are broadcasts (unless ``group_broadcasts``) or the rows fit in one group."""
    h, num_gen = matrix_shape
    rows = arrays_X[0].shape[0]
    most = max(1, _GROUP_BYTES // (num_gen * h * h * 4))
    if (_broadcasts(h, host) and not group_broadcasts) or rows <= most:
        return fn(*arrays_X)
    groups = -(-rows // most)
    group = -(-rows // groups)  # as even as possible: little padding
    padded = [jnp.pad(x, [(0, groups * group - rows)] + [(0, 0)] * (x.ndim - 1)) for x in arrays_X]
    out = jax.lax.map(lambda xs: fn(*xs), [x.reshape(groups, group, *x.shape[1:]) for x in padded])
    return out.reshape(groups * group, *out.shape[2:])[:rows]


def _combination_impl(coef_XA: jax.Array, gen_AYHH: jax.Array, host: Host) -> jax.Array:
    s_X, b_XA, basis, degree = _combination_setup(coef_XA, gen_AYHH)
    num_gen, h = gen_AYHH.shape[1], gen_AYHH.shape[-1]

    def rows(s_x, b_xa):
        squares = functools.partial(_square, host)
        r = _chunked(squares, host, jnp.repeat(s_x, num_gen), _taylor_rows(b_xa, basis, degree))
        return r.reshape(s_x.shape[0], num_gen, h, h)

    return _map_row_groups(rows, (h, num_gen), host, s_X, b_XA)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _combination(coef_XA: jax.Array, gen_AYHH: jax.Array, host: Host) -> jax.Array:
    return _combination_impl(coef_XA, gen_AYHH, host)


def _combination_fwd(coef_XA, gen_AYHH, host):
    return _combination_impl(coef_XA, gen_AYHH, host), (coef_XA, gen_AYHH)


def _combination_bwd(host, res, r_bar_XYHH):
    # The Frechet adjoint at A^T per row, as in expm_skew's VJP (measured: as fast as a
    # reverse-mode adjoint through the squarings, without its extra code).
    coef_XA, gen_AYHH = res
    impl = functools.partial(_expm_flat, functools.partial(_expm_skew_chunked, host))

    def rows(coef_xa, r_bar_xyhh):
        a_xyhh = jnp.einsum("xa,ayij->xyij", coef_xa, gen_AYHH, precision=_HIGHEST)
        return jax.jvp(impl, (_mt(a_xyhh),), (r_bar_xyhh,))[1]

    shape = (gen_AYHH.shape[-1], gen_AYHH.shape[1])
    a_bar = _map_row_groups(rows, shape, host, coef_XA, r_bar_XYHH, group_broadcasts=True)
    coef_bar = jnp.einsum("xyij,ayij->xa", a_bar, gen_AYHH, precision=_HIGHEST)
    gen_bar = jnp.einsum("xa,xyij->ayij", coef_XA, a_bar, precision=_HIGHEST)
    return coef_bar, gen_bar


_combination.defvjp(_combination_fwd, _combination_bwd)


def _closed_form_combination(coef_XA: jax.Array, gen_AYHH: jax.Array) -> jax.Array:
    a = jnp.einsum("xa,ayij->xyij", coef_XA, gen_AYHH, precision=_HIGHEST)
    return _expm_flat(_closed_form, a)


_combination_jit = jax.jit(_combination, static_argnums=2)
_closed_form_combination_jit = jax.jit(_closed_form_combination)


def expm_skew_combination(
    coef_XA: jax.Array, gen_AYHH: jax.Array, *, host: Host | None = None
) -> jax.Array:
    """``exp(sum_a coef[x, a] gen[a, y])`` for every row x and generator set y, in float32.

    Equal to ``expm_skew(einsum("xa,ayij->xyij", coef, gen))`` to float32 accuracy, but the
    Taylor polynomial of every row comes from one large matrix product against monomials of
    the generators computed once (see the module docstring), so many rows cost little more
    than their squarings. Differentiable in both arguments (custom VJP, no stored
    intermediates); finite for every finite input.

    Args:
      coef_XA: (X, A) coefficients, e.g. token positions.
      gen_AYHH: (A, Y, H, H) skew-symmetric generators (not checked), e.g. one set per head.
      host: the machine to shape the program for; None: ``this_host()``.

    Returns:
      (X, Y, H, H) float32 rotations.
    """
    coef_XA = jnp.asarray(coef_XA, jnp.float32)
    gen_AYHH = jnp.asarray(gen_AYHH, jnp.float32)
    if (
        coef_XA.ndim != 2
        or gen_AYHH.ndim != 4
        or coef_XA.shape[1] != gen_AYHH.shape[0]
        or gen_AYHH.shape[-1] != gen_AYHH.shape[-2]
    ):
        raise ValueError(
            "expm_skew_combination expects coef (X, A) and square generators (A, Y, H, H) with "
            f"the same A, got shapes {coef_XA.shape} and {gen_AYHH.shape}"
        )
    if coef_XA.shape[0] == 0 or gen_AYHH.shape[1] == 0:
        return jnp.zeros((coef_XA.shape[0], *gen_AYHH.shape[1:]), jnp.float32)
    if gen_AYHH.shape[-1] <= 4:
        return _closed_form_combination_jit(coef_XA, gen_AYHH)
    return _combination_jit(coef_XA, gen_AYHH, _check_host(host))
