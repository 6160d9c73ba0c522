"""RoPE-Mixed (Heo et al., "Rotary Position Embedding for Vision Transformer", arXiv:2403.13298).

Every channel pair j of head n is rotated by a learned linear function of all position axes:

    theta_j(p) = sum_a p_a * f[a, n, j],    j = 0, ..., F - 1,    F = H/2,

with learnable frequencies ``freqs_ANF`` (per head here; one set per layer is the model's job,
and they get no weight decay). The angle is linear in p, so <R(p) q, R(p') k> depends on
p' - p only. Axis-aligned frequencies (pair j on one axis only) give ``rope_axial``.

Initialisation follows the rope-vit reference ``init_random_2d_freqs(dim=H, num_heads=N,
theta=10, rotate=True)``: magnitudes mag_i = base^(-4i/H), i < H/4, base = 10, and per head an
angle phi ~ U[0, 2pi):

    f_x = cat(mag cos(phi), mag cos(pi/2 + phi)),    f_y = cat(mag sin(phi), mag sin(pi/2 + phi)).

Our axis order is the array order (row, col) = (y, x): f_y is axis 0 and f_x axis 1. For other
numbers of axes A the same construction is generalised so that every axis gets non-zero
frequencies: per head an orthonormal A x A basis, the F pairs split into A contiguous groups
(``np.array_split`` sizes when A does not divide F), and group g gets basis column g times the
magnitudes base^(-2A*i/H), i counted within the group (base^(-4i/H) for A = 2). For A = 2 the
basis is the reference's (phi, phi + pi/2) pair; otherwise it is Haar-random on O(A) (a random
sign for A = 1).

Partial rotation (p-RoPE, Barbero et al., arXiv:2410.06205): ``rotary_fraction`` = p < 1 leaves
the pairs of the lowest initial magnitudes unrotated: in every group of pairs (above), the last
len(group) - round(p len(group)) pairs get angle 0 (their frequencies stay stored and get zero
gradients). The set is fixed by the init's magnitude order, since the learned frequencies move.
p = 1 (the default) rotates every pair, unchanged.

Conventions: interleaved pairs (2j, 2j+1), (a, b) -> (a cos t - b sin t, a sin t + b cos t);
R(p) multiplies q and k from the left (never v); prefix (class) tokens sit at position 0 and get
R(0) = I. Angles in float32 (the position-frequency contraction at full float32 precision),
output in x's dtype.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from rope_lie.encodings import _checks, family, fixed_frequency, state

_FAMILY = "rope_mixed"
FAMILY = family.Family(
    name=_FAMILY,
    kind="rotary",
    convention="integer",
    relative=True,
    apply_defaults={"rotary_fraction": 1.0},
    # freqs_ANF (A, N, H/2)
    stored_count=lambda num_heads, head_dim, num_axes, settings: (
        num_axes * num_heads * (head_dim // 2)
    ),
    examples=(({}, (1, 2, 3)), ({"rotary_fraction": 0.5}, (2,))),
    learned_frequencies="freqs_ANF",
)
APPLY_HPARAMS: tuple[str, ...] = tuple(FAMILY.apply_defaults)


def _reference_basis_2d(phi_N: jax.Array) -> jax.Array:
    """The rope-vit directions per head as a basis, (N, 2, 2): [n, axis, group].

    Group 0 points along (x, y) = (cos phi, sin phi), group 1 along phi + pi/2; axis 0 is y.
    """
    phi_N = jnp.asarray(phi_N, jnp.float32)
    phi_NA = jnp.stack([phi_N, jnp.pi / 2 + phi_N], axis=-1)
    return jnp.stack([jnp.sin(phi_NA), jnp.cos(phi_NA)], axis=-2)


# The helpers are jitted (shapes static) so that eager calls compile one small program each
# instead of one per primitive; inside a caller's jit they are inlined.
@functools.partial(jax.jit, static_argnums=(1, 2))
def _random_basis(key: jax.Array, num_heads: int, num_axes: int) -> jax.Array:
    """A random orthonormal basis per head, (N, A, A) as [n, axis, group]."""
    if num_axes == 2:
        phi_N = jax.random.uniform(key, (num_heads,), jnp.float32, 0.0, 2 * math.pi)
        return _reference_basis_2d(phi_N)
    return jax.random.orthogonal(key, num_axes, shape=(num_heads,), dtype=jnp.float32)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _freqs_from_basis(basis_NAA: jax.Array, head_dim: int, base: float) -> jax.Array:
    """Frequencies (A, N, F): pair j of group g = (direction column g) * base^(-2A*i/H).

    Args:
      basis_NAA: (N, A, A) directions per head, [n, axis, group]: as many groups of pairs as
        axes.
      head_dim: H (even); F = H/2 pairs are split into A contiguous groups.
      base: magnitude base.

    Returns:
      float32 (A, N, F).
    """
    num_axes, num_groups = basis_NAA.shape[-2], basis_NAA.shape[-1]
    groups = np.array_split(np.arange(head_dim // 2), num_groups)
    group_F = np.concatenate([np.full(len(g), k) for k, g in enumerate(groups)]).astype(int)
    within_F = np.concatenate([np.arange(len(g)) for g in groups])
    mag_F = base ** (-2.0 * num_axes * within_F / head_dim)
    mag_11F = jnp.asarray(mag_F, jnp.float32)[None, None]
    freqs_NAF = jnp.asarray(basis_NAA, jnp.float32)[..., group_F] * mag_11F
    return jnp.transpose(freqs_NAF, (1, 0, 2))


def rotated_pairs(num_pairs: int, num_axes: int, rotary_fraction: float) -> np.ndarray:
    """p-RoPE's mask: True for the pairs rotated (the first round(p n) of every group).

    Args:
      num_pairs: F = H/2.
      num_axes: A (the number of groups).
      rotary_fraction: p in [0, 1].

    Returns:
      bool (F,).
    """
    mask_F = np.zeros(num_pairs, bool)
    for group in np.array_split(np.arange(num_pairs), num_axes):
        mask_F[group[: fixed_frequency.kept_count(rotary_fraction, len(group))]] = True
    return mask_F


def init(
    key: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_axes: int,
    base: float = 10.0,
    rotary_fraction: float = 1.0,
) -> dict[str, jax.Array]:
    """Random initial frequencies (see the module docstring).

    Args:
      key: PRNG key.
      num_heads: number of heads N.
      head_dim: head dimension H, even.
      num_axes: number of position axes A.
      base: magnitude base (10 in the rope-vit reference).
      rotary_fraction: p-RoPE's fraction of pairs rotated (module docstring); checked here,
        used by ``apply``/``precompute``.

    Returns:
      ``{"freqs_ANF": float32 (A, N, H/2)}``.
    """
    _checks.check_shape_args(num_heads, head_dim, num_axes, _FAMILY)
    fixed_frequency.check_fraction(rotary_fraction, _FAMILY)
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even: rope_mixed rotates channel pairs")
    base = _checks.check_base(base, _FAMILY)
    basis_NAA = _random_basis(key, num_heads, num_axes)
    return family.params(
        _FAMILY,
        {"freqs_ANF": _freqs_from_basis(basis_NAA, head_dim, base)},
        num_heads=num_heads,
        head_dim=head_dim,
        num_axes=num_axes,
        base=base,
        rotary_fraction=rotary_fraction,
    )


def params_from_freqs(freqs_ANF, *, head_dim: int | None = None) -> dict[str, jax.Array]:
    """Parameters from explicit frequencies (e.g. axis-aligned ones, or a reference checkpoint).

    Args:
      freqs_ANF: (A, N, F) frequencies; the head dimension is H = 2F.
      head_dim: if given, checked against 2F.

    Returns:
      ``{"freqs_ANF": float32 (A, N, F)}``.
    """
    freqs_ANF = jnp.asarray(freqs_ANF, jnp.float32)
    if freqs_ANF.ndim != 3 or 0 in freqs_ANF.shape:
        raise ValueError(
            f"rope_mixed: freqs must have shape (A, N, F) with F = head_dim/2 and no empty axis, "
            f"got shape {tuple(freqs_ANF.shape)}"
        )
    if head_dim is not None and head_dim != 2 * freqs_ANF.shape[-1]:
        raise ValueError(
            f"rope_mixed: freqs have F={freqs_ANF.shape[-1]} pairs but head_dim={head_dim} needs "
            f"F=head_dim/2"
        )
    return {"freqs_ANF": freqs_ANF}


def _checked_freqs(params: dict[str, jax.Array]) -> jax.Array:
    freqs_ANF = _checks.param(params, "freqs_ANF", _FAMILY)
    _checks.check_keys(params, ["freqs_ANF"], _FAMILY)
    if freqs_ANF.ndim != 3:
        raise ValueError(f"rope_mixed: freqs_ANF must be (A, N, F), got {tuple(freqs_ANF.shape)}")
    return freqs_ANF


def precompute(
    params: dict[str, jax.Array],
    pos: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_prefix: int = 0,
    rotary_fraction: float = family.INIT,
) -> state.PairAngles:
    """The rotation angles theta_j(p) = sum_a p_a f[a, n, j]: everything the rotation needs that
    does not depend on x (the encoder state, ``encodings/state.py``), computed once per step for
    every layer that shares the frequencies, and cached per resolution at evaluation.

    Args:
      params: ``{"freqs_ANF": (A, N, F)}``.
      pos: ``pos_TA`` or ``pos_BTA``, A == num_axes.
      num_heads: N of the parameters (1 when heads share them).
      head_dim: H = 2F.
      num_prefix: prefix tokens (at position 0: R = I).
      rotary_fraction: p-RoPE's fraction of pairs rotated: ``init``'s (read from its
        parameters; a plain dict: this argument, else 1).

    Returns:
      ``PairAngles`` of shape (T, N, F) (``(B, T, N, F)`` for per-example positions), float32.
    """
    freqs_ANF = _checked_freqs(params)
    _checks.check_state_args(num_heads, head_dim, num_prefix, _FAMILY)
    if freqs_ANF.shape[1:] != (num_heads, head_dim // 2) or head_dim % 2:
        raise ValueError(
            f"{_FAMILY}: freqs_ANF has shape {tuple(freqs_ANF.shape)} but num_heads={num_heads}, "
            f"head_dim={head_dim} (expected (A, {num_heads}, head_dim / 2) with head_dim even)"
        )
    pos = _checks.check_positions(pos, _FAMILY, freqs_ANF.shape[0])
    angle = _angles(pos.astype(jnp.float32), freqs_ANF.astype(jnp.float32))
    (rotary_fraction,) = family.bound(params, _FAMILY, rotary_fraction=rotary_fraction).values()
    fraction = fixed_frequency.check_fraction(rotary_fraction, _FAMILY)
    if fraction != 1.0:
        mask_F = rotated_pairs(freqs_ANF.shape[-1], freqs_ANF.shape[0], fraction)
        angle = jnp.where(jnp.asarray(mask_F), angle, 0.0)
    return state.PairAngles(angle)


def apply(
    params: dict[str, jax.Array],
    x_BTNH: jax.Array,
    pos: jax.Array,
    *,
    rotary_fraction: float = family.INIT,
) -> jax.Array:
    """Rotate queries or keys by R(p), theta_j = sum_a p_a f[a, n, j].

    Args:
      params: ``{"freqs_ANF": (A, N, F)}`` from ``init`` or ``params_from_freqs``.
      x_BTNH: queries or keys (B, T, N, H), any float dtype, H = 2F.
      pos: positions ``pos_TA`` shared by the batch, or ``pos_BTA`` per example.
      rotary_fraction: p-RoPE's fraction of pairs rotated: ``init``'s (read from its
        parameters; a plain dict: this argument, else 1).

    Returns:
      (B, T, N, H) array in x's dtype.
    """
    freqs_ANF = _checked_freqs(params)
    num_axes, num_heads, num_pairs = freqs_ANF.shape
    _checks.check_x(x_BTNH, _FAMILY)
    _checks.check_heads(x_BTNH, num_heads, 2 * num_pairs, _FAMILY)
    _checks.check_pos(pos, x_BTNH, _FAMILY, num_axes=num_axes)
    pe = precompute(
        params, pos, num_heads=num_heads, head_dim=2 * num_pairs, rotary_fraction=rotary_fraction
    )
    return pe.rotate(x_BTNH)


@jax.jit
def _angles(pos32: jax.Array, freqs32_ANF: jax.Array) -> jax.Array:
    spec = "TA,ANF->TNF" if pos32.ndim == 2 else "BTA,ANF->BTNF"
    # HIGHEST: TPUs would otherwise contract float32 in bfloat16 passes, and angles of positions
    # in the tens need float32's resolution.
    return jnp.einsum(spec, pos32, freqs32_ANF, precision=jax.lax.Precision.HIGHEST)
