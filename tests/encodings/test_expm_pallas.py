"""expm.py's "pallas" squarings (``SQUARING_LOOPS``): one Pallas kernel, against the "while" loop
in values, gradients (the VJPs' forward-mode Frechet derivatives, a second kernel) and under
``jax.vmap``; and its lowering for CUDA (Triton). On this process's platform: interpret mode
on CPU, the compiled Triton kernels on a GPU (the device queue runs this file there: numpy
only, no scipy, which the device image lacks)."""

import functools
import json

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie.encodings import expm, expm_combination
from tests.encodings.reference import expm_skew64, random_skew

HOST = expm.Host(jax.default_backend(), 1)
pytestmark = [
    pytest.mark.skipif(
        HOST.platform not in ("cpu", "gpu"), reason="the Pallas squarings run on CPUs and GPUs"
    ),
    # jax 0.11 deprecates Pallas's Triton backend (lowering a kernel for CUDA warns), which is
    # why "pallas" stays an option and not the GPU's default (expm.SQUARING_LOOPS).
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]


@pytest.fixture
def squarings(monkeypatch):
    """``set(choice)``: this platform's squarings from now on (``SQUARING_LOOPS`` is read when a
    program is traced, and the jitted functions keep their traces: cleared each time)."""

    def set_loop(choice):
        monkeypatch.setitem(expm.SQUARING_LOOPS, HOST.platform, choice)
        jax.clear_caches()

    yield set_loop
    monkeypatch.undo()
    jax.clear_caches()  # later tests in this process trace the default again


def _rotations(rng, z, h):
    """(z, h, h) float32 rotations of angles up to 0.1 (as the Taylor rows are)."""
    return expm_skew64(random_skew(rng, z, h, 0.1)).astype(np.float32)


def _calls(fn, *args) -> tuple[int, int]:
    """(pallas_call, while loops outside the kernels) in the jaxpr of ``fn``."""

    def count(jaxpr):
        calls = loops = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                calls += 1
                continue
            loops += eqn.primitive.name == "while"
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                sub_calls, sub_loops = count(sub)
                calls, loops = calls + sub_calls, loops + sub_loops
        return calls, loops

    return count(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize("h", [5, 8, 16])
def test_pallas_square_equals_the_while_loop_per_matrix(squarings, h):
    # 45 matrices: not a multiple of a block (16 of 8 x 8, 2 of 16 x 16), and H = 5 is padded
    # to 8; s from 0 to 11, so every block masks matrices whose squarings ended earlier.
    rng = np.random.default_rng(h)
    r = _rotations(rng, 45, h)
    s = np.arange(45) % 12
    rng.shuffle(s)

    def square(s_Z, r_ZHH):
        return expm.square(HOST, s_Z, r_ZHH)

    loop = np.asarray(jax.jit(square)(s, r))
    squarings("pallas")
    assert _calls(square, s, r) == (1, 0)
    fused = np.asarray(jax.jit(square)(s, r))
    np.testing.assert_array_equal(fused[s == 0], r[s == 0])
    # Each squaring doubles the rounding error so far: within 2^s float32 roundings of R^(2^s).
    exact = np.stack(
        [np.linalg.matrix_power(np.float64(m), 2**k) for m, k in zip(r, s, strict=True)]
    )
    tol = 2.0**s * 2e-7
    assert (np.abs(fused - exact).max(axis=(1, 2)) <= tol).all()
    assert (np.abs(fused - loop).max(axis=(1, 2)) <= tol).all()


@pytest.mark.parametrize("h", [5, 8, 16])
def test_pallas_squarings_adjoint_equals_the_while_loop_per_matrix(squarings, h):
    # The reverse-mode VJP's loop, Z -> Z P^T + P^T Z with P = T^(2^k) for k < s_z: one kernel
    # against the loop and float64. 45 matrices (not a block's multiple; H = 5 padded to 8), s
    # from 0 to 11 shuffled, so every block masks matrices whose squarings ended earlier.
    rng = np.random.default_rng(70 + h)
    t = _rotations(rng, 45, h)
    z = rng.normal(size=(45, h, h)).astype(np.float32)
    s = np.arange(45) % 12
    rng.shuffle(s)

    def adjoint(s_Z, t_ZHH, z_ZHH):
        return expm_combination._squarings_adjoint(HOST, s_Z, t_ZHH, z_ZHH)

    loop = np.asarray(jax.jit(adjoint)(s, t, z))
    squarings("pallas")
    assert _calls(adjoint, s, t, z) == (1, 0)
    fused = np.asarray(jax.jit(adjoint)(s, t, z))
    np.testing.assert_array_equal(fused[s == 0], z[s == 0])
    exact = np.float64(z)
    for i, (m, k) in enumerate(zip(np.float64(t), s, strict=True)):
        for j in range(k):
            p = np.linalg.matrix_power(m, 2**j)
            exact[i] = exact[i] @ p.T + p.T @ exact[i]
    # Z doubles in size at each squaring, and so does its rounding error so far.
    scale = np.abs(exact).max(axis=(1, 2))
    tol = 2.0**s * 1e-6 * scale
    assert (np.abs(fused - exact).max(axis=(1, 2)) <= tol).all()
    assert (np.abs(fused - loop).max(axis=(1, 2)) <= tol).all()


def _value_and_grad_both(squarings, fn, *args):
    """``jax.value_and_grad(fn, argnums=all)`` by the "while" loop and by the kernel, and the
    kernel's (pallas_call, while loops) count: one kernel forward, one in the VJP."""
    step = jax.jit(jax.value_and_grad(fn, argnums=tuple(range(len(args)))))
    loop = step(*args)
    squarings("pallas")
    return loop, step(*args), _calls(step, *args)


def _assert_equal_to_rounding(fused, loop, rtol):
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(loop), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())


