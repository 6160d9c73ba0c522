"""The matrix exponential of skew-symmetric matrices (rotations in SO(H)), fast on CPU.

- ``expm_skew``: exp of (batched) skew-symmetric matrices.
- ``num_squarings``: the squarings scaling and squaring needs for given matrices.

How the exponentials are computed (scaling and squaring: Higham, SIAM J. Matrix Anal. Appl. 26,
2005):

- H <= 4 in closed form: Rodrigues for H = 2, 3; for H = 4 the split A = A+ + A- into commuting
  self-dual and anti-self-dual parts with (A+-)^2 = -r+-^2 I, so exp(A+-) = cos r I + sinc r A+-.
  Differentiated directly.
- Otherwise a Taylor polynomial of exp(A / 2^s), then s squarings, s per matrix from a bound
  on the spectral radius (max(s) iterations, masked; how the loop runs depends on the platform:
  ``SQUARING_LOOPS``), never capped below 128, so every finite input gives a finite rotation.
- ``expm_skew``: degree 15 by Paterson-Stockmeyer (6 products; A^2 and A^4 also give the bound
  rho(A) <= ||A^4||_F^(1/4), within a few percent of rho). VJP: the Frechet derivative at A^T,
  in forward mode through the same computation (no stored intermediates).
- ``expm_combination.expm_skew_combination`` (LieRE's many tokens, few generators) builds on
  the pieces here: the host, the products, the squarings and the bound.

Batched products up to 32 x 32 on CPU (16 elsewhere) are broadcast multiply-adds, which XLA
fuses into one multithreaded loop, faster than XLA:CPU's batched dot at those sizes; larger ones
are dots, run in one independent chunk per CPU core on CPU (XLA:CPU runs one batched dot on one
core, independent ones concurrently). The figures behind both: benchmarks README, section 14.
These choices depend on the machine, so they are made from a ``Host`` (platform and cores)
decided outside the jitted code and passed in as a static argument: ``this_host()`` once per
process by default, or any ``Host`` given to ``expm_skew`` or ``expm_skew_combination`` (e.g.
to trace for another machine). Everything is computed in float32 whatever the input dtype.

Building blocks, for ``expm_combination`` and the benchmarks (package-internal, not in
``__all__``): ``product``, ``square``, ``chunked``, ``broadcasts``, ``closed_form``,
``expm_skew_chunked``, ``rho_power_bound``, ``squarings_for``, ``pow2_above``, ``check_host``,
``HIGHEST``.
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rope_lie.encodings import _checks, expm_pallas, lie

__all__ = ["Host", "expm_skew", "num_squarings", "this_host"]

HIGHEST = jax.lax.Precision.HIGHEST
# Taylor truncation error bound theta^(m+1)/(m+1)! for normal matrices of spectral norm theta:
# 2^16/16! ~ 3e-9 for the degree-15 polynomial, below float32's unit roundoff 6e-8.
_THETA = 2.0
_DEGREE = 15
_MAX_SQUARINGS = 128  # 2^128 exceeds float32's range, so every finite input is covered
_TAYLOR_COEFFS = tuple(1.0 / math.factorial(k) for k in range(_DEGREE + 1))


# How the squarings run, by platform (``Host.platform``, read when a program is traced; "default"
# for platforms not named):
# - "while": one loop of max(s) iterations, its trip count read from the data. Every platform's.
# - "fixed": ``FIXED_SQUARINGS`` iterations at a trip count known when compiling (masked past
#   each matrix's s, as every iteration is), then the "while" loop for matrices that need more.
#   XLA:GPU reads a data-dependent loop's condition on the host every iteration, which a known
#   count avoids; but every fixed iteration is a product of the whole batch, needed or not, and
#   on an H100 (the ImageNet recipe's LieRE 8x8, ViT-B/16 224 px, batch 64, cuDNN attention)
#   the step took 44.4 ms with "fixed" against 41.9 ms with "while" (benchmarks README, section
#   13). Kept as an option: ``python -m experiments.device`` times it on the device it runs on.
# - "pallas": one Pallas kernel (``expm_pallas.square``) that runs all the squarings of a block
#   of matrices in one program: a loop up to the block's largest s inside the kernel (no trip
#   count read on the host, no kernel per iteration), each product a broadcast multiply summed
#   over k, masked past each matrix's s as the loops are; the reverse-mode VJP's squarings
#   adjoint likewise (``expm_pallas.squarings_adjoint``). For H up to ``PALLAS_MAX`` (larger:
#   the "while" loop). Interpret mode on CPU (slow: for the tests), compiled by Pallas's Triton
#   backend on GPUs, the "while" loop on TPUs (no Mosaic kernel written). On an H100 the step
#   took 39.76 ms against the "while" loop's 41.78 ms (benchmarks README, section 13), but it
#   stays an option: jax 0.11 deprecates Pallas's Triton backend (it warns when the kernel is
#   lowered for CUDA, and a later release removes it); a default would need a Mosaic GPU kernel.
SQUARING_LOOPS: dict[str, str] = {"default": "while"}
_LOOPS = ("while", "fixed", "pallas")
# How the small products (H <= ``Host.broadcast_max``) are written, by platform:
# - "adds": H broadcast multiply-adds, term k from a slice of a's column k and b's row k. The
#   CPU's (measured there: benchmarks README, section 14).
# - "reduce": one broadcast multiply summed over k, no slices, and the same form where a product
#   must be computed once (``materialised``; "adds" uses a batched dot there). On an H100,
#   under the batched layer plan, the "fixed" squaring loop ran the "adds" form's slices as
#   kernels of their own (``wrapped_slice``: 6.1 ms of LieRE 8x8's 40.4 ms of GPU work per
#   ViT-B/16 step, in an earlier run of experiments/benchmarks/device/), and the backward
#   pass's batched 8 x 8 dots ran as matrix-multiply kernels (``gemm_fusion_dot``, 5 ms).
#   "reduce" was slower there: the step took 44.39 ms against 41.78 ms with "adds", its
#   products fused into one reduction of 11.0 ms a step (benchmarks README, section 13).
SMALL_PRODUCTS: dict[str, str] = {"default": "adds"}
_SMALL = ("adds", "reduce")
# The ImageNet recipe's LieRE at 224 px needs s <= 5 at initialisation (8x8 blocks; dense: 7),
# and on integer positions 0-13 s <= 8 (dense: 11). Every fixed iteration costs a product of the
# whole batch, needed or not: 8 wastes at most 3 at the recipe's start and leaves its 8x8
# generators room to grow 8x before the loop after it runs.
FIXED_SQUARINGS = 8
PALLAS_MAX = expm_pallas.PALLAS_MAX  # larger matrices: the "while" loop


class Host(NamedTuple):
    """The facts about the machine that shape the exponentials' program (static under jit).

    Thresholds: on CPU, broadcast products up to 32 x 32, one chunk per core and row groups
    were measured (benchmarks README, section 14); on GPU the squaring loop (``SQUARING_LOOPS``)
    was measured on an H100 (section 13), while the 16 x 16 threshold, a single chunk and no
    row groups on GPU and TPU are *assumed*: no accelerator has measured them yet.
    """

    platform: str  # jax.default_backend(): "cpu", "gpu" or "tpu"
    cores: int  # CPU cores this process may run on (1 off CPU)

    @property
    def broadcast_max(self) -> int:
        """Largest H whose H x H products are fused broadcast multiply-adds."""
        return 32 if self.platform == "cpu" else 16

    @property
    def groups_rows(self) -> bool:
        """Whether ``expm_combination`` runs its rows in cache-sized groups (``lax.map``, one
        group after another): on a CPU, where a group stays in cache through its squarings.
        Elsewhere all rows at once: on a GPU each group would be its own squaring loop, one
        after another, every iteration's trip count read on the host."""
        return self.platform == "cpu"

    @property
    def squaring_loop(self) -> str:
        """How the squarings run (``SQUARING_LOOPS``)."""
        return _checks.platform_choice(SQUARING_LOOPS, "SQUARING_LOOPS", self.platform, _LOOPS)

    @property
    def fixed_squarings(self) -> int:
        """Squarings run at a trip count known when compiling, before the data-dependent loop
        (``SQUARING_LOOPS``): ``FIXED_SQUARINGS`` where the loop is "fixed", else 0."""
        return FIXED_SQUARINGS if self.squaring_loop == "fixed" else 0

    @property
    def pallas_squarings(self) -> bool:
        """Whether the squarings of matrices up to ``PALLAS_MAX`` are one Pallas kernel: where
        the loop is "pallas", on a CPU (interpret mode) or a GPU (``SQUARING_LOOPS``)."""
        return self.squaring_loop == "pallas" and self.platform in ("cpu", "gpu")

    @property
    def small_products(self) -> str:
        """How H x H products up to ``broadcast_max`` are written (``SMALL_PRODUCTS``)."""
        return _checks.platform_choice(SMALL_PRODUCTS, "SMALL_PRODUCTS", self.platform, _SMALL)

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


