"""``lie.rotate_spectral``'s two transforms (``lie.SPECTRAL_TRANSFORMS``): the FFT (every
platform's) and the products with the real DFT's tables, equal in values and gradients, and each
platform's program holding its own transform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie import encodings
from rope_lie.encodings import lie, positions


@pytest.fixture
def transform(monkeypatch):
    """Trace with a given transform on every platform: sets every ``SPECTRAL_TRANSFORMS`` entry
    and clears JAX's caches (the transform is read when a program is traced), and both again
    afterwards."""

    def use(name, **per_platform):
        monkeypatch.setitem(lie.SPECTRAL_TRANSFORMS, "default", name)
        for platform, choice in per_platform.items():
            monkeypatch.setitem(lie.SPECTRAL_TRANSFORMS, platform, choice)
        jax.clear_caches()

    yield use
    monkeypatch.undo()
    jax.clear_caches()


@pytest.mark.parametrize("head_dim", [3, 4, 7, 16, 64])
def test_dft_tables_are_rfft_and_irfft(head_dim):
    forward, inverse = (np.asarray(t, np.float64) for t in lie.dft_tables(head_dim))
    rng = np.random.default_rng(head_dim)
    x = rng.normal(size=(5, head_dim))
    spectrum = np.fft.rfft(x, axis=-1)
    np.testing.assert_allclose(
        x @ forward, np.concatenate([spectrum.real, spectrum.imag], -1), atol=1e-5
    )
    # Any half spectrum, not only a real signal's: irfft ignores the imaginary parts of bin 0
    # and (even H) bin H / 2, and the tables must too.
    y = rng.normal(size=spectrum.shape) + 1j * rng.normal(size=spectrum.shape)
    np.testing.assert_allclose(
        np.concatenate([y.real, y.imag], -1) @ inverse, np.fft.irfft(y, n=head_dim), atol=1e-6
    )


def _phases(shape, rng):
    angle = rng.uniform(-np.pi, np.pi, size=shape)
    return jnp.asarray(np.cos(angle) + 1j * np.sin(angle), jnp.complex64)


@pytest.mark.parametrize("head_dim", [5, 16])
@pytest.mark.parametrize("per_example", [False, True])
def test_dft_equals_fft_in_values_and_gradients(transform, head_dim, per_example):
    rng = np.random.default_rng(0)
    batch, tokens, heads = 2, 6, 3
    x = jnp.asarray(rng.normal(size=(batch, tokens, heads, head_dim)), jnp.float32)
    phase = _phases(((batch,) if per_example else ()) + (tokens, heads, head_dim // 2 + 1), rng)
    cot = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

    def run():
        # A new function each time: traced with the transform set now.
        def loss(x, phase):
            return jnp.sum(lie.rotate_spectral(x, phase) * cot)

        out = jax.jit(lambda x, p: lie.rotate_spectral(x, p))(x, phase)
        gx, gp = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, phase)
        return jax.device_get((out, gx, gp))

    transform("fft")
    want = run()
    transform("dft")
    got = run()
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-5 * np.max(np.abs(w)))


def test_circulant_string_with_dft_keeps_x_dtype_and_matches_fft(transform):
    module = encodings.ROTARY["circulant_string"]
    params = module.init(jax.random.key(0), num_heads=2, head_dim=16, num_axes=2)
    pos = positions.grid_positions((3, 4), "integer", num_prefix=1)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 13, 2, 16)), jnp.bfloat16)
    transform("fft")
    want = np.asarray(jax.jit(module.apply)(params, x, pos), np.float32)
    transform("dft")
    got = jax.jit(module.apply)(params, x, pos)
    assert got.dtype == jnp.bfloat16
    # bfloat16 outputs: the two float32 results round to neighbouring bfloat16 values at most.
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2**-7, atol=2**-7)


def _lowered(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


# This platform's key in the table (``lax.platform_dependent``'s: a GPU is "cuda").
HERE = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())


def test_each_platform_lowers_its_own_transform(transform):
    x = jnp.ones((1, 2, 1, 8), jnp.float32)
    phase = jnp.ones((2, 1, 5), jnp.complex64)
    transform("fft")
    assert "stablehlo.fft" in _lowered(lie.rotate_spectral, x, phase)
    transform("fft", **{HERE: "dft"})  # this platform's program: the DFT's products, no FFT
    text = _lowered(lie.rotate_spectral, x, phase)
    assert "stablehlo.fft" not in text and "dot_general" in text
    transform("dft", **{HERE: "fft"})
    assert "stablehlo.fft" in _lowered(lie.rotate_spectral, x, phase)


def test_an_unknown_transform_is_refused_with_its_name(transform):
    transform("fft", cpu="fast")
    with pytest.raises(ValueError, match=r"SPECTRAL_TRANSFORMS\['cpu'\]='fast'.*'fft', 'dft'"):
        lie.rotate_spectral(jnp.ones((1, 2, 1, 8)), jnp.ones((2, 1, 5), jnp.complex64))