@pytest.mark.parametrize("h", [6, 8])
def test_pallas_expm_skew_values_and_gradients_equal_the_while_loop(squarings, h):
    # Norms 1e-2 to 50: s from 0 to 5 in one batch. Larger norms are ill-conditioned (each
    # squaring doubles the rounding error): both ways agree only to 2^s roundings there.
    rng = np.random.default_rng(20 + h)
    a = jnp.asarray(random_skew(rng, 13, h, 1.0) * np.logspace(-2, 1.7, 13)[:, None, None])
    a = a.astype(jnp.float32)
    w = jnp.asarray(rng.normal(size=a.shape), jnp.float32)
    assert int(expm.num_squarings(a).max()) >= 4

    def loss(x):
        return jnp.sum(w * expm.expm_skew(x, host=HOST))

    loop, fused, calls = _value_and_grad_both(squarings, loss, a)
    assert calls == (2, 0)
    _assert_equal_to_rounding(fused, loop, 1e-5)
    rotations = np.float64(expm.expm_skew(a, host=HOST))
    exact = expm_skew64(a)
    np.testing.assert_allclose(rotations, exact, atol=2e-5)


def _liere_like(rng, rows, gens):
    """(rows, 2) positions and (2, gens, 8, 8) generators, as LieRE 8x8's on a 2-d grid."""
    coef = jnp.asarray(rng.uniform(-7.0, 7.0, size=(rows, 2)), jnp.float32)
    gen = np.stack([random_skew(rng, gens, 8, 1.0) for _ in range(2)])
    return coef, jnp.asarray(gen * rng.uniform(0.1, 1.0, size=(2, gens, 1, 1)), jnp.float32)


@pytest.mark.parametrize("backward", ["frechet", "reverse"])
def test_pallas_combination_values_and_gradients_equal_the_while_loop(
    squarings, monkeypatch, backward
):
    # Two kernels and no loop of the step's own: the squarings forward, and backward their
    # forward-mode pairs (the Frechet VJP) or their adjoint (the reverse-mode VJP).
    monkeypatch.setitem(expm_combination.COMBINATION_BACKWARDS, HOST.platform, backward)
    rng = np.random.default_rng(30)
    coef, gen = _liere_like(rng, 37, 3)
    w = jnp.asarray(rng.normal(size=(37, 3, 8, 8)), jnp.float32)
    assert int(expm_combination.num_squarings(coef, gen).max()) >= 2

    def loss(c, g):
        return jnp.sum(w * expm_combination.expm_skew_combination(c, g, host=HOST))

    loop, fused, calls = _value_and_grad_both(squarings, loss, coef, gen)
    assert calls == (2, 0)
    _assert_equal_to_rounding(fused, loop, 1e-5)


@pytest.mark.parametrize("backward", ["frechet", "reverse"])
def test_pallas_squarings_under_vmap_equal_the_while_loop(squarings, monkeypatch, backward):
    # The batched layer plan vmaps the encoders' precompute over layers: pallas_call's
    # batching rule adds a grid axis, here to both kernels (forward and the VJP's: forward
    # mode's, or the reverse-mode adjoint's).
    monkeypatch.setitem(expm_combination.COMBINATION_BACKWARDS, HOST.platform, backward)
    rng = np.random.default_rng(40)
    pairs = [_liere_like(rng, 21, 2) for _ in range(3)]
    coef, gen = (jnp.stack(x) for x in zip(*pairs, strict=True))
    w = jnp.asarray(rng.normal(size=(3, 21, 2, 8, 8)), jnp.float32)

    def loss(c, g):
        rotations = jax.vmap(functools.partial(expm_combination.expm_skew_combination, host=HOST))(
            c, g
        )
        return jnp.sum(w * rotations)

    loop, fused, calls = _value_and_grad_both(squarings, loss, coef, gen)
    assert calls == (2, 0)
    _assert_equal_to_rounding(fused, loop, 1e-5)
    # And the squarings alone, per slice against the vmapped kernel.
    r = jnp.asarray(np.stack([_rotations(rng, 19, 8) for _ in range(2)]))
    s = jnp.asarray(rng.integers(0, 11, size=(2, 19)), jnp.int32)
    batched = jax.jit(jax.vmap(lambda s_Z, r_ZHH: expm.square(HOST, s_Z, r_ZHH)))(s, r)
    for i in range(2):  # two compiled programs: within 2^s float32 roundings, as in (a)
        alone = jax.jit(expm.square, static_argnums=0)(HOST, s[i], r[i])
        gap = np.abs(np.asarray(batched[i]) - np.asarray(alone)).max(axis=(1, 2))
        assert (gap <= 2.0 ** np.asarray(s[i]) * 2e-7).all()


