"""Stage 5, ``rotations``: a step's rotations of q and k alone (RoPE-Mixed, LieRE 8x8, dense
LieRE and Circulant-STRING), then LieRE 8x8's exponentials alone, then ``lie.apply_blocks``'s
block products alone.

The exponentials of a step: ``liere.precompute`` of every layer's generators at once (vmapped
over the layers, the accelerators' layer plan) at the recipe's positions, forward and forward
plus backward, with the platform's defaults and with each LieRE variant of the exponentials
(``EXPONENTIAL_VARIANTS``): what a step spends on them, apart from the rest of the step. Then,
at ViT-B/16's shapes (``rotation_shape``), LieRE 8x8's blocks and dense ones: the forward, and
the forward and backward, timed for the "einsum", the "broadcast" and (blocks up to 16) the
"adds" product, and the forward's error against float64.

The rotations of a step (``time_chain``): ``CHAIN`` rotations of q or k at ViT-B/16's shapes
(bfloat16, as the model's), one after the other in one program, with the state's ``rotate``
(the platform's block product) and its gradient to x and to the state, divided by ``CHAIN``: a
rotation's cost inside a step, with no call's dispatch and no host wait in it (the block
products' rows below time one call each, a few tens of microseconds of which are the call),
beside RoPE-Mixed's pair rotation timed the same way; Circulant-STRING's with the FFT and with
the real DFT's products (``lie.SPECTRAL_TRANSFORMS``).
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
    "backward=reverse",
    "squarings=pallas",
    COMBINED,
    "small_products=reduce",
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
    # The chained rotations first: small programs that compile in seconds.
    rng = np.random.default_rng(0)
    x_np = rng.normal(size=(batch, tokens, heads, head_dim)).astype(np.float32)
    chains = []
    for label, name, variant_name in CHAINED:
        if q.left("rotations") <= 0:
            break
        row = {"encoder": label, "shape_BTNH": list(x_np.shape), "chain": CHAIN}
        try:
            st = rotation_state(name, grid, heads, head_dim)
            with variant(variant_name):
                x = jnp.asarray(x_np, jnp.bfloat16)
                row |= time_chain(st, x, q.shapes["steps"] + 9)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:1000]
        chains.append(row)
        base = next((r for r in chains if r["encoder"] == "rope_mixed" and "error" not in r), None)
        for r in chains:
            if base and "error" not in r:
                for k in ("forward", "forward_backward"):
                    r[f"{k}_over_rope_mixed"] = r[f"{k}_us"] / base[f"{k}_us"]
        q.data["chained_rotations"] = chains
        q.results.save()
    # Then the exponentials; the block products, timed on the H100 already, last.
    exponentials = []
    for name in EXPONENTIAL_VARIANTS:
        if q.left("rotations") <= 0:
            break
        choices = variant_choices(name, q.data["platform"])
        row = {"variant": name, "squarings": choices["squarings"]}
        row["small_products"] = choices["small_products"]
        row["backward"] = choices["backward"]
        try:
            row |= time_exponentials(name, config, q.shapes["steps"] + 9)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:1000]
        exponentials.append(row)
        q.data["exponentials"] = exponentials
        q.results.save()
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
        for product in ("einsum", "broadcast", "adds") if block <= 16 else ("einsum", "broadcast"):
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
    return (
        f"{len(rows)} cases, {len(exponentials)} of the exponentials, {len(chains)} chained "
        "rotations"
    )


# A ViT-B/16 step rotates q and k in each of its 12 layers.
CHAIN = 24
# The rotations chained (``time_chain``), (label, encoder, variant), RoPE-Mixed's first: the
# others are given over it. LieRE 8x8 also with its blocks multiplied as multiply-adds (the
# H200's profile: the default broadcast's layout copies of x); Circulant-STRING with its FFT
# and with the real DFT's products.
CHAINED = (
    ("rope_mixed", "rope_mixed", None),
    ("liere", "liere", None),
    ("liere (product=adds)", "liere", "product=adds"),
    ("liere_dense", "liere_dense", None),
    ("circulant_string", "circulant_string", None),
    ("circulant_string (spectral=dft)", "circulant_string", "spectral=dft"),
)


def rotation_state(name: str, grid, heads: int, head_dim: int):
    """The state a layer of encoder ``name`` rotates q and k with (``precompute`` of freshly
    initialised parameters at the grid's positions, the class token at position 0)."""
    import jax

    from rope_lie import encodings
    from rope_lie.encodings import positions

    family, hparams = {
        "rope_mixed": ("rope_mixed", {}),
        "liere": ("liere", {"block_size": 8}),
        "liere_dense": ("liere", {"block_size": head_dim}),
        "circulant_string": ("circulant_string", {}),
    }[name]
    module = encodings.ROTARY[family]
    pos = positions.grid_positions(grid, "integer", num_prefix=1)
    params = module.init(
        jax.random.key(0), num_heads=heads, head_dim=head_dim, num_axes=2, **hparams
    )
    return module.precompute(params, pos, num_heads=heads, head_dim=head_dim, num_prefix=1)


def time_chain(st, x, repeats: int) -> dict:
    """``CHAIN`` rotations ``st.rotate`` of ``x`` one after the other in one program, forward,
    and forward and backward (the VJP to x and to the state), in microseconds per rotation.
    An optimisation barrier after each keeps XLA from fusing neighbours into one pass, which
    a step's attention between them does not allow either."""
    import jax

    def chain(x, st):
        for _ in range(CHAIN):
            x = jax.lax.optimization_barrier(st.rotate(x))
        return x

    def forward_backward(x, st):
        out, pullback = jax.vjp(chain, x, st)
        return pullback(out)

    forward = jax.jit(chain).lower(x, st).compile()
    both = jax.jit(forward_backward).lower(x, st).compile()
    return dict(
        forward_us=1e3 * _min_ms(lambda: forward(x, st), repeats) / CHAIN,
        forward_backward_us=1e3 * _min_ms(lambda: both(x, st), repeats) / CHAIN,
    )


def exponential_programs(
    name, layers: int, heads: int, head_dim: int, grid, block: int = 8, convention=None
):
    """LieRE's rotations of ``layers`` layers from one vmapped ``liere.precompute`` on a grid of
    positions under ``convention`` (None: the device recipe's, ``liere_positions``; the class
    token at position 0), ``liere.init``'s generators in ``block`` x ``block`` blocks:
    (forward, forward and backward to the generators, their parameters), compiled under
    variant ``name`` (None: the platform's defaults). The backward pass's cotangent is fixed
    (normal, seed 1). The positions set the exponentials' norms, and with them the trip count
    of the squaring loop."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rope_lie.encodings import liere, positions

    if convention is None:
        convention = liere_positions(block, head_dim)
    pos = positions.grid_positions(list(grid), convention, num_prefix=1)
    keys = jax.random.split(jax.random.key(0), layers)
    init = jax.vmap(
        lambda k: liere.init(k, num_heads=heads, head_dim=head_dim, num_axes=2, block_size=block)
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
    return forward, both, params


def liere_positions(block: int, head_dim: int) -> str:
    """The position convention of LieRE's device recipe (``experiments/device_recipes.json``):
    LieRE 8x8's, or dense LieRE's where ``block`` is the head size."""
    from experiments.device.recipes import read_recipes

    encoder = "liere_dense" if block == head_dim else "liere"
    return read_recipes()["encoders"][encoder]["model"]["position_convention"]


def time_exponentials(name, config, repeats: int) -> dict:
    """LieRE 8x8's rotations of every layer from one vmapped ``liere.precompute`` (forward, and
    forward and backward to the generators) under variant ``name``, at the model's depth, heads
    and head size and the recipe's positions (``exponential_programs``)."""
    import numpy as np

    from rope_lie.models import variants

    model = config.model
    dims, patch = variants.model_dims(model.variant, model.dims, model.patch_size, rank=2)
    depth, heads = dims["depth"], dims["num_heads"]
    grid = [s // p for s, p in zip(model.image_shape, patch, strict=True)]
    forward, both, params = exponential_programs(
        name, depth, heads, dims["width"] // heads, grid, convention=model.position_convention
    )
    r = np.asarray(forward(params), np.float64)
    # Orthogonality of the rotations: how far R^T R is from the identity.
    eye = np.eye(r.shape[-1])
    orth = float(np.max(np.abs(np.einsum("...ji,...jk->...ik", r, r) - eye)))
    return dict(
        layers=depth,
        shape=list(r.shape),
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
