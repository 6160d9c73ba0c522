"""``exp(sum_a c[x, a] G[a, y])`` for many coefficient vectors and a few skew generators.

LieRE's ``R(p) = expm(sum_a p_a G_a)`` for every token p and head (generator set y), sharing
work between tokens. The Taylor polynomial of B = sum_a b_a G_a is written in monomials of b:
sum_k B^k / k! = sum_alpha b^alpha M_alpha, M_alpha = (sum of the words in the G_a with letter
counts alpha) / |alpha|!. The M_alpha are computed once per generator set; every row then costs
one row of a single large matrix product, which runs near peak speed (batched small products do
not), and its squarings (scaling and squaring as in ``expm``). s bounds sum_a |b_a| rho(G_a), so
no monomial term exceeds the Taylor terms at norm theta. VJP: the Frechet derivative at A^T per
row, as ``expm.expm_skew``'s, or reverse mode through this program
(``COMBINATION_BACKWARDS``). The products, squarings, bounds and the ``Host`` are ``expm``'s
building blocks. ``num_squarings`` gives each row's s (for the benchmarks' cost models).
Everything is computed in float32 whatever the input dtype.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from rope_lie.encodings import _checks, expm, expm_pallas, lie
from rope_lie.encodings.expm import Host

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
        grown = {
            tuple(m[i] + (i == a) for i in range(num_axes))
            for m in levels[-1]
            for a in range(num_axes)
        }
        levels.append(sorted(grown, reverse=True))
    parents = []
    for k in range(1, degree + 1):
        index = {m: i for i, m in enumerate(levels[k - 1])}
        parents.append(
            [
                np.array(
                    [
                        index.get(tuple(m[i] - (i == a) for i in range(num_axes)), -1)
                        for m in levels[k]
                    ]
                )
                for a in range(num_axes)
            ]
        )
    # Highest degree first, I last: the float32 product then adds the small terms before the
    # large ones, which lowers the rounding error (benchmarks README, section 14).
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
        prods = jnp.einsum("ayij,myjl->amyil", gen_AYHH, prev, precision=expm.HIGHEST) / k
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
    rho_A = jnp.max(jax.lax.stop_gradient(expm.rho_power_bound(gen_AYHH, 4)), axis=1)
    bound_X = jnp.sum(jnp.abs(jax.lax.stop_gradient(coef_XA)) * rho_A[None], axis=-1)
    s_X = expm.squarings_for(bound_X, _combination_theta(degree))
    log_scale_A = expm.pow2_above(rho_A)
    gen_unit = gen_AYHH * jnp.exp2(-log_scale_A)[:, None, None, None]
    b_XA = coef_XA * jnp.exp2(log_scale_A[None] - s_X[:, None].astype(jnp.float32))
    return s_X, b_XA, _word_basis(gen_unit, degree), degree


def num_squarings(coef_XA: jax.Array, gen_AYHH: jax.Array) -> jax.Array:
    """The squarings ``expm_skew_combination`` does for each row of ``coef_XA``.

    Args:
      coef_XA: (X, A) coefficients.
      gen_AYHH: (A, Y, H, H) skew generators.

    Returns:
      (X,) int32 squaring counts s.
    """
    return _combination_setup(jnp.asarray(coef_XA), jnp.asarray(gen_AYHH))[0]


def _taylor_rows(b_XA: jax.Array, basis_MYHH: jax.Array, degree: int) -> jax.Array:
    """exp(sum_a b_a G_a) for every row of b: one (X, M) x (M, Y*H*H) product; (X*Y, H, H)."""
    num_mono, num_gen, h = basis_MYHH.shape[:3]
    _, exponents_MA = _monomials(b_XA.shape[-1], degree)
    powers = [jnp.ones_like(b_XA)]
    for _ in range(degree):
        powers.append(powers[-1] * b_XA)
    powers_XAQ = jnp.stack(powers, axis=-1)
    # coef[x, alpha] = prod_a b_a^alpha_a, gathered by one-hot products: a plain gather makes
    # XLA:CPU lay the coefficients out transposed and run the large product slower.
    coef_XM = 1.0
    for a in range(b_XA.shape[-1]):
        one_hot_MQ = jax.nn.one_hot(exponents_MA[:, a], degree + 1, dtype=b_XA.dtype)
        coef_XM = coef_XM * jnp.einsum(
            "xk,mk->xm", powers_XAQ[:, a], one_hot_MQ, precision=expm.HIGHEST
        )
    e = jnp.matmul(coef_XM, basis_MYHH.reshape(num_mono, -1), precision=expm.HIGHEST)
    return e.reshape(-1, h, h)


# Rows per group on a CPU (their Taylor rows and squarings): about 4 MiB of rotations, so a
# group stays in cache through its squarings. Broadcast products (b <= 8) are grouped only in
# the backward pass, where grouping helps; in the forward pass it does not (benchmarks README,
# section 14).
_GROUP_BYTES = 4 * 2**20


def _map_row_groups(
    fn, matrix_shape: tuple[int, int], host: Host, *arrays_X, group_broadcasts: bool = False
):
    """``fn`` on groups of rows (``lax.map``, padded with zero rows), each row holding
    ``num_gen`` H x H matrices (``matrix_shape = (H, num_gen)``); on all rows at once off CPU
    (``Host.groups_rows``), where the products are broadcasts (unless ``group_broadcasts``), or
    where the rows fit in one group."""
    h, num_gen = matrix_shape
    rows = arrays_X[0].shape[0]
    most = max(1, _GROUP_BYTES // (num_gen * h * h * 4))
    ungrouped = not host.groups_rows or (expm.broadcasts(h, host) and not group_broadcasts)
    if ungrouped or rows <= most:
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
        squares = functools.partial(expm.square, host)
        r = expm.chunked(squares, host, jnp.repeat(s_x, num_gen), _taylor_rows(b_xa, basis, degree))
        return r.reshape(s_x.shape[0], num_gen, h, h)

    return _map_row_groups(rows, (h, num_gen), host, s_X, b_XA)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _combination(coef_XA: jax.Array, gen_AYHH: jax.Array, host: Host) -> jax.Array:
    return _combination_impl(coef_XA, gen_AYHH, host)


def _combination_fwd(coef_XA, gen_AYHH, host):
    return _combination_impl(coef_XA, gen_AYHH, host), (coef_XA, gen_AYHH)


def _combination_bwd(host, res, r_bar_XYHH):
    # The Frechet adjoint at A^T per row, as in expm_skew's VJP; or reverse mode
    # (``COMBINATION_BACKWARDS``, defined below).
    coef_XA, gen_AYHH = res
    if combination_backward(host.platform) == "reverse":
        return _reverse_bwd(host, coef_XA, gen_AYHH, r_bar_XYHH)
    impl = functools.partial(lie.on_matrix_batch, functools.partial(expm.expm_skew_chunked, host))

    def rows(coef_xa, r_bar_xyhh):
        a_xyhh = jnp.einsum("xa,ayij->xyij", coef_xa, gen_AYHH, precision=expm.HIGHEST)
        return jax.jvp(impl, (jnp.matrix_transpose(a_xyhh),), (r_bar_xyhh,))[1]

    shape = (gen_AYHH.shape[-1], gen_AYHH.shape[1])
    a_bar = _map_row_groups(rows, shape, host, coef_XA, r_bar_XYHH, group_broadcasts=True)
    coef_bar = jnp.einsum("xyij,ayij->xa", a_bar, gen_AYHH, precision=expm.HIGHEST)
    gen_bar = jnp.einsum("xa,xyij->ayij", coef_XA, a_bar, precision=expm.HIGHEST)
    return coef_bar, gen_bar


_combination.defvjp(_combination_fwd, _combination_bwd)


def _closed_form_combination(coef_XA: jax.Array, gen_AYHH: jax.Array) -> jax.Array:
    a = jnp.einsum("xa,ayij->xyij", coef_XA, gen_AYHH, precision=expm.HIGHEST)
    return lie.on_matrix_batch(expm.closed_form, a)


# How the combination's VJP is computed, by platform (``Host.platform``, read when a program is
# traced; "default" for platforms not named):
# - "frechet": the Frechet derivative at A^T per row, as ``expm.expm_skew``'s VJP: the forward
#   mode of a whole exponential of A = sum_a coef_a G_a (its Paterson-Stockmeyer powers and
#   squarings, each with its tangent). Every platform's.
# - "reverse": reverse mode through this module's own forward program. The Taylor rows' one
#   large product and the word basis are differentiated by JAX (large products again, and
#   small work per generator set); the squarings' adjoint is one loop beside them
#   (``_squarings_adjoint``), with no stored intermediates. No products of tangents per row: on
#   an H100 the Frechet pass's batched 8 x 8 products ran as matrix-multiply kernels of 5.0 ms
#   in LieRE 8x8's 41.8 ms ViT-B/16 step (benchmarks README, section 13). Equal to "frechet"
#   to float32 rounding on CPU (``tests/encodings/test_combination_backward.py``). On an H200
#   it took 4.9 ms of GPU work off that step (30.7 ms to 25.8 ms, profiled), but its comparison
#   with "frechet" at 8 x 8 failed there, its message lost (benchmarks README, section 13): no
#   platform's default until the device queue's recorded failure message says by how much.
COMBINATION_BACKWARDS: dict[str, str] = {"default": "frechet"}
_BACKWARDS = ("frechet", "reverse")


def combination_backward(platform: str) -> str:
    """How ``platform`` computes the combination's VJP (``COMBINATION_BACKWARDS``)."""
    return _checks.platform_choice(
        COMBINATION_BACKWARDS, "COMBINATION_BACKWARDS", platform, _BACKWARDS
    )