def test_squarings_fall_back_to_the_while_loop_above_16_and_on_tpus(squarings, monkeypatch):
    squarings("pallas")
    r = jnp.asarray(_rotations(np.random.default_rng(50), 3, 24))
    s = jnp.array([0, 2, 1], jnp.int32)
    assert _calls(lambda x: expm.square(HOST, s, x), r) == (0, 1)
    assert _calls(lambda x: expm.square(HOST, s, x), r[:, :16, :16]) == (1, 0)
    monkeypatch.setitem(expm.SQUARING_LOOPS, "tpu", "pallas")
    tpu = expm.Host("tpu", 1)
    assert tpu.squaring_loop == "pallas" and not tpu.pallas_squarings
    assert _calls(lambda x: expm.square(tpu, s, x), r[:, :8, :8]) == (0, 1)


def test_an_unknown_squaring_loop_is_named_with_pallas_among_the_choices(squarings):
    squarings("triton")
    with pytest.raises(
        ValueError,
        match=rf"SQUARING_LOOPS\['{HOST.platform}'\]='triton'; expected one of "
        r"\['while', 'fixed', 'pallas'\]",
    ):
        expm.expm_skew(jnp.zeros((1, 8, 8)), host=HOST)


# What jax 0.11's Triton lowering raises in a process without a GPU (its message asks for an
# abstract GPU device instead); jax 0.10 lowered the kernels for CUDA on a CPU-only process.
_NO_GPU = "No supported GPU devices found"


def lower_for_cuda(traced) -> str:
    """``traced`` lowered (not compiled) for CUDA, as StableHLO text; the test is skipped where
    this jax lowers Pallas's Triton kernels only beside a GPU, and any other error is raised:
    the check is lost only on such a process, never hidden elsewhere."""
    try:
        return traced.lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as e:
        if _NO_GPU not in str(e):
            raise
        pytest.skip(
            f"jax {jax.__version__} lowers Pallas Triton kernels for CUDA only on a GPU "
            f"({_NO_GPU}); the device queue's tests stage compiles them on the GPU and checks "
            "them against the loop (this file's other tests)"
        )


def test_pallas_squarings_lower_for_cuda_as_triton_kernels(monkeypatch):
    # The best check short of a GPU that the kernels compile there: the gradient of vmapped
    # LieRE-like rotations, traced for a GPU host and lowered (not run) for CUDA, holds the
    # two kernels as Triton calls and no loop of its own. H = 6 is padded to 8.
    monkeypatch.setitem(expm.SQUARING_LOOPS, "gpu", "pallas")
    gpu = expm.Host("gpu", 1)
    rng = np.random.default_rng(60)
    coef = jnp.asarray(rng.uniform(-7.0, 7.0, size=(2, 21, 2)), jnp.float32)
    for h in (6, 8, 16):
        gen = jnp.asarray(np.stack([random_skew(rng, 3, h, 1.0) for _ in range(2)]), jnp.float32)

        def loss(c, g):
            rotations = jax.vmap(
                functools.partial(expm_combination.expm_skew_combination, host=gpu), (0, None)
            )(c, g)
            return jnp.sum(jnp.sin(rotations))

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        for backward in ("frechet", "reverse"):  # forward mode's kernel, or the adjoint's
            monkeypatch.setitem(expm_combination.COMBINATION_BACKWARDS, "gpu", backward)
            jax.clear_caches()
            text = lower_for_cuda(step.trace(coef, gen))
            calls = text.count("__gpu$xla.gpu.triton")
            assert calls == 2 and "stablehlo.while" not in text, (h, backward)


def test_pallas_kernels_compile_for_sm90_without_spilling():
    # The kernels' Triton IR compiled by the triton package and its ptxas for an H100/H200
    # (experiments/benchmarks/pallas_registers.py, in a process of its own: importing triton's
    # compiler in a test worker beside PyTorch's libraries crashed it): each compiles, and none
    # keeps values in local memory at its block size (expm_pallas.PALLAS_BLOCK_ELEMENTS). XLA's
    # own Triton compiles them on a GPU; this is the check short of one.
    import subprocess
    import sys

    from tests import helpers

    proc = subprocess.run(
        [sys.executable, "-m", "experiments.benchmarks.pallas_registers", "--json"],
        capture_output=True,
        text=True,
        env=helpers.subprocess_env(),
        cwd=helpers.REPO,
        timeout=600,
    )
    if proc.returncode == 2:  # no triton, no ptxas, or a jax that lowers Triton only on a GPU
        pytest.skip(proc.stdout.strip()[-300:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 9  # 3 kernels x 3 sides
    for r in rows:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert 0 < r["registers"] <= 255, r
