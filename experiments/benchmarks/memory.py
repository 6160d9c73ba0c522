"""Compiled memory per device of the recipes' train steps: "xla" against "chunked" attention.

Compile only, nothing runs: the jitted train step of ``rope_lie/train.py`` (the recipes'
shardings: batch over the ``data`` axis, parameters replicated, state donated) is lowered for
an 8-device mesh simulated on the CPU (``--xla_force_host_platform_device_count=8``) and
compiled, and ``compiled.memory_analysis()`` gives one device's buffers: arguments (the train
state and the batch shard), outputs, aliased (donated) bytes and temporaries. Per device:
arguments + outputs - aliased + temporaries. Each case is compiled at two per-device batches;
memory is linear in the batch, so the two give the fixed bytes and the bytes per example, and
the largest per-device batch that fits ``DEVICE_GIB``.

Cases: ViT-B/16 on ImageNet (``configs/imagenet.py``, LieRE 8x8, the recipe's bfloat16
activations and float32 parameters; float32 images) at 224 px (197 tokens) and 448 px (785
tokens), and the UCF101 3D step (``configs/ucf101.py``, 8 x 224 x 224 clips, 2 x 16 x 16
tubelets: 784 tokens + class token). XLA:CPU's buffer assignment stands in for the accelerators'
(their fusion differs, so absolute numbers will too; the ratio between the backends is the
point). ``--out`` writes ``{"machine": ..., "rows": [...]}``, the machine
(CPU, cores, load average, versions: ``common.machine()``) recorded before the first case.

    python -m experiments.benchmarks.memory [--quick] [--only '224 px'] [--out memory.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from experiments.benchmarks import common  # noqa: E402
from rope_lie import sharding, train  # noqa: E402

DEVICES = 8
DEVICE_GIB = 16
PER_DEVICE_BATCHES = (1, 2)
BACKENDS = ("xla", "chunked")


def cases(quick: bool = False) -> list[tuple[str, object]]:
    """(name, config) of every case; ``quick``: the pico ViT instead of ViT-B (a smoke run)."""
    from configs import imagenet, ucf101

    out = []
    for side in (224, 448):
        c = imagenet.get_config()
        c.model.image_shape = (side, side)
        out.append((f"ViT-B/16 {side} px", c))
    out.append(("UCF101 ViT-B 3D", ucf101.get_config()))
    if quick:
        for _, c in out:
            c.model.variant = "pico"
    return out


def device_bytes(config, per_device_batch: int) -> dict[str, int]:
    """One device's compiled train-step buffers (bytes) at this per-device batch."""
    mesh = sharding.make_mesh(config.mesh)
    setup, abstract_state, _, _ = train.create_setup_and_state(config, mesh, 1000)
    model = nnx.eval_shape(lambda: train.build_model(config.model, jax.random.key(0)))
    other = nnx.split(model, nnx.Param, ...)[2]
    batch = per_device_batch * mesh.size
    image = jax.ShapeDtypeStruct(
        (batch, *config.model.image_shape, config.model.channels), jnp.float32
    )
    label = jax.ShapeDtypeStruct((batch,), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(1))
    step = train.make_train_step(setup)
    lowered = step.lower(abstract_state, {"image": image, "label": label}, other, key)
    # LLVM's optimisation level changes the machine code, not XLA's buffer assignment (the same
    # bytes at 0 and at the default, checked on the pico ViT), and compiles ~2x faster.
    compiled = lowered.compile(compiler_options={"xla_backend_optimization_level": 0})
    m = compiled.memory_analysis()
    sizes = dict(
        arguments=m.argument_size_in_bytes,
        outputs=m.output_size_in_bytes,
        aliased=m.alias_size_in_bytes,
        temporaries=m.temp_size_in_bytes,
    )
    sizes["total"] = sizes["arguments"] + sizes["outputs"] - sizes["aliased"] + sizes["temporaries"]
    return sizes


def run(quick: bool = False, only: str = "", out: str = "") -> list[dict]:
    if jax.device_count() != DEVICES:
        raise RuntimeError(
            f"needs {DEVICES} devices, found {jax.device_count()}: run with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES} set before jax starts"
        )
    rows, machine = [], common.machine()
    for name, config in cases(quick):
        if only and only not in name:
            continue
        for backend in BACKENDS:
            config.model.attention = backend
            start = time.perf_counter()
            at = {b: device_bytes(config, b) for b in PER_DEVICE_BATCHES}
            (b1, m1), (b2, m2) = ((b, at[b]["total"]) for b in PER_DEVICE_BATCHES)
            per_example = (m2 - m1) / (b2 - b1)
            fixed = m1 - per_example * b1
            largest = int((DEVICE_GIB * 2**30 - fixed) // per_example) if per_example > 0 else None
            model = nnx.eval_shape(lambda c=config: train.build_model(c.model, jax.random.key(0)))
            tokens = len(model.positions(model.train_grid))  # class token included
            row = dict(
                case=name,
                attention=backend,
                tokens=tokens,
                fixed_bytes=fixed,
                bytes_per_example=per_example,
                largest_batch_per_device=largest,
                at=at,
                compile_s=round(time.perf_counter() - start, 1),
            )
            rows.append(row)
            if out:  # after every row: a long run leaves what it measured
                with open(out, "w") as f:
                    json.dump({"machine": machine, "rows": rows}, f, indent=1)
            print(
                f"  {name:18s} {backend:8s} T={tokens}: fixed {fixed / 2**30:.2f} GiB, "
                f"{per_example / 2**20:.0f} MiB/example, largest batch/device {largest} "
                f"({row['compile_s']} s)",
                flush=True,
            )
    return rows


def table(rows: list[dict]) -> str:
    """A markdown table of the rows."""
    lines = [
        f"| case | tokens | attention | fixed GiB | MiB per example | largest batch per "
        f"{DEVICE_GIB} GiB device |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['tokens']} | {r['attention']} | {r['fixed_bytes'] / 2**30:.2f} "
            f"| {r['bytes_per_example'] / 2**20:.0f} | {r['largest_batch_per_device']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="pico ViT (checks the path)")
    parser.add_argument("--out", default="", help="write the rows as JSON here")
    parser.add_argument("--only", default="", help="only the cases whose name contains this")
    args = parser.parse_args()
    rows = run(args.quick, args.only, args.out)
    print(table(rows))


if __name__ == "__main__":
    main()
