"""ComRoPE: rotary encodings from trainable commuting angle matrices (Yu et al., arXiv:2506.03737).

For a token at position p in R^A and each head,

    R(p) = expm(sum_a p_a A_a),    x' = R(p) x    (queries and keys, never values),

with block-diagonal skew-symmetric A_a = diag(B_a1, ..., B_aK), K = H / b blocks of b x b on
the contiguous channels [k b, (k + 1) b). For every block k the B_ak commute across axes a, so
R(p)^T R(p') = R(p' - p) (the paper's "RoPE equation"): q.k depends on p' - p only. Two
parameterisations (``variant``), with S_nk = P_nk - P_nk^T from a raw b x b matrix P_nk per
head n and block k:

- ``"ld"`` (linearly dependent): B_ank = s[a, k] S_nk with a learned scalar per axis and block;
- ``"ap"`` (axis partition): B_ank = S_nk if k = a (mod A), else 0: block k belongs to one axis.

Both give, per token, head and block, R_nk(p) = expm(t_nk(p) S_nk) with a scalar t linear in p:
t = sum_a p_a s[a, k] (LD) or t = p_(k mod A) (AP).

Fast path (no per-token exponential). S_nk is decomposed once per step: the Hermitian i S_nk
has eigenpairs (lambda_j, w_j), lambda_j >= 0 for the b/2 largest, and e1_j = sqrt(2) Re w_j,
e2_j = sqrt(2) Im w_j form an orthonormal basis Q_nk = [e1_0, e2_0, e1_1, ...] with
S e1 = lambda e2, S e2 = -lambda e1. So expm(t S) = Q Rot(t lambda) Q^T, Rot the interleaved
pair rotations of this package, and

    <R(p) q, R(p') k> = <Rot(t lambda) Q^T q, Rot(t' lambda) Q^T k>:

the state is ``PairAngles`` (angle t_nk(p) lambda_nkj on pair k b/2 + j) with ``mix_NHH`` =
P = diag(Q_nk^T), which the model folds into the q/k projections as Cayley-STRING's P
(``to_fold()``). A
family's ``apply`` therefore returns R'(p) x = Rot(t lambda) P x = P R(p) x, R(p) x up to the
fixed orthogonal left factor P (``spectra`` gives Q; the tests check P^T R'(p) = expm(...)
against scipy in float64); attention logits are the same. R'(0) = P.
Per token this costs what RoPE does (a cos/sin per pair), instead of one b x b exponential per
token, head and block (``rotations_expm``, what the reference does with ``torch.matrix_exp``;
``experiments/benchmarks/comrope_fast_path.py`` times the two). b = 2 needs no decomposition:
S = [[0, s], [-s, 0]] gives the angle -t s and P = I (no fold). Eigenvalue derivatives have
1 / (lambda_i - lambda_j) terms, so gradients are ill-conditioned where two eigenvalues of a
block meet (e.g. lambda = 0); a random init avoids that almost surely.

Source: github.com/Longin-Yu/ComRoPE ``model.py`` (``ComRoPELDAttention``,
``ComRoPEAPAttention``, ``CustomVITConfig.get_positions``), followed in: the raw P ~
N(0, init_std^2) per head (``init_std`` = 1 there), S = P - P^T, the LD multiplier
s ~ N(0, 1) of shape (A, K) shared by the heads, AP's block-to-axis map k mod A, left
multiplication by the block-diagonal R, H divisible by b (AP: by A b). AP's raw P are stored
per axis, ``gen_ANMbb`` (block k = m A + a), so that the parameters know their axes.
Positions: the reference uses (i + 0.5) / n per axis and 0.5 for the class token;
``positions``' ``"unit_centred"`` convention is that shifted by -1/2 (class token at 0), which
gives the same logits (R of a common shift cancels, the generators commuting). In 3D the
reference divides every axis, frames included, by the spatial side (its
``num_patches_on_single_axis``); we divide each axis by its own token count, so on a video
whose frame count differs from its side our time axis is scaled by side / frames against the
reference's (2D: the same). Where we differ besides: the fast path above instead of a
per-token ``matrix_exp`` (same logits; R'(p) = P R(p) as said); b must be even (an odd block
has a zero eigenvalue whose channel we would carry separately; the reference allows it); the
block size defaults to 8, LieRE's block size in our recipes (the reference's config default is 2).

Conventions: interleaved pairs in the rotated frame, contiguous blocks, axis order of ``pos`` =
array order, prefix tokens at position 0 get R'(0) = P. Angles and the decomposition in float32
(complex64 eigh), output in x's dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rope_lie.encodings import _checks, expm_combination, family, state

VARIANTS = ("ld", "ap")

_FAMILY = "comrope"


def _stored_count(num_heads: int, head_dim: int, num_axes: int, settings) -> int:
    """Raw P per head and block, N K b^2 = N H b (LD: gen_NKbb; AP: gen_ANMbb with K = M A),
    plus LD's scales scale_AK, shared by the heads (as the reference)."""
    block = settings["block_size"]
    scales = num_axes * (head_dim // block) if settings["variant"] == "ld" else 0
    return num_heads * head_dim * block + scales


FAMILY = family.Family(
    name=_FAMILY,
    kind="rotary",
    convention="unit_centred",
    relative=True,
    apply_defaults={"variant": "ld"},
    stored_count=_stored_count,
    examples=(
        ({"variant": "ld", "block_size": 4}, (1, 2, 3)),
        ({"variant": "ld", "block_size": 2}, (2,)),  # closed form, no fold
        ({"variant": "ap", "block_size": 2}, (1, 3)),
        ({"variant": "ap", "block_size": 6}, (2,)),
    ),
    # ComRoPE's axis-partition variant (pe=comrope is the linearly dependent one).
    variants={"comrope_ap": ({"variant": "ap"}, "unit_centred")},
)
APPLY_HPARAMS: tuple[str, ...] = tuple(FAMILY.apply_defaults)
_HIGHEST = jax.lax.Precision.HIGHEST


def _check_variant(variant) -> str:
    """``"ld"`` or ``"ap"``, in either case (the paper writes LD and AP)."""
    if not isinstance(variant, str) or variant.lower() not in VARIANTS:
        raise ValueError(
            f"{_FAMILY}: variant={variant!r}; expected one of {VARIANTS} (or upper case)"
        )
    return variant.lower()


def _bound_variant(params, variant) -> str:
    """The call's variant: init's for tagged parameters (``family.bound``), checked."""
    if variant is not family.INIT:
        variant = _check_variant(variant)
    return _check_variant(family.bound(params, _FAMILY, variant=variant)["variant"])


def _check_dims(head_dim: int, num_axes: int, block_size, variant: str) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise ValueError(f"{_FAMILY}: block_size={block_size!r} must be an even int")
    if block_size < 2 or block_size % 2:
        raise ValueError(f"{_FAMILY}: block_size={block_size} must be even and at least 2")
    divisor = block_size * (num_axes if variant == "ap" else 1)
    what = "num_axes*block_size" if variant == "ap" else "block_size"
    _checks.check_divisible(head_dim, divisor, what, _FAMILY)
    return int(block_size)


def init(
    key: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_axes: int,
    variant: str = "ld",
    block_size: int = 8,
    init_std: float = 1.0,
) -> dict[str, jax.Array]:
    """Random raw angle matrices as the reference draws them.

    Args:
      key: PRNG key.
      num_heads: N.
      head_dim: H, divisible by b (``"ap"``: by A b).
      num_axes: A.
      variant: ``"ld"`` or ``"ap"`` (module docstring).
      block_size: b, even.
      init_std: std of the raw P entries (1 in the reference); S = P - P^T.

    Returns:
      ``"ld"``: ``{"gen_NKbb": (N, K, b, b), "scale_AK": (A, K)}``, raw P per head and block
      (K = H / b) and the N(0, 1) scales shared by the heads; ``"ap"``: ``{"gen_ANMbb":
      (A, N, K / A, b, b)}``, the raw P of the blocks k = m A + a that axis a owns. float32.
    """
    _checks.check_shape_args(num_heads, head_dim, num_axes, _FAMILY)
    variant = _check_variant(variant)
    block = _check_dims(head_dim, num_axes, block_size, variant)
    if isinstance(init_std, bool) or not (
        isinstance(init_std, (int, float)) and np.isfinite(init_std) and init_std >= 0
    ):
        raise ValueError(f"{_FAMILY}: init_std={init_std!r} must be a finite number >= 0")
    key_gen, key_scale = jax.random.split(key)
    num_blocks = head_dim // block
    if variant == "ap":  # block k = m A + a of head n is gen_ANMbb[a, n, m]
        shape = (num_axes, num_heads, num_blocks // num_axes, block, block)
        arrays = {"gen_ANMbb": float(init_std) * jax.random.normal(key_gen, shape, jnp.float32)}
    else:
        shape = (num_heads, num_blocks, block, block)
        arrays = {
            "gen_NKbb": float(init_std) * jax.random.normal(key_gen, shape, jnp.float32),
            "scale_AK": jax.random.normal(key_scale, (num_axes, num_blocks), jnp.float32),
        }
    return family.params(
        _FAMILY,
        arrays,
        num_heads=num_heads,
        head_dim=head_dim,
        num_axes=num_axes,
        variant=variant,
        block_size=block,
        init_std=init_std,
    )


_KEYS = {"ld": ["gen_NKbb", "scale_AK"], "ap": ["gen_ANMbb"]}


def _checked(params: dict[str, jax.Array], variant: str) -> tuple[jax.Array, jax.Array | None]:
    """(raw P per head and block (N, K, b, b), LD's scale_AK or None); A is params' axis count."""
    if sorted(params) != _KEYS[variant]:
        raise ValueError(
            f"{_FAMILY}: variant={variant!r} expects params {_KEYS[variant]}, got {sorted(params)}"
        )
    gen = params[_KEYS[variant][0]]
    rank = 4 if variant == "ld" else 5
    if gen.ndim != rank or gen.shape[-1] != gen.shape[-2] or gen.shape[-1] % 2:
        raise ValueError(
            f"{_FAMILY}: params[{_KEYS[variant][0]!r}] has shape {tuple(gen.shape)}; expected "
            f"rank {rank} ending in (b, b), b even"
        )
    if variant == "ap":  # (A, N, M, b, b) -> (N, M A, b, b): block k = m A + a
        num_axes, num_heads, per_axis, block = gen.shape[:4]
        gen = jnp.transpose(gen, (1, 2, 0, 3, 4)).reshape(
            num_heads, per_axis * num_axes, block, block
        )
        return gen.astype(jnp.float32), None
    scale = params["scale_AK"]
    if scale.ndim != 2 or scale.shape[1] != gen.shape[1]:
        raise ValueError(
            f"{_FAMILY}: scale_AK has shape {tuple(scale.shape)}, expected (A, {gen.shape[1]})"
        )
    return gen.astype(jnp.float32), scale.astype(jnp.float32)


def _num_axes(params: dict[str, jax.Array], variant: str) -> int:
    return params["scale_AK" if variant == "ld" else "gen_ANMbb"].shape[0]


def _coefficients(scale_AK, pos, num_blocks: int, variant: str) -> jax.Array:
    """t(p) per token and block: sum_a p_a s[a, k] (LD) or p_(k mod A) (AP); (..., K)."""
    pos = pos.astype(jnp.float32)
    if variant == "ld":
        return jnp.einsum("...A,AK->...K", pos, scale_AK, precision=_HIGHEST)
    return pos[..., np.arange(num_blocks) % pos.shape[-1]]


def spectra(
    params: dict[str, jax.Array], *, variant: str = family.INIT
) -> tuple[jax.Array, jax.Array]:
    """The decomposition S_nk = Q diag([[0, -lambda_j], [lambda_j, 0]]) Q^T of every block.

    Args:
      params: from ``init``.
      variant: ``init``'s (read from its parameters; a plain dict: this argument, else "ld").

    Returns:
      (lambda_NKJ, q_NKbb): J = b/2 rotation rates per block (non-negative for b > 2; for
      b = 2, lambda = -s with Q = I) and the orthogonal Q whose columns (2j, 2j+1) span the
      plane turned at rate lambda_j; float32.
    """
    gen_NKbb, _ = _checked(params, _bound_variant(params, variant))
    return _spectra(gen_NKbb)


@jax.jit
def _spectra(gen_NKbb: jax.Array) -> tuple[jax.Array, jax.Array]:
    skew = gen_NKbb - jnp.swapaxes(gen_NKbb, -1, -2)
    block = skew.shape[-1]
    if block == 2:  # [[0, s], [-s, 0]] = [[0, -l], [l, 0]] with l = -s, Q = I
        q = jnp.broadcast_to(jnp.eye(2, dtype=jnp.float32), skew.shape)
        return -skew[..., 0, 1][..., None], q
    # Hermitian i S: eigenvalues +-lambda in ascending order; the top b/2 are lambda >= 0.
    lam, w = jnp.linalg.eigh(1j * skew.astype(jnp.complex64))
    lam, w = lam[..., block // 2 :], w[..., block // 2 :]
    q = jnp.sqrt(2.0) * jnp.stack([jnp.real(w), jnp.imag(w)], axis=-1)  # (..., b, J, 2)
    return lam.astype(jnp.float32), q.reshape(*skew.shape[:-1], block).astype(jnp.float32)


def precompute(
    params: dict[str, jax.Array],
    pos: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_prefix: int = 0,
    variant: str = family.INIT,
) -> state.PairAngles:
    """The pair angles t(p) lambda and the fold P = diag(Q^T) (module docstring).

    Args:
      params: from ``init``.
      pos: pos_TA or pos_BTA.
      num_heads: N of the parameters (1 when heads share them).
      head_dim: H = K b.
      num_prefix: prefix tokens (at position 0: R'(0) = P).
      variant: ``init``'s (read from its parameters; a plain dict: this argument, else "ld").

    Returns:
      ``PairAngles`` with angle (T, N, H/2) (or (B, T, N, H/2)) and mix_NHH (N, H, H), None
      for b = 2; float32.
    """
    variant = _bound_variant(params, variant)
    gen_NKbb, scale_AK = _checked(params, variant)
    _checks.check_state_args(num_heads, head_dim, num_prefix, _FAMILY)
    num_gen_heads, num_blocks, block = gen_NKbb.shape[:3]
    if num_gen_heads != num_heads or num_blocks * block != head_dim:
        raise ValueError(
            f"{_FAMILY}: num_heads={num_heads}, head_dim={head_dim} do not fit the parameters' "
            f"{num_gen_heads} heads of {num_blocks} blocks of size {block}"
        )
    pos = _checks.check_positions(pos, _FAMILY, _num_axes(params, variant))
    return _precompute(gen_NKbb, scale_AK, pos, variant)


@functools.partial(jax.jit, static_argnums=3)
def _precompute(gen_NKbb, scale_AK, pos, variant: str) -> state.PairAngles:
    num_blocks, block = gen_NKbb.shape[1:3]
    lam_NKJ, q_NKbb = _spectra(gen_NKbb)
    fold = None  # b = 2: Q = I
    if block > 2:
        q_t = jnp.swapaxes(q_NKbb, -1, -2)
        eye_KK = jnp.eye(num_blocks, dtype=jnp.float32)
        fold = jnp.einsum("NKij,KL->NKiLj", q_t, eye_KK, precision=_HIGHEST).reshape(
            gen_NKbb.shape[0], *(2 * (num_blocks * block,))
        )
    t_XK = _coefficients(scale_AK, pos, num_blocks, variant)
    lam_XNKJ = lam_NKJ.reshape((1,) * (t_XK.ndim - 1) + lam_NKJ.shape)
    angle = t_XK[..., None, :, None] * lam_XNKJ  # (..., N, K, J)
    return state.PairAngles(angle.reshape(*angle.shape[:-2], -1), mix_NHH=fold)


def apply(
    params: dict[str, jax.Array], x_BTNH: jax.Array, pos: jax.Array, *, variant: str = family.INIT
) -> jax.Array:
    """R'(p) x = Rot(t(p) lambda) P x: the fold, then the pair rotations.

    Args:
      params: from ``init``.
      x_BTNH: queries or keys, N and H = K b matching the parameters.
      pos: pos_TA or pos_BTA.
      variant: ``init``'s (read from its parameters; a plain dict: this argument, else "ld").

    Returns:
      (B, T, N, H) in x's dtype (P^T times it is expm(sum_a p_a A_a) x).
    """
    variant = _bound_variant(params, variant)
    gen_NKbb, scale_AK = _checked(params, variant)
    _checks.check_x(x_BTNH, _FAMILY)
    _checks.check_pos(pos, x_BTNH, _FAMILY, num_axes=_num_axes(params, variant))
    num_heads, num_blocks, block = gen_NKbb.shape[:3]
    _checks.check_heads(x_BTNH, num_heads, num_blocks * block, _FAMILY)
    pe = precompute(params, pos, num_heads=num_heads, head_dim=num_blocks * block, variant=variant)
    return pe.rotate(x_BTNH)  # the state applies its mix_NHH = P before the pair rotations


def generators(params: dict[str, jax.Array], *, variant: str = family.INIT) -> jax.Array:
    """The angle-matrix blocks B_ank of the module docstring, (A, N, K, b, b) float32."""
    variant = _bound_variant(params, variant)
    gen_NKbb, scale_AK = _checked(params, variant)
    num_axes = _num_axes(params, variant)
    skew = gen_NKbb - jnp.swapaxes(gen_NKbb, -1, -2)
    if variant == "ld":
        return scale_AK[:, None, :, None, None] * skew[None]
    mask_AK = np.arange(skew.shape[1])[None] % num_axes == np.arange(num_axes)[:, None]
    return jnp.asarray(mask_AK, jnp.float32)[:, None, :, None, None] * skew[None]


def rotations_expm(params: dict[str, jax.Array], pos: jax.Array, *, variant: str = family.INIT):
    """R(p) = expm(sum_a p_a A_a) block by block, one exponential per token (the reference's way).

    The slow path the fast one replaces (``expm_combination``, as LieRE's blocks).

    Args:
      params: from ``init``.
      pos: pos_TA or pos_BTA.
      variant: ``init``'s (read from its parameters; a plain dict: this argument, else "ld").

    Returns:
      r (T, N, K, b, b) (or (B, T, N, K, b, b)), float32.
    """
    variant = _bound_variant(params, variant)
    pos = _checks.check_positions(pos, _FAMILY, _num_axes(params, variant))
    gen_ANKbb = generators(params, variant=variant)
    num_axes, num_heads, num_blocks, block = gen_ANKbb.shape[:4]
    r = expm_combination.expm_skew_combination(
        pos.reshape(-1, num_axes).astype(jnp.float32),
        gen_ANKbb.reshape(num_axes, -1, block, block),
    )
    return r.reshape(*pos.shape[:-1], num_heads, num_blocks, block, block)
