"""Step time and model FLOP utilisation per attention backend and encoder, ViT-B/16, one device.

For a GPU or TPU (runs on CPU too, slowly, to check the path). For every attention backend that
``backends.check_attention`` accepts on this platform ("xla", "chunked", and "cudnn" on NVIDIA
GPUs or "pallas" on TPUs) and every encoder, the jitted train step of ``rope_lie/train.py`` (AdamW,
the ImageNet recipe's model: ViT-B/16 at 224 px, bfloat16 activations by default) is compiled,
warmed up and timed over ``--steps`` steps on random images (``--attention`` picks some of
the backends). A case the check refuses (e.g. cuDNN in float32) is listed with its message.

MFU = model FLOPs per step / step time / the device's peak. Model FLOPs are XLA's cost
analysis of the "xla" backend's train step for the same encoder, as lowered: before XLA's
optimisations, which on a GPU turn the matrix products into cuBLAS calls it does not count.
Where the device's own analysis counts no FLOPs (an H200 with jax 0.11.2 returned none), the
same program is lowered for one CPU device and XLA:CPU counts them (``cpu_lowered_flops``).
They are the same arithmetic for every backend: a fused kernel's custom call has no cost XLA
can see, and "chunked" recomputes the logits in its backward pass, which MFU does not count.
The peak is looked up from the device kind (dense bfloat16 TFLOP/s of the datasheets,
``PEAK_TFLOPS``) when ``--dtype`` is bfloat16, or given with ``--peak_tflops``; for another
dtype without ``--peak_tflops`` no MFU is reported (a bfloat16 peak would understate it).

    python -m experiments.benchmarks.device [--batch 64] [--steps 20] [--dtype bfloat16]
        [--encoders nope,rope_mixed,liere,alibi] [--attention xla,cudnn] [--pool cls|mean]
        [--out device.json]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rope_lie import sharding, train
from rope_lie.models import options
from rope_lie.models.backends import BACKENDS

# Dense bfloat16 peak TFLOP/s per device kind (substring of ``jax.devices()[0].device_kind``).
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,  # SXM; the PCIe card is 756
    "A100": 312.0,
    "L4": 121.0,
    "TPU v6": 918.0,
    "TPU v5p": 459.0,
    "TPU v5 lite": 197.0,
    "TPU v5e": 197.0,
    "TPU v4": 275.0,
}
ENCODERS = ("nope", "rope_mixed", "liere", "cayley_string", "circulant_string", "alibi")


def peak_flops(device_kind: str, override: float | None, dtype: str = "bfloat16") -> float | None:
    """The device's peak FLOP/s, or None when unknown and not given. ``PEAK_TFLOPS`` holds
    bfloat16 peaks: for another activation ``dtype`` only ``override`` gives one."""
    if override:
        return override * 1e12
    if dtype != "bfloat16":
        return None
    for key, tflops in PEAK_TFLOPS.items():
        if key.lower() in device_kind.lower():
            return tflops * 1e12
    return None


def backends(platform: str) -> list[str]:
    """The backends that may train on this platform ("xla_cpu" is the evaluation step's)."""
    return [n for n, b in BACKENDS.items() if platform in b.platforms and n != "xla_cpu"]


def make_config(encoder: str, backend: str, dtype: str, variant: str, pool: str = "cls"):
    """The ImageNet recipe's model with this encoder, backend, activation dtype and pooling."""
    from configs import imagenet

    config = imagenet.get_config(f"pe={encoder},variant={variant}")
    config.model.attention = backend
    config.model.dtype = dtype
    config.model.pool = pool
    config.model.dropout = 0.0
    config.mesh.data, config.mesh.fsdp = 1, 1
    return config


def lowered_flops(lowered) -> float:
    """XLA's FLOP count of the program as lowered, before its optimisations: on a GPU the
    compiled program's matrix products are cuBLAS calls whose FLOPs its cost analysis leaves
    out."""
    cost = lowered.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float((cost or {}).get("flops", 0.0))


def abstract_step_args(config, setup, abstract_state, batch: int) -> tuple:
    """Abstract (state, data, other, key) of ``train.make_train_step``'s step for ``batch``
    random images: what ``step.lower`` needs, nothing allocated."""
    model = nnx.eval_shape(lambda: train.build_model(config.model, jax.random.key(0)))
    other = nnx.split(model, nnx.Param, ...)[2]
    data = {
        "image": jax.ShapeDtypeStruct(
            (batch, *config.model.image_shape, config.model.channels), jnp.float32
        ),
        "label": jax.ShapeDtypeStruct((batch,), jnp.int32),
    }
    key = jax.eval_shape(lambda: jax.random.key(1))
    return abstract_state, data, other, key


def cpu_lowered_flops(config, batch: int) -> float:
    """The train step's FLOPs as XLA:CPU's cost analysis counts the program lowered for one CPU
    device (abstract arguments: nothing is allocated or compiled)."""
    mesh = sharding.make_mesh(config.mesh, jax.devices("cpu")[:1])
    setup, abstract_state, _, _ = train.create_setup_and_state(config, mesh, 1000)
    args = abstract_step_args(config, setup, abstract_state, batch)
    return lowered_flops(train.make_train_step(setup).lower(*args))


def random_batch(config, batch: int, mesh) -> dict:
    """``batch`` random images (N(0, 1)) and labels, split over the mesh as the loop's are."""
    shape = (batch, *config.model.image_shape, config.model.channels)
    rng = np.random.default_rng(0)
    return sharding.shard_batch(
        {
            "image": rng.normal(size=shape).astype(np.float32),
            "label": rng.integers(0, config.model.num_classes, size=batch).astype(np.int32),
        },
        mesh,
    )


def time_compiled(compiled, state, data, other, key, steps: int, warmup: int = 2):
    """``warmup`` untimed calls of a compiled train step, then ``steps`` timed ones, each
    waited for, then ``steps`` more dispatched back to back and waited for once.

    A step waited for pays the host's dispatch of its program as well as the device's work;
    a training loop dispatches the next step while the device runs this one, so the steps
    timed back to back are its throughput (``step_ms_pipelined``: their wall time over
    ``steps``).

    Returns:
      ({"step_ms_min", "step_ms_median", "step_ms_pipelined", "loss"}, the state after the
      last call: the step donates its input state, so the caller continues with this one).
    """
    for _ in range(warmup):
        state, m = compiled(state, data, other, key)
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, m = compiled(state, data, other, key)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(steps):
        state, m = compiled(state, data, other, key)
    jax.block_until_ready((state, m))
    pipelined = time.perf_counter() - start
    timing = dict(
        step_ms_min=1e3 * min(times),
        step_ms_median=1e3 * float(np.median(times)),
        step_ms_pipelined=1e3 * pipelined / steps,
        loss=float(m["loss"]),
    )
    return timing, state


def time_step(config, batch: int, steps: int) -> dict:
    """Compile and time the train step; its XLA FLOP count per step."""
    devices = jax.devices()[:1]
    mesh = sharding.make_mesh(config.mesh, devices)
    setup, _, init, _ = train.create_setup_and_state(config, mesh, 1000)
    state, other = init(jax.random.key(0))
    data = random_batch(config, batch, mesh)
    step = train.make_train_step(setup)
    key = jax.random.key(1)
    start = time.perf_counter()
    lowered = step.lower(state, data, other, key)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    timing, _ = time_compiled(compiled, state, data, other, key, steps)
    return dict(timing, compile_s=compile_s, xla_flops=lowered_flops(lowered))


def run(args) -> list[dict]:
    platform = jax.default_backend()
    kind = jax.devices()[0].device_kind
    peak = peak_flops(kind, args.peak_tflops, args.dtype)
    print(f"device: {kind} ({platform}), {args.dtype} peak {peak and peak / 1e12} TFLOP/s")
    if peak is None and args.dtype != "bfloat16":
        print(f"  no MFU: PEAK_TFLOPS is bfloat16's; give --peak_tflops for {args.dtype}")
    rows = []
    for encoder in args.encoders.split(","):
        model_flops = None
        for backend in backends(platform):
            if args.attention and backend not in args.attention.split(","):
                continue
            config = make_config(encoder, backend, args.dtype, args.variant, args.pool)
            row = dict(
                device=kind,
                encoder=encoder,
                attention=backend,
                batch=args.batch,
                dtype=args.dtype,
                pool=args.pool,
            )
            try:
                options.check_model_attention(config.model, platform)
            except ValueError as e:
                rows.append(row | dict(skipped=str(e)))
                print(f"  {encoder:16s} {backend:8s} skipped: {e}", flush=True)
                continue
            row |= time_step(config, args.batch, args.steps)
            if backend == "xla":
                model_flops = row["xla_flops"] or cpu_lowered_flops(config, args.batch)
            row["model_flops"] = model_flops
            seconds = row["step_ms_min"] / 1e3
            row["mfu"] = model_flops / seconds / peak if (model_flops and peak) else None
            row["images_per_s"] = args.batch / seconds
            rows.append(row)
            mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f} %"
            print(
                f"  {encoder:16s} {backend:8s} {row['step_ms_min']:8.1f} ms "
                f"(median {row['step_ms_median']:.1f}, back to back "
                f"{row['step_ms_pipelined']:.1f}), {row['images_per_s']:.0f} img/s, "
                f"MFU {mfu}, compile {row['compile_s']:.0f} s",
                flush=True,
            )
    return rows


def table(rows: list[dict]) -> str:
    """A markdown table of the rows."""
    lines = [
        "| encoder | attention | step ms (min / median) | images/s | MFU |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['encoder']} | {r['attention']} | skipped: {r['skipped']} | | |")
            continue
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f} %"
        lines.append(
            f"| {r['encoder']} | {r['attention']} | {r['step_ms_min']:.1f} / "
            f"{r['step_ms_median']:.1f} | {r['images_per_s']:.0f} | {mfu} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="images per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--dtype", default="bfloat16", help="activation dtype")
    parser.add_argument("--variant", default="B", help="ViT variant (patch 16 from the recipe)")
    parser.add_argument("--encoders", default=",".join(ENCODERS))
    parser.add_argument(
        "--attention",
        default="",
        help="backends to time, e.g. 'xla,cudnn' (default: all this platform runs; MFU: 'xla')",
    )
    parser.add_argument("--pool", default="cls", help="'cls' (197 tokens) or 'mean' (196)")
    parser.add_argument("--peak_tflops", type=float, default=None, help="device peak TFLOP/s")
    parser.add_argument("--out", default="", help="write the rows as JSON here")
    args = parser.parse_args()
    rows = run(args)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
