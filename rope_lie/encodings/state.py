"""Encoder states: what a family computes once per step from its parameters and positions.

Every family in ``ROTARY`` and ``BIAS`` provides

    precompute(params, pos, *, num_heads, head_dim, num_prefix, **APPLY_HPARAMS) -> State

and the attention uses the state in one way, whatever the family:

    state    <- state.to_fold()                        (P left to fold, when there is one)
    w_q, w_k <- fold of ``state.fold_NHH`` into them   (when not None: P (x w + b))
    q, k     <- state.rotate(q), state.rotate(k)       (per token)
    logits   += state.bias_BNTS                        (when not None)

A family's own state is complete: ``precompute(...).rotate(x)`` equals ``apply(params, x, pos)``
for every family (Cayley-STRING's ``PairAngles`` applies its P, ``mix_NHH``). Only the state of
``to_fold()``, ``PairAnglesAfterFold``, leaves P to the caller, and its name says so.

The states are typed by what the families compute (a family's table is in
``docs/encoders.md``): pair angles (RoPE and its variants, LieRE with 2x2 blocks, Cayley-STRING
with its P), block rotations (LieRE), spectral phases (Circulant-STRING), a logit bias
(ALiBi), or nothing (NoPE); ``ScaledQK`` wraps any of them with a factor on q and k (the
extrapolation tools' temperature). Each is a NamedTuple, so a state is a pytree: it crosses ``jit``,
is cached per resolution at evaluation, and is shared by every layer that shares the parameters.
A state computed for one head (heads sharing parameters, N = 1) applies to every head; per-
example positions (``pos_BTA``) give states with a leading batch axis.

``rotate`` takes x of shape (B, T, N, H) with the state's T, its B (a per-example state), its
N (or any N for a state of one head) and an H it was computed for (the channels its pairs or
blocks turn, plus fewer than one pair or block more: LieRE's ``partial_blocks``, an odd H for
Circulant-STRING); any other x is an error naming both shapes, never broadcast against the
state.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rope_lie.encodings import lie


def _check_fits(
    x_BTNH: jax.Array, table: jax.Array, trailing: int, channels: range, name: str
) -> None:
    """x must be (B, T, N, H) with the T, B and N of ``table`` (shaped (T, N, ...) or
    (B, T, N, ...) before its ``trailing`` axes; N = 1 fits any N) and H in ``channels``."""
    lead = table.shape[: table.ndim - trailing]
    if x_BTNH.ndim == 4 and len(lead) in (2, 3):
        *batch, tokens, heads = lead
        num_batch, num_tokens, num_heads, head_dim = x_BTNH.shape
        if (
            num_tokens == tokens
            and heads in (1, num_heads)
            and (not batch or batch[0] == num_batch)
            and head_dim in channels
        ):
            return
    for_shape = (
        (f"B={lead[0]}, " if len(lead) == 3 else "any B, ")
        + f"T={lead[-2]}, N={lead[-1]}"
        + (" (or any N)" if lead[-1] == 1 else "")
    )
    width = (
        f"H={channels.start}"
        if len(channels) == 1
        else f"H from {channels.start} to {channels.stop - 1}"
    )
    raise ValueError(
        f"{name}.rotate: x has shape {tuple(x_BTNH.shape)}, but this state was computed for x "
        f"of shape (B, T, N, H) with {for_shape}, {width}"
    )


class Unrotated(NamedTuple):
    """No position encoding of q and k (NoPE): ``rotate`` is the identity."""

    fold_NHH = None
    bias_BNTS = None

    def rotate(self, x_BTNH: jax.Array) -> jax.Array:
        return x_BTNH

    def to_fold(self):
        """This state: it leaves nothing to fold into the q/k projections."""
        return self


class PairAngles(NamedTuple):
    """Interleaved channel pairs (2j, 2j+1) of head n turned by ``angle_TNF[t, n, j]``, after
    the position-independent ``mix_NHH`` when it is set (Cayley-STRING's P).

    ``angle_TNF`` is (T, N, F) or per example (B, T, N, F), float32; N = 1 for all heads;
    channels past 2F are not rotated. ``rotate`` is the whole encoding, ``R(p) P x``: what the
    family's ``apply`` computes. The model folds P into the q/k projections instead of applying
    it to every token: ``to_fold()`` gives that state (``PairAnglesAfterFold``).
    """

    angle_TNF: jax.Array
    mix_NHH: jax.Array | None = None  # P (N, H, H), applied before the rotation
    fold_NHH = None
    bias_BNTS = None

    def rotate(self, x_BTNH: jax.Array) -> jax.Array:
        pairs = 2 * self.angle_TNF.shape[-1]
        if self.mix_NHH is None:
            _check_fits(x_BTNH, self.angle_TNF, 1, range(pairs, pairs + 2), "PairAngles")
            return lie.rotate_pairs(x_BTNH, self.angle_TNF)
        width = self.mix_NHH.shape[-1]
        _check_fits(x_BTNH, self.angle_TNF, 1, range(width, width + 1), "PairAngles")
        mixed = jnp.matmul(
            self.mix_NHH.astype(jnp.float32),
            x_BTNH.astype(jnp.float32)[..., None],
            precision=jax.lax.Precision.HIGHEST,
        )[..., 0]
        return lie.rotate_pairs(mixed, self.angle_TNF).astype(x_BTNH.dtype)

    def to_fold(self) -> PairAngles | PairAnglesAfterFold:
        """This encoding with P left to the caller, who folds it into the q/k projections."""
        if self.mix_NHH is None:
            return self
        return PairAnglesAfterFold(self.angle_TNF, self.mix_NHH)


class PairAnglesAfterFold(NamedTuple):
    """``PairAngles`` whose P (``fold_NHH``) the caller folds into the q/k projections:
    ``rotate`` turns the pairs only and does *not* apply ``fold_NHH`` (as its name says).

    The attention's state for Cayley-STRING (``PairAngles.to_fold``): ``rotate(x @ fold(w))``
    equals ``PairAngles.rotate(x @ w)``, with P folded into the weights once per step (D N H^2)
    instead of applied to every token (B T N H^2).
    """

    angle_TNF: jax.Array
    fold_NHH: jax.Array  # P (N, H, H), to fold into the q/k projections
    bias_BNTS = None

    def rotate(self, x_BTNH: jax.Array) -> jax.Array:
        width = self.fold_NHH.shape[-1]
        _check_fits(x_BTNH, self.angle_TNF, 1, range(width, width + 1), "PairAnglesAfterFold")
        return lie.rotate_pairs(x_BTNH, self.angle_TNF)

    def to_fold(self):
        """This state: it leaves nothing to fold into the q/k projections."""
        return self


class BlockRotations(NamedTuple):
    """Contiguous b x b channel blocks [r b, (r + 1) b) of head n multiplied by ``r_TNKbb``.

    ``r_TNKbb`` is (T, N, K, b, b) or per example (B, T, N, K, b, b), float32; N = 1 for all
    heads; channels past K b are not rotated.
    """

    r_TNKbb: jax.Array
    fold_NHH = None
    bias_BNTS = None

    def rotate(self, x_BTNH: jax.Array) -> jax.Array:
        num_blocks, block = self.r_TNKbb.shape[-3], self.r_TNKbb.shape[-1]
        used = num_blocks * block
        _check_fits(x_BTNH, self.r_TNKbb, 3, range(used, used + block), "BlockRotations")
        return lie.apply_blocks(x_BTNH, self.r_TNKbb)

    def to_fold(self):
        """This state: it leaves nothing to fold into the q/k projections."""
        return self


class SpectralPhases(NamedTuple):
    """A rotation diagonal in the Fourier basis: ``irfft(rfft(x) * phase_TNJ)`` over channels.

    ``phase_TNJ`` is (T, N, H // 2 + 1) complex64 of unit modulus, or per example
    (B, T, N, H // 2 + 1); N = 1 for all heads. Hermitian multipliers keep x real.
    """

    phase_TNJ: jax.Array
    fold_NHH = None
    bias_BNTS = None

    def rotate(self, x_BTNH: jax.Array) -> jax.Array:
        even = 2 * (self.phase_TNJ.shape[-1] - 1)  # H // 2 + 1 bins: H is even or one more
        _check_fits(x_BTNH, self.phase_TNJ, 1, range(even, even + 2), "SpectralPhases")
        return lie.rotate_spectral(x_BTNH, self.phase_TNJ)

    def to_fold(self):
        """This state: it leaves nothing to fold into the q/k projections."""
        return self


class LogitBias(NamedTuple):
    """A bias added to the attention logits (ALiBi); q and k are not rotated.

    ``bias_BNTS`` is (1, N, T, S) for positions shared by the batch or (B, N, T, S) per example,
    float32; N = 1 broadcasts over the heads.
    """

    bias_BNTS: jax.Array
    fold_NHH = None

    def rotate(self, x_BTNH: jax.Array) -> jax.Array:
        return x_BTNH

    def to_fold(self):
        """This state: it leaves nothing to fold into the q/k projections."""
        return self


class ScaledQK(NamedTuple):
    """Another state whose ``rotate`` is followed by a product with ``qk_scale``: q and k each
    times c, so the logits q.k / sqrt(H) times c^2 (and ``bias_BNTS``, when the state has one,
    times c^2 too: every logit is scaled).

    What the extrapolation tools put around a family's state at an evaluation grid
    (``encodings/extrapolation.py``): YaRN's attention factor, which HuggingFace multiplies into
    cos and sin (so into q and k), and logit scaling with the token count. The family's own
    state is ``state``; a P to fold stays ``state``'s (``fold_NHH``), since the factor commutes
    with it.
    """

    state: State  # the family's own
    qk_scale: jax.Array  # float32 scalar c

    @property
    def fold_NHH(self):
        return self.state.fold_NHH

    @property
    def bias_BNTS(self):
        bias = self.state.bias_BNTS
        return None if bias is None else bias * jnp.square(self.qk_scale).astype(bias.dtype)

    def rotate(self, x_BTNH: jax.Array) -> jax.Array:
        rotated = self.state.rotate(x_BTNH)
        return (rotated.astype(jnp.float32) * self.qk_scale).astype(rotated.dtype)

    def to_fold(self) -> ScaledQK:
        """The same scale around the inner state's ``to_fold()``."""
        return ScaledQK(self.state.to_fold(), self.qk_scale)


State = (
    Unrotated
    | PairAngles
    | PairAnglesAfterFold
    | BlockRotations
    | SpectralPhases
    | LogitBias
    | ScaledQK
)
