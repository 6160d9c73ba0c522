"""Stage 1, ``environment``: the device and the software it runs.

The device kind and memory, the versions of the packages the queue uses, and whether the jax
APIs that rope_lie uses and that have moved or may move between releases (``JAX_APIS``) import.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform as platform_module

from experiments.device.queue import Queue

# APIs whose place in jax has moved or may move between releases, as rope_lie uses them.
JAX_APIS = (
    "jax.set_mesh",
    "jax.typeof",
    "jax.sharding.reshard",
    "jax.sharding.AxisType",
    "jax.lax.platform_dependent",
    "jax.export.export",
    "jax.nn.dot_product_attention",
    "jax.profiler.ProfileData",
    "jax.experimental.multihost_utils.process_allgather",
    "jax._src.distributed.global_state",
    "jax.experimental.pallas.ops.tpu.flash_attention.flash_attention",
    "jax.experimental.pallas.tpu.force_tpu_interpret_mode",
)


def _import_path(path: str) -> None:
    """Import ``a.b.c.attr`` (the longest importable module prefix, then attributes)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return
    raise ImportError(path)


def stage_environment(q: Queue) -> str:
    import jax

    from experiments.benchmarks import device as bench

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    versions = {}
    for dist in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "pytest"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    apis = {}
    for path in JAX_APIS:
        try:
            _import_path(path)
            apis[path] = "ok"
        except Exception as e:
            apis[path] = f"{type(e).__name__}: {e}"[:300]
    q.data.update(
        platform=jax.default_backend(),
        device_count=jax.device_count(),
        memory_bytes_limit=stats.get("bytes_limit"),
        versions=versions,
        jax_apis=apis,
        python=platform_module.python_version(),
        cpu_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        peak_tflops=(bench.peak_flops(device.device_kind, q.args.peak_tflops) or 0) / 1e12 or None,
    )
    missing = [p for p, ok in apis.items() if ok != "ok"]
    return f"apis missing: {missing}" if missing else "all checked jax apis import"
