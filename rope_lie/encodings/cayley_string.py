"""Cayley-STRING (Schenck et al., "Learning the RoPEs", arXiv:2502.02562) with sparse generators.

For a token at position p in R^A and each head,

    R(p) = RoPE(p) P,    P = (I - S)(I + S)^-1,    x' = RoPE(p) (P x),

with S a learned skew-symmetric H x H matrix per head (the Cayley transform makes P orthogonal)
and RoPE(p) RoPE-Mixed's learnable rotation (``rope_mixed``: angle_j = sum_a p_a f[a, n, j] on
interleaved pairs (2j, 2j+1)). P acts on the token *before* RoPE: after it, P would cancel in
q.k (P^T P = I). q.k = q^T P^T RoPE(p_k - p_q) P k depends on p_k - p_q only, in every
dimension. P does not depend on the position: it is computed once per head per step (never per
token; ``precompute`` returns it as ``mix_NHH`` of its state, beside the RoPE angles, and the
model shares it between layers that share parameters; the state's ``rotate`` applies it, and
``state.to_fold()`` leaves it to the caller), and can be folded into the q/k
projections with ``fold``, after which only ``rope_mixed.apply({"freqs_ANF":
params["freqs_ANF"]}, q, pos)`` is applied. The ViT folds it at every step: D N H^2 work per
layer instead of B T N H^2.

Generators (``generator=``; the sparse ones from the sparse Cayley-STRING study, Sec. 3.1-3.5):

- ``"dense"``: S = U - U^T, U the strict upper triangle of ``s_dense_NHH``; one solve per head.
- ``"block2x2"``: S = diag of [[0, a_i], [-a_i, 0]] on H/2 planes, P in closed form (no solve,
  elementwise): P_i = [[1 - a^2, -2a], [2a, 1 - a^2]] / (1 + a^2). The planes are the
  *half-split* pairs (j, j + H/2), j < H/2, not RoPE's pairs (2j, 2j+1): a rotation within a
  RoPE pair commutes with RoPE's rotation of that pair and would cancel in q.k. The half-split
  planes cover every channel and never coincide with a RoPE pair for H >= 4 (H = 2 is refused).
- ``"banded"``: S_ij = 0 for |i - j| > bandwidth; ``s_banded_NWH[n, d-1, i] = A_{i, i+d}``
  (entries with i + d >= H unused), S = A - A^T.
- ``"topk"``: the k largest |A_ij| off the diagonal of ``s_topk_NHH`` are kept (mask from
  ``lax.top_k``, no gradient through the selection), the mask is symmetrised (M | M^T) and
  S = A*M - (A*M)^T; ``k`` is needed by ``apply`` too.

The generator is read from the single ``s_*`` key present in the params. S starts at 0 (R =
RoPE exactly) unless ``init_std > 0`` (entries N(0, init_std)); "topk" requires
``init_std > 0`` (from S = 0 the selection would keep the first k entries forever).

Conventions: interleaved RoPE pairs, rotation multiplies from the left, axis order of ``pos`` =
array order of the input. Prefix (class) tokens at position 0 get R(0) = P (RoPE's identity
times P: P is part of the learned projection, not of the position). Solves and rotations in
float32; the output has x's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rope_lie.encodings import _checks, family, lie, rope_mixed, state

_FAMILY = "cayley_string"

GENERATORS = ("dense", "block2x2", "banded", "topk")
_KEYS = {
    "dense": "s_dense_NHH",
    "block2x2": "s_block2x2_NF",
    "banded": "s_banded_NWH",
    "topk": "s_topk_NHH",
}


def _stored_count(num_heads: int, head_dim: int, num_axes: int, settings) -> int:
    """freqs_ANF (A, N, H/2) plus one generator: s_dense_NHH and s_topk_NHH (N, H, H) (of which
    H(H-1)/2 are used), s_block2x2_NF (N, H/2), s_banded_NWH (N, bandwidth, H)."""
    s_per_head = {
        "dense": head_dim * head_dim,
        "block2x2": head_dim // 2,
        "banded": (settings["bandwidth"] or 0) * head_dim,
        "topk": head_dim * head_dim,
    }[settings["generator"]]
    return num_heads * (num_axes * (head_dim // 2) + s_per_head)


FAMILY = family.Family(
    name=_FAMILY,
    kind="rotary",
    convention="integer",
    relative=True,
    # Top-k needs k to build its mask at apply time; every other setting is in the shapes.
    apply_defaults={"k": None},
    stored_count=_stored_count,
    examples=(  # init_std > 0: S != 0, so P is not the identity
        ({"generator": "dense", "init_std": 0.1}, (1, 2, 3)),
        ({"generator": "block2x2", "init_std": 0.1}, (1, 2, 3)),
        ({"generator": "banded", "bandwidth": 2, "init_std": 0.1}, (2,)),
        ({"generator": "topk", "k": 6, "init_std": 0.1}, (2,)),
    ),
)
APPLY_HPARAMS: tuple[str, ...] = tuple(FAMILY.apply_defaults)


def _check_k(k, head_dim: int) -> int:
    """k must be an int in [1, H(H-1)] (the number of off-diagonal entries)."""
    if (
        isinstance(k, bool)
        or not isinstance(k, (int, np.integer))
        or not (1 <= k <= head_dim * (head_dim - 1))
    ):
        raise ValueError(
            f"{_FAMILY}: k={k!r} must be an int in [1, H*(H-1)={head_dim * (head_dim - 1)}] "
            f"(head_dim={head_dim}) for generator='topk'"
        )
    return int(k)


def _check_hparams(generator, head_dim: int, bandwidth, k, init_std) -> None:
    if generator not in GENERATORS:
        raise ValueError(
            f"{_FAMILY}: unknown generator={generator!r}; expected one of {', '.join(GENERATORS)}"
        )
    if generator == "block2x2" and head_dim < 4:
        raise ValueError(
            f"{_FAMILY}: generator='block2x2' needs head_dim >= 4, got head_dim={head_dim}: its "
            "plane (0, 1) would be RoPE's pair and P would cancel in q.k"
        )
    if generator == "banded":
        if (
            isinstance(bandwidth, bool)
            or not isinstance(bandwidth, (int, np.integer))
            or not (1 <= bandwidth <= head_dim - 1)
        ):
            raise ValueError(
                f"{_FAMILY}: bandwidth={bandwidth!r} must be an int in [1, head_dim - 1="
                f"{head_dim - 1}] for generator='banded'"
            )
    elif bandwidth is not None:
        raise ValueError(
            f"{_FAMILY}: bandwidth={bandwidth!r} is only used by generator='banded', "
            f"got generator={generator!r}"
        )
    if generator == "topk":
        _check_k(k, head_dim)
    elif k is not None:
        raise ValueError(
            f"{_FAMILY}: k={k!r} is only used by generator='topk', got generator={generator!r}"
        )
    _checks.check_real(init_std, "init_std", _FAMILY)
    if generator == "topk" and init_std == 0:
        raise ValueError(
            f"{_FAMILY}: generator='topk' needs init_std > 0, got init_std={init_std!r}: from "
            "S = 0 every |S_ij| ties, top_k keeps the first k entries, and no gradient ever "
            "reaches the others, so the selection would never change"
        )


def init(
    key: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_axes: int,
    generator: str = "dense",
    base: float = 10.0,
    init_std: float = 0.0,
    bandwidth: int | None = None,
    k: int | None = None,
) -> dict[str, jax.Array]:
    """RoPE-Mixed frequencies plus a generator for P (zero by default: P = I).

    Args:
      key: PRNG key; the frequencies are ``rope_mixed.init`` of the first half of split(key).
      num_heads: N, heads.
      head_dim: H, channels per head (even: RoPE rotates pairs).
      num_axes: A, position axes.
      generator: one of ``GENERATORS``: "dense", "block2x2", "banded", "topk".
      base: RoPE-Mixed's frequency magnitude base.
      init_std: standard deviation of the normal init of the generator entries (0: S = 0;
        must be > 0 for "topk").
      bandwidth: b in [1, H - 1], for generator="banded" only.
      k: kept entries in [1, H(H-1)], for generator="topk" only (pass it to ``apply`` too).

    Returns:
      {"freqs_ANF": (A, N, H/2)} and one of {"s_dense_NHH": (N, H, H)},
      {"s_block2x2_NF": (N, H/2)}, {"s_banded_NWH": (N, W, H)} (W = bandwidth),
      {"s_topk_NHH": (N, H, H)}; all float32.
    """
    _checks.check_shape_args(num_heads, head_dim, num_axes, _FAMILY)
    _checks.check_divisible(head_dim, 2, "2", _FAMILY)  # RoPE pairs
    _check_hparams(generator, head_dim, bandwidth, k, init_std)
    key_freqs, key_s = jax.random.split(key)
    params = rope_mixed.init(
        key_freqs, num_heads=num_heads, head_dim=head_dim, num_axes=num_axes, base=base
    )
    shape = {
        "dense": (num_heads, head_dim, head_dim),
        "block2x2": (num_heads, head_dim // 2),
        "banded": (num_heads, bandwidth, head_dim),
        "topk": (num_heads, head_dim, head_dim),
    }[generator]
    if init_std == 0:  # the default: R = RoPE exactly, no draw needed
        s = jnp.zeros(shape, jnp.float32)
    else:
        s = float(init_std) * jax.random.normal(key_s, shape, jnp.float32)
    if generator == "banded":
        s = s * jnp.asarray(_band_valid(bandwidth, head_dim), jnp.float32)[None]  # unused: 0
    return family.params(
        _FAMILY,
        {"freqs_ANF": params["freqs_ANF"], _KEYS[generator]: s},
        num_heads=num_heads,
        head_dim=head_dim,
        num_axes=num_axes,
        generator=generator,
        base=base,
        init_std=init_std,
        bandwidth=bandwidth,
        k=k,
    )


def generator_kind(params: dict[str, jax.Array]) -> str:
    """The generator ("dense", "block2x2", "banded" or "topk") of the single ``s_*`` key."""
    family.bound(params, _FAMILY)  # tagged parameters of another family are an error
    kinds = [name for name, key in _KEYS.items() if key in params]
    if len(kinds) != 1:
        raise ValueError(
            f"{_FAMILY}: params must hold exactly one of {', '.join(_KEYS.values())}, "
            f"got keys {sorted(params)}"
        )
    _checks.param(params, "freqs_ANF", _FAMILY)
    _checks.check_keys(params, ["freqs_ANF", _KEYS[kinds[0]]], _FAMILY)
    return kinds[0]


def _band_valid(bandwidth: int, head_dim: int) -> np.ndarray:
    """(b, H) mask: entry [d-1, i] stands for A_{i, i+d} and exists when i + d < H."""
    d = np.arange(1, bandwidth + 1)[:, None]
    return np.arange(head_dim)[None, :] + d < head_dim


def _banded_upper(s_NWH: jax.Array) -> jax.Array:
    """A with A_{i, i+d} = s[:, d-1, i] for 1 <= d <= b, zero elsewhere, (N, H, H)."""
    bandwidth, head_dim = s_NWH.shape[-2:]
    d_idx, rows = np.nonzero(_band_valid(bandwidth, head_dim))
    upper = jnp.zeros((s_NWH.shape[0], head_dim, head_dim), jnp.float32)
    return upper.at[:, rows, rows + d_idx + 1].set(s_NWH[:, d_idx, rows])


def _topk_masked(a_NHH: jax.Array, k: int) -> jax.Array:
    """A*M with M the symmetrised mask of the k largest off-diagonal |A_ij|."""
    num_heads, head_dim = a_NHH.shape[:2]
    k = _check_k(k, head_dim)
    # The diagonal scores -1 < 0 <= |A_ij|, so it is never selected while k <= H(H-1).
    score = jnp.where(jnp.eye(head_dim, dtype=bool), -1.0, jnp.abs(a_NHH))
    _, idx_Nk = jax.lax.top_k(jax.lax.stop_gradient(score).reshape(num_heads, -1), k)
    mask = jnp.zeros((num_heads, head_dim * head_dim), bool)
    mask = mask.at[jnp.arange(num_heads)[:, None], idx_Nk].set(True).reshape(a_NHH.shape)
    return jnp.where(mask | jnp.swapaxes(mask, -1, -2), a_NHH, 0.0)


def _block2x2_skew(a_NF: jax.Array) -> jax.Array:
    """Dense S with S[j, j + H/2] = a_j = -S[j + H/2, j] (the half-split planes), (N, H, H)."""
    half = a_NF.shape[-1]
    j = np.arange(half)
    upper = jnp.zeros((a_NF.shape[0], 2 * half, 2 * half), jnp.float32)
    upper = upper.at[:, j, j + half].set(a_NF)
    return upper - jnp.swapaxes(upper, -1, -2)


def _check_generator_shape(params, kind: str, num_heads: int, head_dim: int) -> None:
    """The generator's shape must match the frequencies' (N, H)."""
    shape = tuple(params[_KEYS[kind]].shape)
    expected = {
        "dense": shape == (num_heads, head_dim, head_dim),
        "topk": shape == (num_heads, head_dim, head_dim),
        "block2x2": shape == (num_heads, head_dim // 2) and head_dim >= 4,
        "banded": len(shape) == 3
        and shape[0] == num_heads
        and 1 <= shape[1] < head_dim
        and shape[2] == head_dim,
    }[kind]
    if not expected:
        raise ValueError(
            f"{_FAMILY}: {_KEYS[kind]} has shape {shape}, which does not fit num_heads="
            f"{num_heads}, head_dim={head_dim} (from freqs_ANF)"
        )


def _bound_k(params, kind: str, k):
    """k of the call: init's for tagged parameters (``family.bound``), checked for the kind."""
    (k,) = family.bound(params, _FAMILY, k=k).values()
    _check_apply_k(kind, k)
    return k


