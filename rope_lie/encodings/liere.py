"""LieRE: Lie-group relative position encodings (Ostmeier et al., arXiv:2406.10322).

For a token at position p in R^A and each head,

    R(p) = expm(sum_a p_a G_a),    x' = R(p) x    (queries and keys, never values),

with learned skew-symmetric generators G_a = U_a - U_a^T, U_a the strict upper triangle of a raw
parameter (the reference's ``triu(W, 1) - triu(W, 1)^T``, entries initialised U[0, 2*pi)).

Block size b (``block_size``; None = dense, b = H): each G_a is block diagonal with K = H // b
contiguous b x b blocks acting on channels [r*b, (r+1)*b). ``init`` requires b to divide H
unless ``partial_blocks=True``, which leaves the H mod b channels after the last block
unrotated (the convention of docs/encoders.md): no channel goes unrotated unasked. b = 2 is
RoPE-Mixed with learned frequencies: the block [[0, g], [-g, 0]] gives the rotation
[[cos gt, sin gt], [-sin gt, cos gt]], i.e. the interleaved pair (2j, 2j+1) rotated by angle
-g*t (computed in closed form, no expm). In 1D (A = 1), and for b = 2 in any dimension, the
exponents commute, so q.k depends on p_q - p_k only; in 2D/3D with b > 2 the G_a do not commute
and LieRE is *not* translation invariant (it also sees absolute positions).

Per-example positions (pos_BTA, padded mixed-size batches) mostly repeat across examples: their
exponentials are computed once per distinct position of the batch and gathered per token
(``_shared_rotations``, static shapes under ``jit``; such positions take no gradient).

Conventions: interleaved pairs (2j, 2j+1) for b = 2, contiguous blocks, rotation multiplies from
the left, axis order of ``pos`` = array order of the input, prefix (class) tokens at position 0
get R(0) = I (not rotated). Exponentials are computed in float32 by
``expm_combination.expm_skew_combination`` (the Taylor parts of all tokens from one matrix
product against monomials of the generators; finite for every finite generator norm); the
output has x's dtype.

``precompute`` returns the rotations as the encoder state (``encodings/state.py``: pair angles
for b = 2, block rotations otherwise) and ``state.rotate(x)`` applies them (``apply`` is the two
in sequence): the model computes them once per step for all layers and heads that share
generators, and caches them per resolution at evaluation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from rope_lie.encodings import _checks, _sharding, expm_combination, family, lie, state

_FAMILY = "liere"


def _stored_count(num_heads: int, head_dim: int, num_axes: int, settings) -> int:
    """gen_ANKbb (A, N, K, b, b), K = H // b, stored raw (only strict upper triangles used)."""
    block = settings["block_size"] or head_dim
    return num_axes * num_heads * (head_dim // block) * block * block


FAMILY = family.Family(
    name=_FAMILY,
    kind="rotary",
    convention="sequential",
    relative=False,  # dense 2D/3D generators do not commute (b = 2 and 1D are relative)
    apply_defaults={},  # the block size is read from the parameters' shape
    stored_count=_stored_count,
    examples=(
        ({"block_size": 4}, (1, 2, 3)),
        ({}, (1, 2, 3)),
        ({"block_size": 2}, (1, 2, 3)),
        ({"block_size": 5, "partial_blocks": True}, (2,)),  # 12 % 5: channels 10, 11 unrotated
    ),
)
APPLY_HPARAMS: tuple[str, ...] = tuple(FAMILY.apply_defaults)

# Positions times generators at full float32 precision: TPUs would otherwise contract float32 in
# bfloat16 passes, and exponents of positions in the tens need float32's resolution.
_HIGHEST = jax.lax.Precision.HIGHEST


def _check_block_size(block_size, head_dim: int) -> int:
    """The block size b: None means dense (b = H); else an int in [2, H]."""
    if block_size is None:
        if head_dim < 2:
            raise ValueError(f"{_FAMILY}: head_dim={head_dim} must be at least 2 to rotate")
        return head_dim
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise ValueError(f"{_FAMILY}: block_size={block_size!r} must be None or an int in [2, H]")
    if not 2 <= block_size <= head_dim:
        raise ValueError(
            f"{_FAMILY}: block_size={block_size} must be in [2, head_dim={head_dim}] "
            "(None for a dense generator)"
        )
    return int(block_size)


def init(
    key: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_axes: int,
    block_size: int | None = None,
    init_scale: float = 2 * math.pi,
    partial_blocks: bool = False,
) -> dict[str, jax.Array]:
    """Random raw generators, entries U[0, init_scale) (only the strict upper triangles are used).

    Args:
      key: PRNG key.
      num_heads: N, heads.
      head_dim: H, channels per head.
      num_axes: A, position axes (one generator per axis).
      block_size: b, contiguous b x b blocks (None: dense, b = H); an int in [2, H].
      init_scale: upper end of the uniform init (2*pi in the reference; the paper also uses 1).
      partial_blocks: allow a b that does not divide H; the H mod b channels after the last
        block are then not rotated. False: such a b is an error.

    Returns:
      {"gen_ANKbb": (A, N, K, b, b) float32} with K = H // b.
    """
    _checks.check_shape_args(num_heads, head_dim, num_axes, _FAMILY)
    block = _check_block_size(block_size, head_dim)
    if head_dim % block and not partial_blocks:
        raise ValueError(
            f"{_FAMILY}: head_dim={head_dim} is not divisible by block_size={block_size}: the "
            f"last {head_dim % block} channels would not be rotated; choose a block size that "
            "divides head_dim, or set partial_blocks=True to leave them unrotated"
        )
    _checks.check_real(init_scale, "init_scale", _FAMILY)
    shape = (num_axes, num_heads, head_dim // block, block, block)
    gen = jax.random.uniform(key, shape, jnp.float32, 0.0, float(init_scale))
    return family.params(
        _FAMILY,
        {"gen_ANKbb": gen},
        num_heads=num_heads,
        head_dim=head_dim,
        num_axes=num_axes,
        block_size=block_size,
        init_scale=init_scale,
        partial_blocks=partial_blocks,
    )


def params_from_generators(
    gen_ANHH: jax.Array, block_size: int | None = None
) -> dict[str, jax.Array]:
    """Parameters from explicit skew-symmetric generators (e.g. to reproduce a checkpoint).

    The generators must be concrete (not traced): their values are validated.

    Args:
      gen_ANHH: (A, N, H, H) skew-symmetric generators (within a relative tolerance of 1e-6).
      block_size: b, or None for dense. With b, every entry outside the K = H // b contiguous
        diagonal b x b blocks (including the rows/columns of leftover channels) must be zero.

    Returns:
      {"gen_ANKbb": (A, N, K, b, b) float32}: the diagonal blocks.
    """
    gen = np.asarray(gen_ANHH, dtype=np.float64)
    if gen.ndim != 4 or gen.shape[-1] != gen.shape[-2]:
        raise ValueError(
            f"{_FAMILY}: generators must have shape (A, N, H, H) (rank 4, square), "
            f"got shape {gen.shape}"
        )
    head_dim = gen.shape[-1]
    block = _check_block_size(block_size, head_dim)
    tol = 1e-6 * max(1.0, float(np.max(np.abs(gen), initial=0.0)))
    asym = float(np.max(np.abs(gen + np.swapaxes(gen, -1, -2)), initial=0.0))
    if not asym <= tol:
        raise ValueError(
            f"{_FAMILY}: generators are not skew-symmetric: max |G + G^T| = {asym:.3g} > {tol:.3g}"
        )
    num_blocks = head_dim // block
    in_blocks = np.kron(np.eye(num_blocks), np.ones((block, block)))
    in_blocks = np.pad(in_blocks, (0, head_dim - num_blocks * block)).astype(bool)
    outside = float(np.max(np.abs(np.where(in_blocks, 0.0, gen)), initial=0.0))
    if not outside <= tol:
        raise ValueError(
            f"{_FAMILY}: generators have entries up to {outside:.3g} outside the diagonal "
            f"{block}x{block} blocks (block_size={block_size}, head_dim={head_dim})"
        )
    blocks = [
        gen[..., r * block : (r + 1) * block, r * block : (r + 1) * block]
        for r in range(num_blocks)
    ]
    return {"gen_ANKbb": jnp.asarray(np.stack(blocks, axis=2), jnp.float32)}


def _generator_blocks(params: dict[str, jax.Array]) -> jax.Array:
    family.bound(params, _FAMILY)  # tagged parameters of another family are an error
    gen = _checks.param(params, "gen_ANKbb", _FAMILY)
    _checks.check_keys(params, ["gen_ANKbb"], _FAMILY)
    if gen.ndim != 5 or gen.shape[-1] != gen.shape[-2]:
        raise ValueError(
            f"{_FAMILY}: params['gen_ANKbb'] must have shape (A, N, K, b, b), got {gen.shape}"
        )
    return gen.astype(jnp.float32)


def _pair_angles(gen_ANKbb: jax.Array, pos: jax.Array) -> jax.Array:
    """Closed form for b = 2: pair k of head n turns by -sum_a p_a g[a, n, k] (g = upper entry)."""
    upper_ANK = gen_ANKbb[..., 0, 1]
    spec = "TA,ANK->TNK" if pos.ndim == 2 else "BTA,ANK->BTNK"
    return -jnp.einsum(spec, pos.astype(jnp.float32), upper_ANK, precision=_HIGHEST)


def _checked_pos(gen_ANKbb: jax.Array, pos) -> jax.Array:
    return _checks.check_positions(pos, _FAMILY, gen_ANKbb.shape[0])


def rotations(params: dict[str, jax.Array], pos: jax.Array) -> jax.Array:
    """The block rotations R(p) = expm(sum_a p_a G_a), one per token, head and block.

    Args:
      params: {"gen_ANKbb": (A, N, K, b, b)} from ``init`` or ``params_from_generators``.
      pos: pos_TA (shared by the batch) or pos_BTA (per example), A == num_axes.

    Returns:
      r_TNKbb (or r_BTNKbb for per-example positions), float32; block r of head n acts on
      channels [r*b, (r+1)*b), and leftover channels past K*b are not rotated.
    """
    gen_ANKbb = _generator_blocks(params)
    return _token_rotations(gen_ANKbb, _checked_pos(gen_ANKbb, pos))


def _token_rotations(gen_ANKbb: jax.Array, pos: jax.Array) -> jax.Array:
    """``_rotations``, by distinct position for per-example positions of several examples and
    blocks larger than 2 (``_shared_rotations``); the shared positions pos_TA of an image batch,
    and one example's, as always."""
    if pos.ndim == 3 and pos.shape[0] > 1 and gen_ANKbb.shape[-1] > 2:
        return _shared_rotations(gen_ANKbb, pos)
    return _rotations(gen_ANKbb, pos)


# Row counts the exponentials of per-example positions can run on: T, 4 T, 16 T, ... below B T,
# then B T (``_row_tiers``).
_TIER_FACTOR = 4


def _row_tiers(batch: int, tokens: int) -> tuple[int, ...]:
    """(T, 4 T, 16 T, ..., B T): the static row counts ``_shared_rotations`` chooses from."""
    sizes, size = [], tokens
    while size < batch * tokens:
        sizes.append(size)
        size *= _TIER_FACTOR
    return (*sizes, batch * tokens)


@jax.jit
def _shared_rotations(gen_ANKbb: jax.Array, pos_BTA: jax.Array) -> jax.Array:
    """r_BTNKbb with one exponential per distinct position of the batch, gathered per token.

    A padded mixed-size batch (``ViT.classify_tokens``) repeats most positions: its examples
    share their grids' positions (every example of a grid size the same ones, and every prefix
    and padded slot position 0), so a NaFlex batch of 16 at sides 6-10 (1,616 slots) holds 326
    distinct positions. The exponentials are the step's costly part (one Taylor product row and
    its squarings per row); the gather per token is a copy.

    Static shapes inside ``jit``: ``jnp.unique`` with ``size=B T`` (a batch cannot hold more
    distinct positions than slots, so the bound is exact, nothing is ever cut off, and no host
    round trip or recompilation per batch is needed, as computing the set outside ``jit``
    would), then ``lax.switch`` on the actual count picks the smallest of the static row counts
    ``_row_tiers`` (T, 4 T, 16 T, ..., B T) that holds them: the exponentials run on the first
    that many unique rows (the rest are position 0, as filled). One branch runs per step; each
    is compiled (about log4 B of them). Equal to the per-token exponentials to float32
    rounding (the same rows, in a program of another shape). Data-parallel runs compute the
    distinct rows of the global batch on every device.

    Positions take no gradient here (``_no_position_gradient``): tokens at one position share
    one exponential, so a per-token position gradient would need the per-token Jacobians this
    path saves. The generators' gradients are exact (summed over the tokens of each row).
    """
    batch, tokens, num_axes = pos_BTA.shape
    tiers = _row_tiers(batch, tokens)
    # Under Explicit mesh axes the set of distinct positions is the global batch's: the sort
    # in ``jnp.unique`` needs every row on every device, and the rotations go back to the
    # positions' split at the end.
    split = _sharding.batch_axes(pos_BTA)
    pos_BTA = _sharding.replicated(pos_BTA)
    pos_XA = _no_position_gradient(pos_BTA.reshape(-1, num_axes).astype(jnp.float32))
    unique_UA, inverse_X, counts_U = jnp.unique(
        pos_XA,
        axis=0,
        size=pos_XA.shape[0],
        fill_value=0.0,
        return_inverse=True,
        return_counts=True,
    )
    tier = jnp.searchsorted(jnp.asarray(tiers), jnp.count_nonzero(counts_U))  # smallest >= count

    def on_first(rows: int):
        return lambda: _rotations(gen_ANKbb, unique_UA[:rows])[inverse_X.reshape(-1)]

    r_XNKbb = jax.lax.switch(tier, [on_first(rows) for rows in tiers])
    return _sharding.split_batch(r_XNKbb.reshape(batch, tokens, *r_XNKbb.shape[1:]), split)


@jax.custom_vjp
def _no_position_gradient(pos_XA: jax.Array) -> jax.Array:
    """The positions, with an error instead of a gradient (``_shared_rotations``)."""
    return pos_XA


def _no_position_gradient_fwd(pos_XA):
    return pos_XA, None


def _no_position_gradient_bwd(_, cotangent):
    raise ValueError(
        f"{_FAMILY}: per-example positions pos_BTA (B > 1, blocks larger than 2) take no "
        "gradient: their rotations are computed once per distinct position and shared by its "
        "tokens; differentiate with positions pos_TA shared by the batch, or one example at "
        "a time"
    )


_no_position_gradient.defvjp(_no_position_gradient_fwd, _no_position_gradient_bwd)


@jax.jit
def _rotations(gen_ANKbb: jax.Array, pos: jax.Array) -> jax.Array:
    if gen_ANKbb.shape[-1] == 2:
        return lie.pair_rotation_blocks(_pair_angles(gen_ANKbb, pos))
    num_axes, num_heads, num_blocks, block = gen_ANKbb.shape[:4]
    skew_AYbb = lie.skew_from_upper(gen_ANKbb).reshape(num_axes, -1, block, block)
    # One exponential per (token, head, block), the Taylor parts of all tokens from one product.
    r_XYbb = expm_combination.expm_skew_combination(
        pos.reshape(-1, num_axes).astype(jnp.float32), skew_AYbb
    )
    return r_XYbb.reshape(*pos.shape[:-1], num_heads, num_blocks, block, block)


def precompute(
    params: dict[str, jax.Array],
    pos: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_prefix: int = 0,
) -> state.PairAngles | state.BlockRotations:
    """The rotations of every token (the encoder state, ``encodings/state.py``).

    Computed once per step for a position set, they are shared by every layer and head that
    shares the parameters, and cached per resolution at evaluation.

    Args:
      params: {"gen_ANKbb": (A, N, K, b, b)}.
      pos: pos_TA (shared by the batch) or pos_BTA (per example).
      num_heads: N of the parameters (1 when heads share them).
      head_dim: H: init's, for its parameters; a plain dict's K blocks of b take any H with
        H // b == K (channels past K b are not rotated).
      num_prefix: prefix tokens (at position 0: R = I).

    Returns:
      ``PairAngles`` (T, N, K) for b = 2 (closed form), else ``BlockRotations``
      (T, N, K, b, b); with a leading B for pos_BTA. float32.
    """
    gen_ANKbb = _generator_blocks(params)
    _checks.check_state_args(num_heads, head_dim, num_prefix, _FAMILY)
    # Parameters from init know their H exactly; a plain dict's K b leaves H // b == K.
    family.check_made_for(params, _FAMILY, head_dim=head_dim)
    _, gen_heads, num_blocks, block = gen_ANKbb.shape[:4]
    if gen_heads != num_heads or head_dim // block != num_blocks:
        raise ValueError(
            f"{_FAMILY}: num_heads={num_heads}, head_dim={head_dim} do not fit the parameters' "
            f"{gen_heads} heads of {num_blocks} blocks of size {block} (H // {block} must be "
            f"{num_blocks})"
        )
    pos = _checked_pos(gen_ANKbb, pos)
    if block == 2:
        return state.PairAngles(_pair_angles(gen_ANKbb, pos))
    return state.BlockRotations(_token_rotations(gen_ANKbb, pos))


def apply(params: dict[str, jax.Array], x_BTNH: jax.Array, pos: jax.Array) -> jax.Array:
    """Rotate queries or keys: x'_t = R(p_t) x_t, block by block.

    Args:
      params: {"gen_ANKbb": (A, N, K, b, b)}; b and K are read from its shape.
      x_BTNH: queries or keys, any float dtype: N heads (any N for one head's parameters) and
        H channels, init's H for its parameters (a plain dict: any H with H // b == K).
      pos: pos_TA (rotations computed once and shared by the batch) or pos_BTA (per example).

    Returns:
      (B, T, N, H) array in x's dtype; channels past K*b are unchanged.
    """
    gen_ANKbb = _generator_blocks(params)
    num_axes, num_heads, num_blocks, block = gen_ANKbb.shape[:4]
    _checks.check_x(x_BTNH, _FAMILY)
    _checks.check_pos(pos, x_BTNH, _FAMILY, num_axes=num_axes)
    shared = num_heads == 1  # one head's parameters serve every head, as their state does
    if (x_BTNH.shape[2] != num_heads and not shared) or x_BTNH.shape[3] // block != num_blocks:
        raise ValueError(
            f"{_FAMILY}: x has (N, H)=({x_BTNH.shape[2]}, {x_BTNH.shape[3]}) but the parameters "
            f"have num_heads={num_heads} and {num_blocks} blocks of size {block} "
            f"(H // {block} must be {num_blocks})"
        )
    pe = precompute(params, pos, num_heads=num_heads, head_dim=x_BTNH.shape[3])
    return pe.rotate(x_BTNH)
