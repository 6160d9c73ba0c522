"""Shared test fixtures, and how the suite keeps compilation cheap.

The repository root goes on sys.path so tests can import the recipes in configs/ as modules
(``from configs import digits``); the recipes themselves load from anywhere.

Most of the suite's time is XLA compiling many small programs, so two settings apply to this
process and to the subprocesses that tests start (they inherit the environment):

- XLA:CPU at backend (LLVM) optimisation level 0 with its older loop fusion emitters (where the
  installed jaxlib still has them: ``fast_compile_flags``): the same HLO programs, compiled
  5-7x faster (a dense-LieRE layer's forward 7.5 -> 1.0 s, its gradient 8.7 -> 1.4 s on this
  2-core machine) and run 2-3x slower, which at test shapes is the better trade. Each program
  is also code-generated as one LLVM module, not split for parallel compilation
  (``--xla_cpu_parallel_codegen_split_count=1``): with one test process per core there is no
  idle core to split onto, and 30 small programs compiled in 10.4-11.8 s instead
  of 14.0 s. The tests check what the programs compute, within float32 tolerances, not how fast
  they run. The main job and the benchmarks compile with XLA's defaults (``.ci/run`` runs the
  quickstart smoke that way), and the LAPACK deadlock regression test in test_lie.py clears
  these flags for its subprocess.
- a persistent compilation cache in a fresh temporary directory, for this session only, that
  keeps every program (threshold 0 s: the encoder and model tests ran 5 % faster than at 1 s):
  identical programs built by different tests or processes (a resumed run and its reference,
  say) compile once. Nothing is reused from earlier sessions.

Multi-device tests start a subprocess with 8 simulated CPU devices (see tests/test_sharding.py),
so this session keeps one device.
"""

import atexit
import importlib.metadata
import os
import re
import shutil
import sys
import tempfile

# pytest-xdist's workers inherit this environment from the controlling process, which imports
# this file first: they share its cache directory, which it removes at exit.
if "ROPE_LIE_TEST_JAX_CACHE" not in os.environ:
    os.environ["ROPE_LIE_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="rope_lie_tests_jax_cache_")
    atexit.register(shutil.rmtree, os.environ["ROPE_LIE_TEST_JAX_CACHE"], ignore_errors=True)
_CACHE_DIR = os.environ["ROPE_LIE_TEST_JAX_CACHE"]


def fast_compile_flags(jaxlib_version: tuple[int, int]) -> str:
    """The suite's XLA:CPU flags for this jaxlib: only flags its XLA knows.

    XLA aborts the process (not an exception) on a flag it does not know, and reads XLA_FLAGS
    when the first backend starts, so a flag that a jax release removed would kill every test
    process before a test runs. ``--xla_cpu_use_fusion_emitters`` is in jaxlib 0.7.0 and 0.10.2
    and gone from 0.11.2 (on the device image, every pytest worker died at start-up with it),
    so it is asked for only before 0.11.
    """
    flags = ["--xla_backend_optimization_level=0"]
    if jaxlib_version < (0, 11):
        flags.append("--xla_cpu_use_fusion_emitters=false")
    flags.append("--xla_cpu_parallel_codegen_split_count=1")
    return " ".join(flags)


def installed_jaxlib_version() -> tuple[int, int]:
    """(major, minor) of the installed jaxlib, read without importing jax (it reads XLA_FLAGS)."""
    major, minor = re.findall(r"\d+", importlib.metadata.version("jaxlib"))[:2]
    return int(major), int(minor)


_FAST_COMPILE = fast_compile_flags(installed_jaxlib_version())
if _FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# Implicit rank promotion (adding (N, H) to (B, T, N, H), say) is an error in the suite and in
# the runs its tests start: broadcasting is written out, so a shape slip cannot pass silently.
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
# TensorFlow (tf.data, TFDS) imports Keras 3 eagerly, 2-3 s of its ~8 s import in every process
# that reads data, subprocesses included; nothing here uses tf.keras. With this variable it
# looks for tf_keras instead, which is not installed, and skips it.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
# The tests' float64 references (scipy's expm, numpy's solves) make many small BLAS/LAPACK
# calls, and OpenBLAS wakes its worker threads for each: beside JAX's threads on 2 cores, 260
# scipy expm calls of 8 x 8 took 2.0 s, on one OpenBLAS thread 0.003 s. Set before numpy is
# imported (OpenBLAS reads it when loaded); JAX's own CPU linear algebra also calls LAPACK, and
# test_lie.py's deadlock regression test runs its subprocess without this setting.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402  (after the environment above: jax reads it when first imported)
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", _CACHE_DIR)  # in case jax was imported earlier
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_numpy_rank_promotion", "raise")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one test process per core, at most 4. XLA compiles a
    program on one thread, so two processes on two cores compile twice as much per second; more
    than 4 would hold more memory than the compilations they overlap save."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, cores or 1))


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory):
    """A TFDS data_dir shared by the session; local builders are generated into it on first use."""
    return str(tmp_path_factory.mktemp("tensorflow_datasets"))


@pytest.fixture(scope="session")
def reference_run(tfds_dir, tmp_path_factory):
    """The reference run (``helpers.digits_config``), trained once per test process that needs
    it (test_train.py, test_multiprocess.py) and never changed: (workdir, its returned metrics).
    Copy the workdir to resume or damage it."""
    from rope_lie import train
    from tests import helpers

    workdir = str(tmp_path_factory.mktemp("reference_run"))
    return workdir, train.train_and_evaluate(helpers.digits_config(tfds_dir), workdir)


# The longest files, longest first (most start subprocesses or share an expensive fixture):
# they are handed to the workers first (pyproject: --dist loadfile, a file whole in one
# worker), so that none of them is left for the end while the other worker idles.
FIRST = (
    "test_device_queue.py",
    "test_multiprocess.py",
    "test_studies.py",
    "test_train.py",
    "test_tokens.py",
    "test_explicit_sharding.py",
    "test_interop.py",
    "test_sharding.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        return FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: each file keeps its own order
