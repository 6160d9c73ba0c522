"""Float64 numpy references and random inputs shared by the encoder tests.

Each reference is written from the paper's formula (RoFormer arXiv:2104.09864, RoPE-Mixed
arXiv:2403.13298, VisionLlama arXiv:2403.00522), independently of the code it checks: loops
where the code vectorises, complex numbers where the code uses cos/sin pairs.
"""

import jax.numpy as jnp
import numpy as np


def normal(shape, seed: int = 0, dtype=jnp.float32) -> jnp.ndarray:
    """Standard normal values of `shape` from numpy's generator `seed`, cast to `dtype`."""
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def random_skew(rng: np.random.Generator, batch: int, h: int, norm: float) -> np.ndarray:
    """(batch, h, h) float64 skew-symmetric matrices of Frobenius norm `norm`."""
    w = rng.normal(size=(batch, h, h))
    a = w - np.swapaxes(w, -1, -2)
    return a / np.linalg.norm(a, axis=(-2, -1), keepdims=True) * norm


def expm_skew64(a_ZHH) -> np.ndarray:
    """exp(A) of skew-symmetric matrices in float64: i A is Hermitian, so exp(A) = V e^(-i L) V^H
    from its eigendecomposition (numpy only: the device image has no scipy)."""
    lam, v = np.linalg.eigh(1j * np.float64(a_ZHH))
    return np.real(np.einsum("zij,zj,zkj->zik", v, np.exp(-1j * lam), v.conj()))


def rotate_pairs(x, angle) -> np.ndarray:
    """Float64 rotation of interleaved pairs (x[2j], x[2j+1]) by `angle[..., j]`, as complex
    numbers (the form of RoFormer and rope-vit's torch.polar)."""
    x = np.asarray(x, np.float64)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angle)
    out = np.empty(x.shape)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def rope_angles(pos_XA, head_dim: int, base: float) -> np.ndarray:
    """1D RoPE: theta_j(p) = p * base^(-2j/H), float64 (..., F)."""
    j = np.arange(head_dim // 2)
    return np.asarray(pos_XA, np.float64)[..., :1] * base ** (-2.0 * j / head_dim)


def axial_angles(pos_XA, head_dim: int, base: float) -> np.ndarray:
    """RoPE-Axial: pair a*F/A + i rotates by p_a * base^(-2A*i/H), as loops, float64 (..., F)."""
    pos_XA = np.asarray(pos_XA, np.float64)
    num_axes = pos_XA.shape[-1]
    per_axis = head_dim // 2 // num_axes
    angle = np.zeros(pos_XA.shape[:-1] + (head_dim // 2,))
    for a in range(num_axes):
        for i in range(per_axis):
            angle[..., a * per_axis + i] = pos_XA[..., a] * base ** (-2.0 * num_axes * i / head_dim)
    return angle


def alternating_angles(pos_XA, head_dim: int, base: float) -> np.ndarray:
    """VisionLlama: pair j rotates by p_{j mod A} * base^(-2A*floor(j/A)/H), as a loop, float64
    (..., F)."""
    pos_XA = np.asarray(pos_XA, np.float64)
    num_axes = pos_XA.shape[-1]
    angle = np.zeros(pos_XA.shape[:-1] + (head_dim // 2,))
    for j in range(head_dim // 2):
        freq = base ** (-2.0 * num_axes * (j // num_axes) / head_dim)
        angle[..., j] = pos_XA[..., j % num_axes] * freq
    return angle


def mixed_angles(pos, freqs_ANF) -> np.ndarray:
    """RoPE-Mixed: theta[.., t, n, j] = sum_a p[.., t, a] f[a, n, j], float64."""
    return np.einsum("...ta,anf->...tnf", np.asarray(pos, np.float64), np.asarray(freqs_ANF))


def scores_from_phases(q_BTNH, k_BSNH, angle) -> np.ndarray:
    """<R(p_t) q_t, R(p_s) k_s> = Re sum_j zq_j conj(zk_j) exp(i angle_j(p_t - p_s)), float64
    (B, N, T, S), from the angles of the position differences only: (T, S, F) shared by the
    heads or (T, S, N, F) per head."""
    q, k = np.asarray(q_BTNH, np.float64), np.asarray(k_BSNH, np.float64)
    zq, zk = q[..., 0::2] + 1j * q[..., 1::2], k[..., 0::2] + 1j * k[..., 1::2]
    phase = np.exp(1j * np.asarray(angle))
    if phase.ndim == 3:
        phase = phase[:, :, None, :]
    return np.einsum("btnf,bsnf,tsnf->bnts", zq, np.conj(zk), phase).real
