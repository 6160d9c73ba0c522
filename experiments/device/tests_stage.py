"""Stage 2, ``tests``: the test suite's GPU and encoder tests, each in a pytest subprocess.

The GPU tests (``GPU_TESTS``) run on the device until the stage's deadline; the encoder tests
(``ENCODER_TESTS``) run on the machine's CPU in the background until their own deadline, which
``wait_for_encoder_tests`` waits for before the steps are timed. Each run's pass/fail counts and
failing ids are read from its ``-v`` log (``pytest_counts``), whose whole text is written beside
the JSON; each failure's report is written to that log as the test fails (the plugin
``pytest_failures``), and its message kept in the JSON (``failure_messages``), since pytest's own
tracebacks come at the end of a session the deadline may stop first.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time

from experiments.device.queue import Queue
from experiments.device.recipes import ROOT

# Most wanted first (pytest runs the files in this order): on an H200 the stage's deadline
# stopped them at 76 %, and the VJPs' comparison decides a GPU default
# (expm_combination.COMBINATION_BACKWARDS); the attention file's ViT comparisons, slow (15 of 60
# passed in 106 s on an H100 machine) and passed by every run so far, come last.
GPU_TESTS = (
    "tests/encodings/test_combination_backward.py",  # LieRE's two VJPs on the device
    "tests/encodings/test_expm_pallas.py",  # the Pallas squarings compiled by Triton
    "tests/encodings/test_block_products.py",
    "tests/encodings/test_spectral_transforms.py",  # cuFFT against the real DFT's products
    "tests/models/test_attention_gpu.py",
)
# pytest-xdist workers for the GPU tests: each compiles on the host (the attention file's ViT
# comparisons took about 14 s a test per worker with 2 workers, on an H100 machine of 16 cores,
# beside the encoder tests' workers) and may hold GPU_MEMORY_FRACTION of the device's memory,
# so 4 of them hold at most 0.8 of it, the rest left to the queue's own process.
GPU_TEST_WORKERS = 4
GPU_MEMORY_FRACTION = 0.2
ENCODER_TESTS = ("tests/encodings",)
# The dry run checks the stage's path on a CPU, not the tests themselves (the suite runs them):
# the quick ones of the GPU tests' file.
DRY_TESTS = ("tests/encodings/test_block_products.py", "-k", "lowers or bfloat16")
DRY_ENCODER_TESTS = ("tests/encodings/test_block_products.py", "-k", "lowers")


_STATUS = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
# Starts every line the plugin pytest_failures writes: a failure's report may quote test ids
# and status words, which pytest_counts must not count.
FAILURE_PREFIX = "[failure] "
# Characters of each failure's message kept in the JSON; the whole report is in the log.
FAILURE_CHARS = 2000


def failure_lines(test_id: str, when: str, report: str) -> list[str]:
    """A failed report as the log's lines: the test and its phase, then the report's lines."""
    body = [f"{FAILURE_PREFIX}| {line}".rstrip() for line in report.splitlines()]
    return [f"{FAILURE_PREFIX}{test_id} ({when}):", *body]


def failure_reports(log: str) -> dict[str, str]:
    """Test id -> its failed reports (``failure_lines``) in ``log``, in the order written."""
    reports: dict[str, list[str]] = {}
    current = None
    for line in log.splitlines():
        if not line.startswith(FAILURE_PREFIX):
            continue
        body = line[len(FAILURE_PREFIX) :]
        if body.startswith("|"):
            if current is not None:
                reports[current].append(body[2:])
        else:
            current = body.rstrip(":").rpartition(" (")[0]
            reports.setdefault(current, [])
    return {test_id: "\n".join(lines) for test_id, lines in reports.items()}


def failure_message(report: str) -> str:
    """A short report's exception and assertion message (its ``E`` lines, the traceback's
    frames left to the log), or the whole report where it has none."""
    lines = [ln[4:] for ln in report.splitlines() if ln == "E" or ln.startswith("E   ")]
    return "\n".join(lines) if lines else report


def pytest_counts(log: str) -> dict:
    """Counts per status and the failing ids from pytest's ``-v`` lines (with or without
    xdist: ``path::id STATUS`` or ``[gw0] [ 5%] STATUS path::id``); complete even when the run
    was stopped before its summary). The short summary's ``FAILED path::id - why`` lines, which
    repeat failures already counted, end the count."""
    counts, failed = collections.Counter(), []
    for line in log.splitlines():
        if "short test summary info" in line:
            break
        if "::" not in line or line.startswith(FAILURE_PREFIX):
            continue
        m = _STATUS.search(line)
        if not m:
            continue
        counts[m.group(1).lower()] += 1
        if m.group(1) in ("FAILED", "ERROR"):
            failed.append(next((w for w in line.split() if "::" in w), line.strip()))
    return {"counts": dict(counts), "failed": failed}


def start_pytest(paths: tuple[str, ...], env_extra: dict, workers: int, log_path: str):
    """pytest on ``paths`` in a subprocess of its own process group, output to ``log_path``."""
    # Plugins an image may carry that warn at start-up (pytest-benchmark beside xdist): the
    # project's filterwarnings make a warning an error, so they are blocked.
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:benchmark"]
    # -v: a line per test (counted as it runs); each failure's short report as it fails
    # (pytest_failures), and the failures' one-line reasons (-rfE) at the end.
    cmd += ["-v", "--tb=short", "-rfE", "-p", "experiments.device.pytest_failures", *paths]
    if importlib.util.find_spec("xdist") is not None:  # tests/conftest.py uses its hook
        cmd += ["-n", str(workers), "--dist", "load"] if workers > 1 else ["-n", "0"]
    else:
        cmd += ["-o", "addopts=--import-mode=importlib"]
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    log = open(log_path, "w")  # noqa: SIM115  (closed by finish_pytest)
    # A process group of its own (xdist's workers included) to stop at the deadline; not a
    # session of its own, so nothing outlives the command that started the queue.
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0
    )
    return {"proc": proc, "log": log, "log_path": log_path, "cmd": cmd, "began": time.monotonic()}


def finish_pytest(run: dict, deadline: float) -> dict:
    """Wait for a pytest run until ``deadline`` (monotonic), stopping its process group then;
    its counts, failures and their messages, summary line and, on failure, the log's end."""
    proc = run["proc"]
    timed_out = False
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    run["log"].close()
    with open(run["log_path"]) as f:
        log = f.read()
    out = pytest_counts(log)
    out["failure_messages"] = {
        test_id: failure_message(report)[:FAILURE_CHARS]
        for test_id, report in failure_reports(log).items()
    }
    summary = [ln for ln in log.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    out.update(
        command=" ".join(run["cmd"][1:]),
        returncode=proc.returncode,
        seconds=round(time.monotonic() - run["began"], 1),
        timed_out=timed_out,
        summary=summary[-1].strip("= ") if summary else "",
        log=os.path.basename(run["log_path"]),
    )
    if timed_out or proc.returncode != 0:  # 5: no tests collected, a failure here too
        out["log_tail"] = log[-3000:]
    if proc.returncode == 5:
        out["error"] = "no tests collected"
    return out


def stage_tests(q: Queue) -> str:
    if importlib.util.find_spec("pytest") is None:
        q.data["tests"] = {"gpu": {"error": "pytest is not installed"}}
        return "pytest is not installed: no tests run"
    logs = q.results.stem_path  # the full logs come back beside the JSON
    dry = q.args.dry_run
    # The encoder tests on this machine's CPU with its jax, in the background until their own
    # deadline: they use no accelerator, so they may overlap the compile stage, not the timing.
    cpu_env = {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    q.background["encoder_tests"] = start_pytest(
        DRY_ENCODER_TESTS if dry else ENCODER_TESTS,
        cpu_env,
        workers=1 if dry else max(1, (os.cpu_count() or 2) // 4),
        log_path=f"{logs}-tests-encoders-cpu.log",
    )
    gpu_env = {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": str(GPU_MEMORY_FRACTION),
    }
    run = start_pytest(
        DRY_TESTS if dry else GPU_TESTS,
        gpu_env,
        workers=1 if dry else GPU_TEST_WORKERS,
        log_path=f"{logs}-tests-gpu.log",
    )
    gpu = finish_pytest(run, q.deadline("tests"))
    q.data["tests"] = {"gpu": gpu}
    if gpu.get("error"):
        raise RuntimeError(f"GPU tests: {gpu['error']} (pytest exit code {gpu['returncode']})")
    return gpu.get("summary", "")


def stop_background(q: Queue) -> None:
    """Stop the background tests' process groups (a run that ends early or overstays)."""
    for run in q.background.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run["proc"].pid, signal.SIGKILL)


def wait_for_encoder_tests(q: Queue) -> None:
    run = q.background.pop("encoder_tests", None)
    if run is not None:
        q.data.setdefault("tests", {})["encoders_on_cpu"] = finish_pytest(
            run, q.deadline("encoder_tests")
        )
        q.results.save()
