"""Encoder states: what a family computes once per step from its parameters and positions.

Every family in ``ROTARY`` and ``BIAS`` provides

    precompute(params, pos, *, num_heads, head_dim, num_prefix, **APPLY_HPARAMS) -> State

and the attention uses the state in one way, whatever the family:

    w_q, w_k <- fold of ``state.fold_NHH`` into them   (when not None: P (x w + b))
    q, k     <- state.rotate(q), state.rotate(k)       (per token)
    logits   += state.bias_BNTS                        (when not None)

The states are typed by what the families compute (a family's table is in
``docs/encoders.md``): pair angles (RoPE and its variants, LieRE with 2x2 blocks, Cayley-STRING
with its P to fold), block rotations (LieRE), spectral phases (Circulant-STRING), a logit bias
(ALiBi), or nothing (NoPE). Each is a NamedTuple, so a state is a pytree: it crosses ``jit``,
is cached per resolution at evaluation, and is shared by every layer that shares the parameters.
A state computed for one head (heads sharing parameters, N = 1) applies to every head; per-
example positions (``pos_BTA``) give states with a leading batch axis.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rope_lie.encodings import lie


class Unrotated(NamedTuple):
    """No position encoding of q and k (NoPE): ``rotate`` is the identity."""

    fold_NHH = None
    bias_BNTS = None

    def rotate(self, x_BTNH: jax.Array) -> jax.Array:
        return x_BTNH


class PairAngles(NamedTuple):
    """Interleaved channel pairs (2j, 2j+1) of head n turned by ``angle_TNF[t, n, j]``.

    ``angle_TNF`` is (T, N, F) or per example (B, T, N, F), float32; N = 1 for all heads;
    channels past 2F are not rotated. ``fold_NHH`` (Cayley-STRING's P, applied before the
    rotation) is folded into the projections by the caller: ``rotate`` does not apply it.
    """

    angle_TNF: jax.Array
    fold_NHH: jax.Array | None = None
    bias_BNTS = None

    def rotate(self, x_BTNH: jax.Array) -> jax.Array:
        return lie.rotate_pairs(x_BTNH, self.angle_TNF)


class BlockRotations(NamedTuple):
    """Contiguous b x b channel blocks [r b, (r + 1) b) of head n multiplied by ``r_TNKbb``.

    ``r_TNKbb`` is (T, N, K, b, b) or per example (B, T, N, K, b, b), float32; N = 1 for all
    heads; channels past K b are not rotated.
    """

    r_TNKbb: jax.Array
    fold_NHH = None
    bias_BNTS = None

    def rotate(self, x_BTNH: jax.Array) -> jax.Array:
        return lie.apply_blocks(x_BTNH, self.r_TNKbb)


class SpectralPhases(NamedTuple):
    """A rotation diagonal in the Fourier basis: ``irfft(rfft(x) * phase_TNJ)`` over channels.

    ``phase_TNJ`` is (T, N, H // 2 + 1) complex64 of unit modulus, or per example
    (B, T, N, H // 2 + 1); N = 1 for all heads. Hermitian multipliers keep x real.
    """

    phase_TNJ: jax.Array
    fold_NHH = None
    bias_BNTS = None

    def rotate(self, x_BTNH: jax.Array) -> jax.Array:
        head_dim = x_BTNH.shape[-1]
        spectrum_BTNJ = jnp.fft.rfft(x_BTNH.astype(jnp.float32), axis=-1)
        phase = jnp.expand_dims(self.phase_TNJ, tuple(range(4 - self.phase_TNJ.ndim)))
        out_BTNH = jnp.fft.irfft(spectrum_BTNJ * phase, n=head_dim, axis=-1)
        return out_BTNH.astype(x_BTNH.dtype)


class LogitBias(NamedTuple):
    """A bias added to the attention logits (ALiBi); q and k are not rotated.

    ``bias_BNTS`` is (1, N, T, S) for positions shared by the batch or (B, N, T, S) per example,
    float32; N = 1 broadcasts over the heads.
    """

    bias_BNTS: jax.Array
    fold_NHH = None

    def rotate(self, x_BTNH: jax.Array) -> jax.Array:
        return x_BTNH


State = Unrotated | PairAngles | BlockRotations | SpectralPhases | LogitBias
