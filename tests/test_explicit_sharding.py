"""Explicit mesh axes (``jax.make_mesh``'s default) under ``jax.set_mesh``: every rotary family,
ALiBi, the ViT and a train step run on a batch split over 8 simulated CPU devices, keep the
batch split in their outputs, and compute what they compute on one device.

Every rotary family is tested on its own; the ViT and the train step once per way a state
reaches the attention (``VIT_CALLS``), since the model treats every family of one state type
alike.

One subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the flag must be set
before jax is imported; tests/test_sharding.py does the same) runs every case and prints one
JSON line; the tests read it. Each case compares against the same call outside the mesh on
unsharded inputs (float32 rounding: the programs differ).
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (id, family, init hparams): every rotary family, and LieRE on each of its code paths: 2x2
# closed form (b = 2), the closed-form exponential of blocks up to 4 (b = 4), and the
# Taylor-combination exponential of larger blocks with leftover channels (b = 5 of 12 channels;
# a dense generator, b = 12, takes that exponential and block product without the leftover).
# Keys of the hparams that start with "_" are the case's options, not the family's: "_squarings"
# runs LieRE's squarings in that loop (expm.SQUARING_LOOPS; "pallas" is the Pallas kernel in
# interpret mode here), "_spectral" Circulant-STRING's rotation with that transform
# (lie.SPECTRAL_TRANSFORMS): options the device queue times on GPUs.
ROTARY_CASES = [
    ("nope", "nope", {}),
    ("rope_axial", "rope_axial", {}),
    ("rope_mixed", "rope_mixed", {}),
    ("visionllama", "visionllama", {}),
    ("liere_b4", "liere", {"block_size": 4}),
    ("liere_b2", "liere", {"block_size": 2}),
    ("liere_b5_partial", "liere", {"block_size": 5, "partial_blocks": True}),
    ("liere_b6_pallas", "liere", {"block_size": 6, "_squarings": "pallas"}),
    ("cayley_string", "cayley_string", {"init_std": 0.1}),
    ("circulant_string", "circulant_string", {}),
    ("circulant_string_dft", "circulant_string", {"_spectral": "dft"}),
    ("comrope", "comrope", {"block_size": 4}),
    ("dinov3", "dinov3", {}),
]
# 1D RoPE on 1D positions (the others run in 2D).
ROTARY_1D = [("rope", "rope", {})]
# Shared positions (T, A); per-example positions (B, T, A) split over the batch as x is; and
# per-example positions whole on every device beside a split x.
POSITIONS = ["shared", "per_example", "per_example_whole"]
HOW = ["apply", "precompute_rotate"]
# The ViT with one encoder per kind of state (encodings/state.py): none (NoPE), pair angles
# (RoPE-Mixed; the fixed-frequency families and LieRE b = 2 make the same state), pair angles
# after a P folded into the q/k projections (Cayley-STRING; ComRoPE's state is the same kind),
# block rotations (LieRE), spectral phases (circulant STRING), a logit bias (ALiBi) and an added
# table (APE). Each on images ("forward": shared positions) and on token batches ("tokens":
# per-example positions and masks). The gradient where the parameters take their own way
# back: the ViT's own (NoPE), the fold into the projections with RoPE-Mixed's angles (Cayley),
# the spectral phases, the bias and the added table; LieRE's is the train step's
# (TRAIN_MESHES).
_BOTH = ("forward", "tokens")
_WITH_GRADIENT = ("forward", "tokens", "gradient")
VIT_CALLS = {
    "nope": _WITH_GRADIENT,
    "rope_mixed": _BOTH,
    "cayley_string": _WITH_GRADIENT,
    "liere": _BOTH,
    # the accelerators' layer plan: every layer's state from one vmapped precompute
    # (position_hook.LAYER_PLANS "batched"; the CPU's own is "each"), with the squarings' loop
    # of fixed length first (expm.SQUARING_LOOPS "fixed", the option the device queue times)
    "liere_batched": _WITH_GRADIENT,
    # 8x8 blocks (pico's 16 channels a head): the exponentials' Taylor combination and its VJP,
    # the Frechet one (every platform's default) and the reverse-mode one
    # (expm_combination.COMBINATION_BACKWARDS, the option the device queue times on GPUs)
    "liere_b8": _WITH_GRADIENT,
    "liere_b8_reverse": _WITH_GRADIENT,
    "circulant_string": _WITH_GRADIENT,
    "alibi": _WITH_GRADIENT,
    "ape": _WITH_GRADIENT,
    "sincos": _BOTH,  # a fixed table: zero prefix rows split like the batch
}
# One train step of rope_lie/train.py (LieRE, dropout on) on an Explicit mesh against the same
# step on the loop's Auto mesh: a batch split over two mesh axes and parameters split over
# fsdp (the ViT cases above split the batch over one axis, with whole parameters).
TRAIN_MESHES = {"data2_fsdp4": (2, 4)}

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np, ml_collections as mc
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from rope_lie import encodings, sharding, train
    from rope_lie.encodings import expm, expm_combination, lie, liere, positions
    from rope_lie.models import ViT, position_hook

    cases = json.loads(sys.argv[1])
    mesh = jax.make_mesh((8,), ("data",))  # the default axis types: Explicit
    assert mesh.axis_types == (jax.sharding.AxisType.Explicit,), mesh.axis_types
    split = NamedSharding(mesh, P("data"))
    B, N, H = 8, 3, 12
    out = {"rotary": {}, "alibi": {}, "vit": {}, "train": {}}

    def record(section, key, fn, *args):
        # fn under the mesh on split arrays, against fn outside it on numpy arrays.
        ref = jax.jit(fn)(*jax.device_get(args))
        try:
            with jax.set_mesh(mesh):
                got = jax.jit(fn)(*args)
                spec = jax.typeof(jax.tree.leaves(got)[0]).sharding.spec
        except Exception as e:  # reported by the case's test
            out[section][key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            return
        err = max(
            float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(r, np.float64))))
            for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True)
        )
        scale = max(float(np.max(np.abs(np.asarray(r)))) for r in jax.tree.leaves(ref))
        out[section][key] = {"batch_axes": spec[0] if len(spec) else None,
                             "rel_err": err / max(scale, 1e-30)}

    def retrace_liere():  # LieRE's jitted functions read the squaring loop when traced
        for fn in (liere._rotations, expm_combination._combination_jit, expm._expm_skew_jit):
            fn.clear_cache()

    for case_id, family, hp, rank in cases["rotary"]:
        expm.SQUARING_LOOPS["cpu"] = hp.pop("_squarings", "while")
        lie.SPECTRAL_TRANSFORMS["cpu"] = hp.pop("_spectral", "fft")
        retrace_liere()
        module = encodings.ROTARY[family]
        params = module.init(jax.random.key(0), num_heads=N, head_dim=H, num_axes=rank, **hp)
        pos_TA = positions.grid_positions({1: (7,), 2: (3, 4)}[rank], "integer", num_prefix=1)
        pos_BTA = np.stack([np.asarray(pos_TA) + b for b in range(B)])
        x = jax.device_put(np.random.default_rng(1).normal(size=(B, len(pos_TA), N, H)), split)
        kw = {k: hp[k] for k in module.APPLY_HPARAMS if k in hp}
        for pos_name, pos in (("shared", np.asarray(pos_TA)),
                              ("per_example", jax.device_put(pos_BTA, split)),
                              ("per_example_whole", pos_BTA)):
            apply = lambda p, x, q: module.apply(p, x, q, **kw)
            rotate = lambda p, x, q: module.precompute(
                p, q, num_heads=N, head_dim=H, **kw).rotate(x)
            for how, fn in (("apply", apply), ("precompute_rotate", rotate)):
                record("rotary", f"{case_id}-{pos_name}-{how}", fn, params, x, pos)

    alibi = encodings.BIAS["alibi"]
    params = alibi.init(jax.random.key(0), num_heads=N, head_dim=H, num_axes=2, learnable=True)
    pos_TA = np.asarray(positions.grid_positions((3, 4), "integer", num_prefix=1))
    pos_BTA = jax.device_put(np.stack([pos_TA + b for b in range(B)]), split)
    for name, fn in (
        ("bias", lambda p, q: alibi.bias(p, q, q, num_heads=N, num_prefix=1)),
        ("precompute", lambda p, q: alibi.precompute(
            p, q, num_heads=N, head_dim=H, num_prefix=1).bias_BNTS),
        ("slope_gradient", lambda p, q: jax.grad(
            lambda p: jnp.sum(alibi.bias(p, q, q, num_heads=N, num_prefix=1) ** 2))(p)),
    ):
        record("alibi", name, fn, params, pos_BTA)

    expm.SQUARING_LOOPS["cpu"] = "while"
    lie.SPECTRAL_TRANSFORMS.pop("cpu")
    retrace_liere()

    images = np.random.default_rng(0).normal(size=(B, 8, 12, 3)).astype(np.float32)
    for case, wanted in cases["vit"].items():
        gpu, reverse, b8 = (s in case for s in ("_batched", "_reverse", "_b8"))
        pe = case.split("_b8")[0].removesuffix("_batched")
        position_hook.LAYER_PLANS["cpu"] = "batched" if gpu else "each"
        expm.SQUARING_LOOPS["cpu"] = "fixed" if gpu else "while"
        expm_combination.COMBINATION_BACKWARDS["cpu"] = "reverse" if reverse else "frechet"
        retrace_liere()
        kw = dict(variant="pico/4", image_shape=(8, 12), channels=3, num_classes=5,
                  head_zero_init=False)
        hp = {"liere": {"block_size": 8 if b8 else 4}, "alibi": {"learnable": True},
              "cayley_string": {"init_std": 0.1}, "comrope": {"block_size": 4}}.get(pe)
        additive = pe in ("ape", "sincos")
        kw |= dict(pe="nope", additive=pe) if additive else dict(pe=pe, pe_hparams=hp)
        graphdef, state = nnx.split(ViT(**kw, rngs=nnx.Rngs(0)))
        token_batch = nnx.merge(graphdef, state).image_tokens(jnp.asarray(images))
        loss = lambda s, x: jnp.mean(nnx.merge(graphdef, s)(x) ** 2)
        calls = {
            "forward": (lambda s, x: nnx.merge(graphdef, s)(x), images),
            "tokens": (lambda s, t: nnx.merge(graphdef, s).classify_tokens(t), token_batch),
            # The gradient's leaves are parameters: whole on every device, so only its
            # values are compared (its batch_axes is None).
            "gradient": (jax.grad(loss), images),
        }
        for call in wanted:
            fn, data = calls[call]
            record("vit", f"{case}-{call}", fn, state, jax.device_put(data, split))
    position_hook.LAYER_PLANS["cpu"] = "each"
    expm.SQUARING_LOOPS["cpu"] = "while"
    expm_combination.COMBINATION_BACKWARDS.pop("cpu")
    retrace_liere()

    # One train step of rope_lie/train.py on an Explicit mesh and on the loop's Auto mesh.
    config = mc.ConfigDict(dict(
        fsdp_min_size=256,
        model=dict(variant="pico/4", image_shape=(16, 16), channels=3, num_classes=5,
                   pe="liere", pe_hparams={"block_size": 4}, dropout=0.1, pool="mean"),
        optim=dict(name="adamw", lr=1e-1, b1=0.9, b2=0.999, eps=1.0, weight_decay=1e-2,
                   grad_clip=1.0, warmup_steps=0, end_lr_ratio=0.0),
    ))
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(16, 16, 16, 3)).astype(np.float32),
             "label": rng.integers(0, 5, size=16).astype(np.int32)}
    for name, shape in cases["train"].items():
        results = {}
        for kind, mesh_ in (("auto", sharding.make_mesh(dict(zip(sharding.MESH_AXES, shape)))),
                            ("explicit", jax.make_mesh(shape, sharding.MESH_AXES))):
            try:
                with jax.set_mesh(mesh_):
                    setup, _, init, _ = train.create_setup_and_state(config, mesh_, 10)
                    state, other = init(jax.random.key(0))
                    state, m = train.make_train_step(setup)(
                        state, sharding.shard_batch(batch, mesh_), other, jax.random.key(1))
            except Exception as e:  # reported by the mesh's test
                results[kind] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                continue
            results[kind] = {
                "axis_types": [t.name for t in mesh_.axis_types],
                "loss": float(m["loss"]),
                "params": [np.asarray(x).tolist() for x in jax.tree.leaves(state["params"])],
            }
        out["train"][name] = results
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def explicit_results():
    cases = {
        "rotary": [(i, f, hp, 2) for i, f, hp in ROTARY_CASES]
        + [(i, f, hp, 1) for i, f, hp in ROTARY_1D],
        "vit": VIT_CALLS,
        "train": TRAIN_MESHES,
    }
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags.strip())
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _rotary_ids():
    return [
        f"{case_id}-{pos}-{how}"
        for case_id, _, _ in ROTARY_CASES + ROTARY_1D
        for pos in POSITIONS
        for how in HOW
    ]


@pytest.mark.parametrize("key", _rotary_ids())
def test_rotary_families_keep_the_batch_split(explicit_results, key):
    row = explicit_results["rotary"][key]
    assert "error" not in row, row["error"]
    assert row["batch_axes"] == "data", row
    # LieRE's exponentials of positions up to 10 differ by up to 5e-6 of the largest value
    # between the two programs (measured); a lost or doubled example would differ by O(1).
    assert row["rel_err"] < 3e-5, row


@pytest.mark.parametrize("name", ["bias", "precompute"])
def test_alibi_bias_of_split_positions_is_split(explicit_results, name):
    row = explicit_results["alibi"][name]
    assert "error" not in row, row["error"]
    assert row["batch_axes"] == "data", row
    assert row["rel_err"] < 1e-5, row


def test_alibi_slope_gradient_of_split_positions(explicit_results):
    assert "error" not in explicit_results["alibi"]["slope_gradient"]
    assert explicit_results["alibi"]["slope_gradient"]["rel_err"] < 1e-5


@pytest.mark.parametrize(
    "pe, call", [(pe, call) for pe, calls in VIT_CALLS.items() for call in calls]
)
def test_vit_under_explicit_axes(explicit_results, pe, call):
    row = explicit_results["vit"][f"{pe}-{call}"]
    assert "error" not in row, row["error"]
    if call != "gradient":
        assert row["batch_axes"] == "data", row  # logits (B, V) split as the images
    assert row["rel_err"] < 1e-5, row


@pytest.mark.parametrize("mesh", list(TRAIN_MESHES))
def test_train_step_on_explicit_axes_matches_auto(explicit_results, mesh):
    auto, explicit = (explicit_results["train"][mesh][k] for k in ("auto", "explicit"))
    assert "error" not in auto and "error" not in explicit, (auto, explicit)
    assert auto["axis_types"] == ["Auto", "Auto"]
    assert explicit["axis_types"] == ["Explicit", "Explicit"]
    assert abs(explicit["loss"] - auto["loss"]) < 1e-6
    for got, want in zip(explicit["params"], auto["params"], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
