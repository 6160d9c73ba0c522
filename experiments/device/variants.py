"""LieRE 8x8's variants (and Circulant-STRING's): the choices a platform does not make by
default, named ``<kind>=<choice>``.

Each kind (``VARIANT_KINDS``) is a per-platform table that rope_lie reads when a program is
traced: the block product, the layer plan, the squaring loop and the form of the exponentials'
small products (LieRE's), and the spectral transform (Circulant-STRING's, ``ENCODER_VARIANTS``).
``variant`` is the context that sets one everywhere (clearing JAX's caches); ``other_variants``
are the choices a platform does not use, ``liere_variants`` those the queue compiles for LieRE
8x8 (with ``COMBINATIONS``, two kinds at once), ``variant_choices`` every kind's choice in a
step.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def every_platform(table: dict, name: str):
    """Trace with every entry of ``table`` (a per-platform choice read when a program is
    traced: ``lie.BLOCK_PRODUCTS``, ``position_hook.LAYER_PLANS``, ``expm.SQUARING_LOOPS``) set
    to ``name``; JAX's caches are cleared on entry and exit, so that programs are traced again."""
    saved = dict(table)
    table.update({k: name for k in saved})
    jax_clear_caches()
    try:
        yield
    finally:
        table.clear()
        table.update(saved)
        jax_clear_caches()


def jax_clear_caches() -> None:
    import jax

    jax.clear_caches()


# LieRE 8x8's variants, each one choice its platform does not make by default, named
# "<kind>=<choice>": kind "product" a block product (``lie.BLOCK_PRODUCTS``), "layers" a layer
# plan (``position_hook.LAYER_PLANS``), "squarings" a squaring loop (``expm.SQUARING_LOOPS``),
# "small_products" how the exponentials' small products are written (``expm.SMALL_PRODUCTS``),
# "backward" how the exponentials' VJP is computed (``expm_combination.COMBINATION_BACKWARDS``).
# Each is a per-platform table read when a program is traced; a variant sets it everywhere.
VARIANT_KINDS = {
    "product": "block product",
    "layers": "layer plan",
    "squarings": "squaring loop",
    "small_products": "small product",
    "spectral": "spectral transform",
    "backward": "combination backward",
}
# The variants of other encoders than LieRE 8x8 the queue compiles on the first backend (right
# after the encoder's own step; a lead encoder's after LieRE 8x8's variants): Circulant-STRING's
# rotation with the real DFT's products instead of the FFT (``lie.SPECTRAL_TRANSFORMS``), and
# dense LieRE's exponentials with the reverse-mode VJP (``COMBINATION_BACKWARDS``; on a CPU it
# was slower than the Frechet one for 64 x 64 blocks, unlike for 8 x 8).
ENCODER_VARIANTS = {
    "liere_dense": ("backward=reverse",),
    "circulant_string": ("spectral=dft",),
}


def variant_table(kind: str) -> dict:
    from rope_lie.encodings import expm, expm_combination, lie
    from rope_lie.models import position_hook

    tables = {
        "backward": expm_combination.COMBINATION_BACKWARDS,
        "product": lie.BLOCK_PRODUCTS,
        "layers": position_hook.LAYER_PLANS,
        "squarings": expm.SQUARING_LOOPS,
        "small_products": expm.SMALL_PRODUCTS,
        "spectral": lie.SPECTRAL_TRANSFORMS,
    }
    return tables[kind]


def split_variant(name: str | None) -> tuple[str, str] | None:
    """(kind, choice) of a variant's name; None for None (the platform's defaults)."""
    if name is None:
        return None
    kind, sep, choice = name.partition("=")
    if not sep or kind not in VARIANT_KINDS:
        raise ValueError(
            f"variant {name!r}: expected '<kind>=<choice>', kind in {list(VARIANT_KINDS)}"
        )
    return kind, choice


def variant_pairs(name: str | None) -> list[tuple[str, str]]:
    """(kind, choice) of each part of a variant's name: several kinds at once are joined by
    commas ("small_products=reduce,squarings=pallas"); [] for None."""
    return [] if name is None else [split_variant(part) for part in name.split(",")]


def variant(name: str | None):
    """The context a variant is traced in (None: the platform's defaults)."""
    stack = contextlib.ExitStack()
    for kind, choice in variant_pairs(name):
        stack.enter_context(every_platform(variant_table(kind), choice))
    return stack