def _check_apply_k(kind: str, k) -> None:
    if kind == "topk" and k is None:
        raise ValueError(
            f"{_FAMILY}: params hold a top-k generator (s_topk_NHH): pass k=... (the k of init)"
        )
    if kind != "topk" and k is not None:
        raise ValueError(
            f"{_FAMILY}: k={k!r} is only used by the top-k generator, params hold "
            f"generator={kind!r}"
        )


def generator(params: dict[str, jax.Array], *, k: int | None = family.INIT) -> jax.Array:
    """The skew-symmetric generator S per head.

    Args:
      params: from ``init``; the generator is read from its ``s_*`` key.
      k: the top-k count, for top-k params only (``init``'s, read from its parameters).

    Returns:
      s_NHH float32, skew-symmetric (dense; for block2x2 the half-split planes).
    """
    kind = generator_kind(params)
    k = _bound_k(params, kind, k)
    raw = params[_KEYS[kind]].astype(jnp.float32)
    if kind == "dense":
        return lie.skew_from_upper(raw)
    if kind == "block2x2":
        return _block2x2_skew(raw)
    a_NHH = _banded_upper(raw) if kind == "banded" else _topk_masked(raw, k)
    return a_NHH - jnp.swapaxes(a_NHH, -1, -2)


def _block2x2_cos_sin(a_NF: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Closed-form Cayley of [[0, a], [-a, 0]]: [[c, -s], [s, c]] (Eq. 12 of the sparse study).

    c = (1 - a^2) / (1 + a^2), s = 2a / (1 + a^2).
    """
    a = a_NF.astype(jnp.float32)
    denom = 1.0 + a * a
    return (1.0 - a * a) / denom, 2.0 * a / denom


def orthogonal(params: dict[str, jax.Array], *, k: int | None = family.INIT) -> jax.Array:
    """The orthogonal P = (I - S)(I + S)^-1 per head (to fold into q/k projections).

    Args:
      params: from ``init``.
      k: the top-k count, for top-k params only (``init``'s, read from its parameters).

    Returns:
      p_NHH float32 orthogonal matrices (block2x2: closed form, no solve).
    """
    kind = generator_kind(params)
    k = _bound_k(params, kind, k)
    if kind != "block2x2":
        return lie.cayley(generator(params, k=k))
    cos_NF, sin_NF = _block2x2_cos_sin(params[_KEYS[kind]])
    half = cos_NF.shape[-1]
    j = np.arange(half)
    p = jnp.zeros((cos_NF.shape[0], 2 * half, 2 * half), jnp.float32)
    p = p.at[:, j, j].set(cos_NF).at[:, j + half, j + half].set(cos_NF)
    return p.at[:, j, j + half].set(-sin_NF).at[:, j + half, j].set(sin_NF)


def fold(
    params: dict[str, jax.Array], w_DNH: jax.Array, *, k: int | None = family.INIT
) -> jax.Array:
    """Fold P into a q or k projection: x @ fold(w) == P (x @ w), per head.

    Afterwards apply only the RoPE part:
    ``rope_mixed.apply({"freqs_ANF": params["freqs_ANF"]}, x_BTD @ fold(params, w_DNH), pos)``.

    Args:
      params: from ``init``.
      w_DNH: projection weights, q_BTNH = einsum("BTD,DNH->BTNH", x_BTD, w_DNH).
      k: the top-k count, for top-k params only (``init``'s, read from its parameters).

    Returns:
      (D, N, H) folded weights in w's dtype (computed in float32).
    """
    p_NHH = orthogonal(params, k=k)
    folded = jnp.einsum(
        "nij,dnj->dni", p_NHH, w_DNH.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    return folded.astype(w_DNH.dtype)


def precompute(
    params: dict[str, jax.Array],
    pos: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    num_prefix: int = 0,
    k: int | None = family.INIT,
) -> state.PairAngles:
    """The encoder state (``encodings/state.py``): the RoPE angles and P.

    ``state.rotate(x)`` equals ``apply(params, x, pos)`` (P included). The model takes
    ``state.to_fold()`` instead, whose ``rotate(x @ fold(w))`` equals the same: folding P into
    the q/k weights costs D N H^2 per layer and step instead of B T N H^2 for applying it to
    every token, and the gradient reaches S through the folded weights (the model does this at
    every step, not only for export). P (one Cayley solve per head, none for block2x2) is computed
    once per step and shared by every layer that shares the parameters.

    Args:
      params: from ``init``.
      pos: pos_TA or pos_BTA.
      num_heads: N of the parameters (1 when heads share them).
      head_dim: H of the parameters.
      num_prefix: prefix tokens (at position 0: R(0) = P).
      k: the top-k count, for top-k params only (``init``'s, read from its parameters).

    Returns:
      ``PairAngles`` with the RoPE-Mixed angles (T, N, H/2) (B, T, N, H/2 for pos_BTA) and
      ``mix_NHH`` = P (N, H, H), dense for every generator; float32.
    """
    _checks.check_state_args(num_heads, head_dim, num_prefix, _FAMILY)
    k = _check_generator(params, pos, k, num_heads=num_heads, head_dim=head_dim)
    return _rope(params, pos, num_heads, head_dim)._replace(mix_NHH=orthogonal(params, k=k))


def _check_generator(params, pos, k, *, num_heads: int, head_dim: int):
    """The generator against (k, N, H), and the positions' axes against the frequencies'.

    Returns:
      the call's k (``_bound_k``).
    """
    kind = generator_kind(params)
    k = _bound_k(params, kind, k)
    _check_generator_shape(params, kind, num_heads, head_dim)
    _checks.check_positions(pos, _FAMILY, _checks.param(params, "freqs_ANF", _FAMILY).shape[0])
    return k


def _rope(params, pos, num_heads: int, head_dim: int) -> state.PairAngles:
    """The RoPE part of R(p): RoPE-Mixed's angles of ``freqs_ANF``."""
    freqs = {"freqs_ANF": params["freqs_ANF"]}
    return rope_mixed.precompute(freqs, pos, num_heads=num_heads, head_dim=head_dim)


def _mix(params: dict[str, jax.Array], x_BTNH: jax.Array, k: int | None) -> jax.Array:
    """P x for every token, float32 (block2x2: elementwise on the half-split planes)."""
    x32 = x_BTNH.astype(jnp.float32)
    kind = generator_kind(params)
    if kind == "block2x2":
        cos_NF, sin_NF = _block2x2_cos_sin(params[_KEYS[kind]])
        cos_NF, sin_NF = cos_NF[None, None], sin_NF[None, None]  # (1, 1, N, F)
        half = cos_NF.shape[-1]
        u, v = x32[..., :half], x32[..., half:]
        return jnp.concatenate([cos_NF * u - sin_NF * v, sin_NF * u + cos_NF * v], axis=-1)
    return jnp.einsum(
        "nij,btnj->btni", orthogonal(params, k=k), x32, precision=jax.lax.Precision.HIGHEST
    )


def apply(
    params: dict[str, jax.Array], x_BTNH: jax.Array, pos: jax.Array, *, k: int | None = family.INIT
) -> jax.Array:
    """Encode queries or keys: x'_t = RoPE(p_t) P x_t.

    Args:
      params: from ``init``: {"freqs_ANF": (A, N, F)} and one ``s_*`` generator.
      x_BTNH: queries or keys, any float dtype, H = 2F.
      pos: pos_TA (RoPE angles computed once, shared by the batch) or pos_BTA (per example).
      k: the top-k count, for top-k params only (``init``'s, read from its parameters; a plain
        dict of top-k parameters needs it).

    Returns:
      (B, T, N, H) array in x's dtype.
    """
    num_axes, num_heads, num_pairs = _checks.param(params, "freqs_ANF", _FAMILY).shape
    _checks.check_x(x_BTNH, _FAMILY)
    _checks.check_heads(x_BTNH, num_heads, 2 * num_pairs, _FAMILY)
    _checks.check_pos(pos, x_BTNH, _FAMILY, num_axes=num_axes)
    k = _check_generator(params, pos, k, num_heads=num_heads, head_dim=2 * num_pairs)
    rope = _rope(params, pos, num_heads, 2 * num_pairs)
    return rope.rotate(_mix(params, x_BTNH, k)).astype(x_BTNH.dtype)