def _squarings_adjoint(host: Host, s_Z: jax.Array, t_ZHH: jax.Array, z_ZHH: jax.Array):
    """The VJP of ``expm.square`` at T (R = T^(2^s), s per matrix) applied to Z = R-bar.

    Reverse mode through R_(k+1) = R_k R_k maps Z to Z R_k^T + R_k^T Z, from the last squaring
    to the first. The R_k = T^(2^k) are powers of one matrix and commute, so these maps commute
    too (left and right products by commuting matrices), and they can be applied from the first
    squaring on, each R_k squared from the one before: three products per squaring, nothing
    stored. Each matrix's Z stops at its own s, as the forward squarings do; its P squares on
    unread (they are rotations: they stay bounded). Where the squarings are "pallas"
    (``expm.Host.pallas_squarings``), the loop is one Pallas kernel
    (``expm_pallas.squarings_adjoint``).
    """
    if host.pallas_squarings and t_ZHH.shape[-1] <= expm.PALLAS_MAX:
        return expm_pallas.squarings_adjoint(host.platform == "cpu", s_Z, t_ZHH, z_ZHH)

    def body(carry):
        k, p, z = carry
        live = (k < s_Z)[:, None, None]
        p_t = jnp.matrix_transpose(p)
        z_next = expm.product(z, p_t, host) + expm.product(p_t, z, host)
        return k + 1, expm.product(p, p, host), jnp.where(live, z_next, z)

    init = (jnp.int32(0), t_ZHH, z_ZHH)
    return jax.lax.while_loop(lambda c: c[0] < jnp.max(s_Z), body, init)[2]


def _reverse_bwd(host: Host, coef_XA, gen_AYHH, r_bar_XYHH):
    """The combination's VJP in reverse mode (``COMBINATION_BACKWARDS`` "reverse")."""
    num_gen, h = gen_AYHH.shape[1], gen_AYHH.shape[-1]

    def taylor(coef, gen):
        s_X, b_XA, basis, degree = _combination_setup(coef, gen)
        return _taylor_rows(b_XA, basis, degree), s_X

    t_ZHH, taylor_vjp, s_X = jax.vjp(taylor, coef_XA, gen_AYHH, has_aux=True)
    z_ZHH = r_bar_XYHH.reshape(-1, h, h)
    adjoint = functools.partial(_squarings_adjoint, host)  # one chunk per core on a CPU
    t_bar = expm.chunked(adjoint, host, jnp.repeat(s_X, num_gen), t_ZHH, z_ZHH)
    return taylor_vjp(t_bar)


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
    return _combination_jit(coef_XA, gen_AYHH, expm.check_host(host))