def platform_choice(kind: str, platform: str) -> str:
    """What ``platform`` uses of a variant kind by default."""
    from rope_lie.encodings import expm, expm_combination
    from rope_lie.models import position_hook

    if kind == "backward":
        return expm_combination.combination_backward(platform)
    if kind == "layers":
        return position_hook.layer_plan(platform)
    if kind == "squarings":
        return expm.Host(platform, 1).squaring_loop
    if kind == "small_products":
        return expm.Host(platform, 1).small_products
    table = variant_table(kind)
    # jax.default_backend()'s "gpu" is "cuda" or "rocm" to lax.platform_dependent.
    for key in {"gpu": ("cuda", "rocm")}.get(platform, (platform,)):
        if key in table:
            return table[key]
    return table["default"]


_CHOICES = {
    "product": ("einsum", "broadcast", "adds"),
    "layers": ("each", "batched"),
    "squarings": ("while", "fixed", "pallas"),
    "small_products": ("adds", "reduce"),
    "spectral": ("fft", "dft"),
    "backward": ("frechet", "reverse"),
}


def other_variants(kind: str, platform: str) -> list[str]:
    """The variants of ``kind`` that ``platform`` does not use by default ("by_size" block
    products are the broadcast at 8 x 8, so their other is the einsum; "pallas" squarings only
    where they run, on CPUs in interpret mode and on GPUs: elsewhere they are the "while"
    loop)."""
    default = platform_choice(kind, platform)
    default = "broadcast" if default == "by_size" else default
    others = [c for c in _CHOICES[kind] if c != default]
    if platform not in ("cpu", "gpu"):
        others = [c for c in others if c != "pallas"]
    return [f"{kind}={c}" for c in others]


def other_variant(kind: str, platform: str) -> str:
    """The first of ``other_variants``."""
    return other_variants(kind, platform)[0]


def variant_choices(name: str | None, platform: str) -> dict[str, str]:
    """Every kind's choice in a step traced with variant ``name`` on ``platform``."""
    choices = {kind: platform_choice(kind, platform) for kind in VARIANT_KINDS}
    return choices | dict(variant_pairs(name))


# The pair of choices the H100's profile pointed to together (benchmarks README, section 13): the
# exponentials' backward pass without per-row products of tangents (its batched 8 x 8 dots took
# 5.0 ms of LieRE 8x8's step), and the squarings in one kernel.
COMBINED = "backward=reverse,squarings=pallas"
# Pairs compiled for LieRE 8x8, each right after its parts: ``COMBINED``, then what the H200's
# profiles pointed to (section 13): the reverse-mode VJP took 4.9 ms of GPU work off the step,
# and the "adds" block product is aimed at the 2.0 ms of layout copies of q and k around the
# rotations that remained.
COMBINATIONS = (COMBINED, "backward=reverse,product=adds")


# Variants measured slower on a platform than its defaults: the queue does not compile them on
# that platform unless asked (``--every-variant``), so that its compile stage (12-93 s a ViT-B/16
# step on an H100 machine) has room for what is not yet measured. An entry needs the variant's
# row and the defaults' from the same run, each timed from its encoder's initial state
# (``steps.time_case``), with the figures quoted. None qualifies yet: the H100 runs 11-27-4 and
# 11-28-1 timed each LieRE row from the state the rows before it had trained (their loss fell
# from 5.59 to 2.47, and the squaring loop's trip count follows the generators' norms;
# benchmarks README, section 13), so every variant is compiled and timed again.
MEASURED_SLOWER: dict[str, dict[str, str]] = {"gpu": {}}


def queued(name: str, platform: str, every: bool = False) -> bool:
    """Whether the queue compiles variant ``name`` on ``platform``: unless it was measured
    slower there (``MEASURED_SLOWER``), or always with ``every``."""
    return every or name not in MEASURED_SLOWER.get(platform, {})


def liere_variants(platform: str, every: bool = False) -> list[str]:
    """The LieRE 8x8 variants compiled (and profiled) on ``platform``'s first backend, in this
    order: for each pair of ``COMBINATIONS``, its choices that are not the platform's own and
    then the pair itself where neither is (what the profiles pointed to: first, so that a
    stage cut short by its deadline still has them), then every other choice it does not make
    of the block product, the small products, the layer plan and the squaring loop; without
    those measured slower on ``platform`` (``MEASURED_SLOWER``) unless ``every``."""
    kinds = ("backward", "product", "small_products", "layers", "squarings")
    singles = [v for kind in kinds for v in other_variants(kind, platform)]
    ordered: list[str] = []
    for pair in COMBINATIONS:
        parts = pair.split(",")
        ordered += [v for v in parts if v in singles and v not in ordered]
        ordered += [pair] if all(v in singles for v in parts) else []
    ordered += [v for v in singles if v not in ordered]
    return [v for v in ordered if queued(v, platform, every)]


def variant_label(name: str) -> str:
    """A variant's name in words: "reduce small product, pallas squaring loop"."""
    return ", ".join(f"{choice} {VARIANT_KINDS[kind]}" for kind, choice in variant_pairs(name))