def check_host(host) -> Host:
    """``host`` itself, or ``this_host()`` for None (TypeError for anything else)."""
    if host is None:
        return this_host()
    if not isinstance(host, Host):
        raise TypeError(f"host={host!r} must be an expm.Host (platform, cores) or None")
    return host


def broadcasts(h: int, host: Host) -> bool:
    """Whether H x H products are fused broadcast multiply-adds."""
    return h <= host.broadcast_max


def product(a_ZHH: jax.Array, b_ZHH: jax.Array, host: Host) -> jax.Array:
    """Batched product, fastest form. Broadcast products are fused into their consumers, so an
    operand that is itself a product must come from ``materialised`` (else it is recomputed H
    times)."""
    if not broadcasts(a_ZHH.shape[-1], host):
        return _dot(a_ZHH, b_ZHH)
    if host.small_products == "reduce":
        return expm_pallas.reduce_product(a_ZHH, b_ZHH)
    return _broadcast_product(a_ZHH, b_ZHH)


def materialised(a_ZHH: jax.Array, b_ZHH: jax.Array, host: Host) -> jax.Array:
    """Batched product that is computed once, for operands of further products: a dot, or
    where small products are "reduce" (``SMALL_PRODUCTS``) that form (a reduction is computed
    once, not fused into its consumers): the batched 8 x 8 dots of the exponentials' backward
    pass ran on an H100 as matrix-multiply kernels of their own."""
    if broadcasts(a_ZHH.shape[-1], host) and host.small_products == "reduce":
        return expm_pallas.reduce_product(a_ZHH, b_ZHH)
    return _dot(a_ZHH, b_ZHH)


