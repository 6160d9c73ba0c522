"""Stage 8, ``packing``: NaFlex train steps on padded against packed batches (issue 45).

For each encoder of ``PACKED_ENCODERS`` on "xla", one batch of images of random sides
(``naflex_batches``), padded one image a row to the full grid and packed greedily into rows of
as many tokens, the same images: each step compiled and timed, and its time over the padded
one's.
"""

from __future__ import annotations

from experiments.device.compile_stage import _compile, host_init
from experiments.device.queue import Queue
from experiments.device.recipes import run_config

PACKED_ENCODERS = ("rope_mixed", "liere")  # stage 8, in this order


def naflex_batches(
    grid: tuple[int, ...], patch: tuple[int, ...], channels: int, batch: int, num_classes: int
) -> dict[str, tuple[dict, float, int]]:
    """One batch of random square images of sides uniform in [grid / 2, grid] patches, as a
    padded NaFlex batch and packed: case -> (host arrays, padding fraction, rows)."""
    import numpy as np

    from rope_lie.evaluate import PACKED_KEYS, TOKEN_KEYS
    from rope_lie.models import tokens

    rng = np.random.default_rng(0)
    high = grid[0]
    low = max(1, high // 2)
    sides = rng.integers(low, high + 1, batch)
    images = [
        rng.normal(size=(s * patch[0], s * patch[1], channels)).astype(np.float32) for s in sides
    ]
    labels = rng.integers(0, num_classes, batch).astype(np.int32)
    length = high * high
    padded = tokens.pack(images, patch, length)
    real = float(padded.mask_BT.sum())
    packed, place = tokens.pack_images(images, patch, length, max(1, length // low**2))
    return {
        "padded": (
            {**dict(zip(TOKEN_KEYS, padded, strict=True)), "label": labels},
            1 - real / padded.mask_BT.size,
            batch,
        ),
        "packed": (
            {
                **dict(zip(PACKED_KEYS, packed, strict=True)),
                "image_row": place[:, 0],
                "image_slot": place[:, 1],
                "label": labels,
            },
            1 - real / packed.segment_BT.size,
            packed.segment_BT.shape[0],
        ),
    }


def packing_case(q: Queue, encoder: str, batches: dict) -> dict:
    """Lower and compile the train step of each case of ``batches`` (in the pool, at once)."""
    import jax

    from rope_lie import sharding, train

    config = run_config(q.recipes, encoder, "xla", q.shapes["overrides"])
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
    setup, _, _, _ = train.create_setup_and_state(config, mesh, 1000)
    state, other = host_init(config, None, setup)(jax.random.key(0))
    step = train.make_train_step(setup)
    key = jax.random.key(1)
    futures = {}
    for case, (host, _, _) in batches.items():
        data = sharding.shard_batch(host, mesh)
        lowered = step.lower(state, data, other, key)
        futures[case] = (q.pool.submit(_compile, {"lowered": lowered}), data)
    return {"state": state, "other": other, "key": key, "futures": futures}


def stage_packing(q: Queue) -> str:
    import jax
    from flax import nnx

    from experiments.benchmarks import device as bench
    from rope_lie import train

    q.data["packing"] = rows = []
    timed = 0
    for encoder in PACKED_ENCODERS:
        config = run_config(q.recipes, encoder, "xla", q.shapes["overrides"])
        model = nnx.eval_shape(
            lambda config=config: train.build_model(config.model, jax.random.key(0))
        )
        images = q.shapes["packing_batch"]
        batches = naflex_batches(
            model.train_grid, model.patch, config.model.channels, images, config.model.num_classes
        )
        base = dict(
            encoder=encoder, attention="xla", images=images, tokens=model.train_grid[0] ** 2
        )
        own = [base | dict(case=c, rows=r, padding_fraction=f) for c, (_, f, r) in batches.items()]
        rows += own
        if q.left("packing") <= 0:
            for r in own:
                r["skipped"] = "no time left in the packing stage"
            continue
        try:
            prepared = packing_case(q, encoder, batches)
        except Exception as e:
            for r in own:
                r["error"] = f"{type(e).__name__}: {e}"[:1000]
            continue
        state = prepared["state"]
        for r in own:
            future, data = prepared["futures"][r["case"]]
            try:
                case = future.result(timeout=max(1.0, q.left("packing")))
                timing, state = bench.time_compiled(
                    case["compiled"],
                    state,
                    data,
                    prepared["other"],
                    prepared["key"],
                    q.shapes["steps"],
                    warmup=q.shapes["warmup"],
                )
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {e}"[:1000]
                continue
            r.update(
                step_ms=timing["step_ms_min"],
                step_ms_median=timing["step_ms_median"],
                step_ms_pipelined=timing["step_ms_pipelined"],
                compile_s=round(case["compile_s"], 1),
                loss=timing["loss"],
            )
            timed += 1
        padded = own[0].get("step_ms")
        for r in own:
            if padded and r.get("step_ms"):
                r["time_over_padded"] = r["step_ms"] / padded
        q.results.save()
    return f"{timed} NaFlex steps timed"
