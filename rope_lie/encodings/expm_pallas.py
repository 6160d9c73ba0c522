"""``expm``'s "pallas" squarings (``expm.SQUARING_LOOPS``): all the squarings of a block of small
matrices in one Pallas kernel.

``square(interpret, s_Z, r_ZHH)`` is R <- R^2, s_z times for matrix z, masked past each s_z as
``expm.square``'s loops are, with the loop inside the kernel: no trip count read on the host,
no kernel per iteration. Its forward-mode derivative (the VJPs' Frechet adjoint in ``expm``) is
a second kernel on pairs (R, dR) -> (R^2, R dR + dR R) through a ``jax.custom_jvp``:
pallas_call's own JVP rule fails on this kernel (jax 0.10.2). ``squarings_adjoint`` is the
reverse-mode VJP's loop (``expm_combination._squarings_adjoint``: (P, Z) -> (P^2,
Z P^T + P^T Z)) as a third. Interpret mode on CPU (for the tests), compiled by Pallas's Triton
backend on GPUs; float32; H up to ``PALLAS_MAX``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# The "pallas" squarings: matrices up to 16 x 16, zero-padded to a power of two (Triton's
# arrays have power-of-two sides; a zero row and column square to zeros and add exact zeros),
# and per program as many as make the broadcast product's (Zb, H, H, H) intermediate this many
# elements (16 matrices of 8 x 8, 2 of 16 x 16). Unmeasured: chosen so that a program's values
# stay in registers: compiled for sm_90a by the triton 3.8 Python package (a GPU compiles it
# with XLA's own Triton) at Pallas's default 4 warps, at 8 x 8 the squarings used 128 registers
# a thread, the kernel on pairs 209 and the adjoint 205, none spilling; at twice the elements
# the pairs and the adjoint spilled (``python -m experiments.benchmarks.pallas_registers``).
# Not timed.
PALLAS_MAX = 16
PALLAS_BLOCK_ELEMENTS = 2**13


def reduce_product(a_ZHH: jax.Array, b_ZHH: jax.Array) -> jax.Array:
    """Batched product as one broadcast multiply summed over k (no slices, no dot: tiny
    matrices); also ``expm``'s "reduce" small products."""
    return jnp.sum(a_ZHH[..., :, :, None] * b_ZHH[..., None, :, :], axis=-2)


def _squarings_kernel(s_ref, *refs):
    """All the squarings of one block: (R,) -> (R after s_z squarings,), or with a tangent
    (R, dR) -> (R^2, R dR + dR R) s_z times; inputs' refs first, then the outputs'."""
    s_Z = s_ref[...]

    def step(k, carry):
        r, *tangent = carry
        squared = (reduce_product(r, r),)
        squared += tuple(reduce_product(r, d) + reduce_product(d, r) for d in tangent)
        keep = (k < s_Z)[:, None, None]
        return tuple(jnp.where(keep, new, old) for new, old in zip(squared, carry, strict=True))

    inputs, outputs = refs[: len(refs) // 2], refs[len(refs) // 2 :]
    results = jax.lax.fori_loop(0, jnp.max(s_Z), step, tuple(ref[...] for ref in inputs))
    for ref, result in zip(outputs, results, strict=True):
        ref[...] = result


def _transposed_products(p, z):
    """Z P^T + P^T Z, each a broadcast summed over the shared index (no transpose in a kernel):
    (Z P^T)_ij = sum_k Z_ik P_jk and (P^T Z)_ij = sum_k P_ki Z_kj."""
    z_p_t = jnp.sum(z[..., :, None, :] * p[..., None, :, :], axis=-1)
    p_t_z = jnp.sum(p[..., :, :, None] * z[..., :, None, :], axis=-3)
    return z_p_t + p_t_z


def _adjoint_kernel(s_ref, p_ref, z_ref, p_out_ref, z_out_ref):
    """``expm_combination._squarings_adjoint`` on one block: (P, Z) -> (P^2, Z P^T + P^T Z) for
    k < max(s), Z kept past each matrix's s_z (P squares on, unread)."""
    s_Z = s_ref[...]

    def step(k, carry):
        p, z = carry
        keep = (k < s_Z)[:, None, None]
        return reduce_product(p, p), jnp.where(keep, _transposed_products(p, z), z)

    p, z = jax.lax.fori_loop(0, jnp.max(s_Z), step, (p_ref[...], z_ref[...]))
    p_out_ref[...] = p
    z_out_ref[...] = z


def squarings_adjoint(
    interpret: bool, s_Z: jax.Array, t_ZHH: jax.Array, z_ZHH: jax.Array
) -> jax.Array:
    """The VJP of R = T^(2^s) at T applied to Z (``expm_combination._squarings_adjoint``, the
    reverse-mode backward's loop) as one Pallas kernel."""
    return _pallas_squarings(interpret, s_Z, t_ZHH, z_ZHH, kernel=_adjoint_kernel)[1]


def _pallas_squarings(
    interpret: bool, s_Z: jax.Array, *r_ZHH: jax.Array, kernel=_squarings_kernel
) -> tuple:
    """``kernel`` (``_squarings_kernel``, or ``_adjoint_kernel``) on blocks of Zb matrices,
    padded to Zb's multiple (s = 0) and to a power-of-two side (``PALLAS_BLOCK_ELEMENTS``);
    interpret mode on CPU, else Triton."""
    # Imported here: only this option needs Pallas, and its modules move between jax releases.
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pallas_triton

    z, h = s_Z.shape[0], r_ZHH[0].shape[-1]
    side = 1 << (h - 1).bit_length()
    block = max(1, PALLAS_BLOCK_ELEMENTS // side**3)
    padded = -(-z // block) * block
    s_Z = jnp.pad(s_Z, (0, padded - z))
    r_ZHH = [jnp.pad(r, ((0, padded - z), (0, side - h), (0, side - h))) for r in r_ZHH]
    matrices = pl.BlockSpec((block, side, side), lambda i: (i, 0, 0))
    out = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(r.shape, r.dtype) for r in r_ZHH],
        grid=(padded // block,),
        in_specs=[pl.BlockSpec((block,), lambda i: (i,))] + [matrices] * len(r_ZHH),
        out_specs=[matrices] * len(r_ZHH),
        interpret=interpret,
        compiler_params=None if interpret else pallas_triton.CompilerParams(),
    )(s_Z, *r_ZHH)
    return tuple(r[:z, :h, :h] for r in out)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def square(interpret: bool, s_Z: jax.Array, r_ZHH: jax.Array) -> jax.Array:
    """``expm.square`` as one Pallas kernel. Forward mode is the kernel on pairs (s, an integer,
    has no tangent); no rule for a second derivative."""
    return _pallas_squarings(interpret, s_Z, r_ZHH)[0]


@square.defjvp
def _square_jvp(interpret, primals, tangents):
    (s_Z, r_ZHH), (_, dr_ZHH) = primals, tangents  # s is an integer: no tangent
    return _pallas_squarings(interpret, s_Z, r_ZHH, dr_ZHH)