def _broadcast_product(a_ZHH: jax.Array, b_ZHH: jax.Array) -> jax.Array:
    """Batched product as H fused broadcast multiply-adds (the form for small H everywhere)."""
    h = a_ZHH.shape[-1]
    out = a_ZHH[..., :, 0, None] * b_ZHH[..., None, 0, :]
    for k in range(1, h):
        out = out + a_ZHH[..., :, k, None] * b_ZHH[..., None, k, :]
    return out


def _dot(a_ZHH: jax.Array, b_ZHH: jax.Array) -> jax.Array:
    """Batched product as a dot (materialised, never fused); below 8 x 8, zero-padded to 8 x 8,
    where XLA:CPU's batched dot is far slower (benchmarks README, section 14)."""
    h = a_ZHH.shape[-1]
    if h >= 8:
        return jnp.matmul(a_ZHH, b_ZHH, precision=HIGHEST)
    pad = [(0, 0)] * (a_ZHH.ndim - 2) + [(0, 8 - h), (0, 8 - h)]
    out = jnp.matmul(jnp.pad(a_ZHH, pad), jnp.pad(b_ZHH, pad), precision=HIGHEST)
    return out[..., :h, :h]


def chunked(fn, host: Host, *arrays_Z):
    """``fn`` on one chunk of the batch per CPU core, concatenated: XLA:CPU runs a batched dot on
    one core but independent ones concurrently. One chunk where products are broadcasts."""
    batch, h = arrays_Z[-1].shape[0], arrays_Z[-1].shape[-1]
    chunks = 1 if broadcasts(h, host) else host.chunks(batch)
    if chunks == 1:
        return fn(*arrays_Z)
    split = [jnp.array_split(x, chunks) for x in arrays_Z]
    parts = [fn(*chunk) for chunk in zip(*split, strict=True)]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


def square(host: Host, s_Z: jax.Array, r_ZHH: jax.Array) -> jax.Array:
    """R <- R^2, s_z times for matrix z (every iteration masked past s_z):
    ``host.fixed_squarings`` iterations at a known trip count, then a loop up to max(s); or
    one Pallas kernel (``host.pallas_squarings``)."""
    if host.pallas_squarings and r_ZHH.shape[-1] <= PALLAS_MAX:
        return expm_pallas.square(host.platform == "cpu", s_Z, r_ZHH)

    def step(k, r):
        return jnp.where((k < s_Z)[:, None, None], product(r, r, host), r)

    def body(carry):
        k, r = carry
        return k + 1, step(k, r)

    fixed = host.fixed_squarings
    if fixed:
        r_ZHH = jax.lax.fori_loop(0, fixed, step, r_ZHH)
    init = (jnp.int32(fixed), r_ZHH)
    return jax.lax.while_loop(lambda c: c[0] < jnp.max(s_Z), body, init)[1]


