"""Stage 5, ``rotations``: LieRE 8x8's exponentials alone, then ``lie.apply_blocks``'s two block
products alone.

The exponentials of a step: ``liere.precompute`` of every layer's generators at once (vmapped
over the layers, the accelerators' layer plan) at the recipe's positions, forward and forward
plus backward, with the platform's defaults and with each LieRE variant of the exponentials
(``EXPONENTIAL_VARIANTS``): what a step spends on them, apart from the rest of the step. Then,
at ViT-B/16's shapes (``rotation_shape``), LieRE 8x8's blocks and dense ones: the forward, and
the forward and backward, timed for the "einsum" and the "broadcast" product, and the
forward's error against float64.
"""

from __future__ import annotations

import math
import time

from experiments.device.queue import Queue
from experiments.device.recipes import run_config
from experiments.device.variants import COMBINED, variant, variant_choices

# The variants of the exponentials timed alone, beside the platform's defaults (None).
EXPONENTIAL_VARIANTS = (
    None,
    "small_products=reduce",
    "squarings=pallas",
    COMBINED,
    "squarings=fixed",
)


def stage_rotations(q: Queue) -> str:
    import jax.numpy as jnp
    import numpy as np

    batch, heads = q.shapes["rotation_shape"]
    config = run_config(q.recipes, "liere", "xla", q.shapes["overrides"])
    grid = [s // 16 for s in config.model.image_shape]
    tokens = math.prod(grid) + 1
    head_dim = 16 if q.args.dry_run else 64
    # The exponentials first: the block products were timed on the H100 already.
    exponentials = []
    for name in EXPONENTIAL_VARIANTS:
        if q.left("rotations") <= 0:
            break
        choices = variant_choices(name, q.data["platform"])
        row = {"variant": name, "squarings": choices["squarings"]}
        row["small_products"] = choices["small_products"]
        try:
            row |= time_exponentials(name, config, q.shapes["steps"] + 9)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:1000]
        exponentials.append(row)
        q.data["exponentials"] = exponentials
        q.results.save()
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
    return f"{len(rows)} cases, {len(exponentials)} of the exponentials"


def time_exponentials(name, config, repeats: int) -> dict:
    """LieRE 8x8's rotations of every layer from one vmapped ``liere.precompute`` (forward, and
    forward and backward to the generators) under variant ``name``, at the model's depth, heads
    and head size and the recipe's positions (the class token at position 0)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rope_lie.encodings import liere, positions
    from rope_lie.models import variants

    model = config.model
    dims, patch = variants.model_dims(model.variant, model.dims, model.patch_size, rank=2)
    depth, heads = dims["depth"], dims["num_heads"]
    head_dim = dims["width"] // heads
    grid = [s // p for s, p in zip(model.image_shape, patch, strict=True)]
    pos = positions.grid_positions(grid, "integer", num_prefix=1)
    keys = jax.random.split(jax.random.key(0), depth)
    init = jax.vmap(
        lambda k: liere.init(k, num_heads=heads, head_dim=head_dim, num_axes=2, block_size=8)
    )
    params = init(keys)

    def rotations(params):
        def one(p):
            return liere.precompute(p, pos, num_heads=heads, head_dim=head_dim, num_prefix=1)

        return jax.vmap(one)(params).r_TNKbb

    out_shape = jax.eval_shape(rotations, params)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=out_shape.shape), jnp.float32)

    def forward_backward(params):
        return jax.vjp(rotations, params)[1](cot)

    with variant(name):
        forward = jax.jit(rotations).lower(params).compile()
        both = jax.jit(forward_backward).lower(params).compile()
        r = np.asarray(forward(params), np.float64)
    # Orthogonality of the rotations: how far R^T R is from the identity.
    eye = np.eye(r.shape[-1])
    orth = float(np.max(np.abs(np.einsum("...ji,...jk->...ik", r, r) - eye)))
    return dict(
        layers=depth,
        shape=list(out_shape.shape),
        forward_ms=_min_ms(lambda: forward(params), repeats),
        forward_backward_ms=_min_ms(lambda: both(params), repeats),
        orthogonality_error=orth,
    )


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
