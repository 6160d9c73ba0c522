"""Stage 5, ``rotations``: ``lie.apply_blocks``'s two block products alone.

At ViT-B/16's shapes (``rotation_shape``), LieRE 8x8's blocks and dense ones: the forward, and
the forward and backward, timed for the "einsum" and the "broadcast" product, and the forward's
error against float64.
"""

from __future__ import annotations

import math
import time

from experiments.device.queue import Queue
from experiments.device.recipes import run_config
from experiments.device.variants import variant


def stage_rotations(q: Queue) -> str:
    import jax.numpy as jnp
    import numpy as np

    batch, heads = q.shapes["rotation_shape"]
    config = run_config(q.recipes, "liere", "xla", q.shapes["overrides"])
    grid = [s // 16 for s in config.model.image_shape]
    tokens = math.prod(grid) + 1
    head_dim = 16 if q.args.dry_run else 64
    rng = np.random.default_rng(0)
    x_np = rng.normal(size=(batch, tokens, heads, head_dim)).astype(np.float32)
    rows = []
    for block in (8, head_dim):
        k = head_dim // block
        # Orthogonal blocks (QR of normal matrices), as rotations are.
        r_np = np.linalg.qr(rng.normal(size=(tokens, heads, k, block, block)))[0]
        r_np = r_np.astype(np.float32)
        want = np.einsum(
            "tnkij,btnkj->btnki",
            r_np.astype(np.float64),
            x_np.astype(np.float64).reshape(batch, tokens, heads, k, block),
        ).reshape(x_np.shape)
        x = jnp.asarray(x_np, jnp.bfloat16)
        r = jnp.asarray(r_np)
        cot = jnp.asarray(rng.normal(size=x_np.shape), jnp.bfloat16)
        for product in ("einsum", "broadcast"):
            if q.left("rotations") <= 0:
                break
            row = {"blocks": f"{block}x{block}", "product": product, "shape_BTNH": list(x_np.shape)}
            try:
                row |= time_product(
                    product, x, jnp.asarray(x_np), r, cot, want, q.shapes["steps"] + 9
                )
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:1000]
            rows.append(row)
            q.data["rotations"] = rows
            q.results.save()
    return f"{len(rows)} cases"


def time_product(product: str, x, x32, r, cot, want, repeats: int) -> dict:
    """``lie.apply_blocks`` with one block product: forward and forward + backward (the VJP
    for both x and r) times on ``x`` (bfloat16), and the forward's error on ``x32``, the same
    values in float32, against ``want`` (float64)."""
    import jax
    import numpy as np

    from rope_lie.encodings import lie

    def forward_backward(x, r):
        return jax.vjp(lie.apply_blocks, x, r)[1](cot)

    with variant(f"product={product}"):
        forward = jax.jit(lie.apply_blocks).lower(x, r).compile()
        both = jax.jit(forward_backward).lower(x, r).compile()
        exact = jax.jit(lie.apply_blocks)(x32, r)
    err = np.max(np.abs(np.asarray(exact, np.float64) - want)) / np.max(np.abs(want))
    return dict(
        forward_ms=_min_ms(lambda: forward(x, r), repeats),
        forward_backward_ms=_min_ms(lambda: both(x, r), repeats),
        rel_err=float(err),
    )


def _min_ms(call, repeats: int) -> float:
    import jax

    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - began)
    return 1e3 * min(times)