def squarings_for(rho: jax.Array, theta: float) -> jax.Array:
    """Smallest s >= 0 with rho / 2^s <= theta (int32; non-finite rho: the maximum)."""
    s = jnp.ceil(jnp.log2(jnp.maximum(rho, theta) / theta))
    s = jnp.where(jnp.isfinite(s), s, _MAX_SQUARINGS)
    return jnp.clip(s, 0, _MAX_SQUARINGS).astype(jnp.int32)


def pow2_above(x: jax.Array) -> jax.Array:
    """log2 of a power of two >= x (0 for x <= 0): dividing by it is exact."""
    return jnp.ceil(jnp.log2(jnp.where(x > 0, x, 1.0)))


def _frobenius(a_ZHH: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(a_ZHH), axis=(-2, -1)))


def closed_form(a_ZHH: jax.Array) -> jax.Array:
    """exp of skew-symmetric H x H matrices, H <= 4, in closed form (differentiable).

    Reads the skew part (A - A^T)/2, so the gradient is the one along skew directions.
    """
    h = a_ZHH.shape[-1]
    a_ZHH = 0.5 * (a_ZHH - jnp.matrix_transpose(a_ZHH))
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
    return jnp.eye(h)[None] + f1 * a_ZHH + f2 * _broadcast_product(a_ZHH, a_ZHH)


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
    return (
        cp * cm * jnp.eye(4)[None] + cp * sm * m + sp * cm * p + sp * sm * _broadcast_product(p, m)
    )


def rho_power_bound(a_ZHH: jax.Array, powers: int) -> jax.Array:
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
    return squarings_for(rho_power_bound(jnp.asarray(a_XHH, jnp.float32), 2), _THETA)


def _taylor_ps(b, b2, b4, host: Host):
    """exp(B) to degree 15 by Paterson-Stockmeyer from B, B^2, B^4 (4 more products)."""
    eye = jnp.eye(b.shape[-1], dtype=b.dtype)[None]  # (1, H, H)
    b3 = materialised(b2, b, host)
    c = _TAYLOR_COEFFS

    def chunk(i):
        return c[4 * i] * eye + c[4 * i + 1] * b + c[4 * i + 2] * b2 + c[4 * i + 3] * b3

    poly = chunk(3)
    for i in (2, 1, 0):
        poly = chunk(i) + materialised(b4, poly, host)
    return poly


def _expm_skew_impl(a_ZHH: jax.Array, host: Host) -> jax.Array:
    # Normalise by a power of two >= ||A||_F: every rescaling below is exact.
    log_scale = pow2_above(_frobenius(a_ZHH))
    unit = a_ZHH * jnp.exp2(-log_scale)[:, None, None]
    unit2 = materialised(unit, unit, host)
    unit4 = materialised(unit2, unit2, host)
    rho = jnp.exp2(log_scale) * jnp.sqrt(jnp.sqrt(_frobenius(unit4)))
    s = jax.lax.stop_gradient(squarings_for(rho, _THETA))
    scale = jnp.exp2(log_scale - s.astype(jnp.float32))[:, None, None]
    taylor = _taylor_ps(unit * scale, unit2 * scale**2, unit4 * scale**4, host)
    return square(host, s, taylor)


def expm_skew_chunked(host: Host, a_ZHH: jax.Array) -> jax.Array:
    return chunked(functools.partial(_expm_skew_impl, host=host), host, a_ZHH)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _expm_skew(a_XHH: jax.Array, host: Host) -> jax.Array:
    return lie.on_matrix_batch(functools.partial(expm_skew_chunked, host), a_XHH)


def _expm_skew_fwd(a_XHH, host):
    return _expm_skew(a_XHH, host), a_XHH


def _expm_skew_bwd(host, a_XHH, g_XHH):
    # <L_exp(A)[E], G> = <E, L_exp(A^T)[G]>: the adjoint is a Frechet derivative at A^T, which
    # forward mode computes through the same scaling and squaring without storing intermediates.
    impl = functools.partial(lie.on_matrix_batch, functools.partial(expm_skew_chunked, host))
    _, grad = jax.jvp(impl, (jnp.matrix_transpose(a_XHH),), (g_XHH,))
    return (grad,)


_expm_skew.defvjp(_expm_skew_fwd, _expm_skew_bwd)
# Compiled once per shape and host: called eagerly, the while loop would otherwise be retraced
# each call. Under an outer jit this is inlined. Closed forms (H <= 4) are differentiated
# directly and the same on every host.
_expm_skew_jit = jax.jit(_expm_skew, static_argnums=1)
_closed_form_jit = jax.jit(functools.partial(lie.on_matrix_batch, closed_form))


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
    return _expm_skew_jit(a_XHH.astype(jnp.float32), check_host(host))
