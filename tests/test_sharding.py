"""Tests for rope_lie/sharding.py.

Multi-device tests run in a subprocess started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the flag must be set before jax is
imported), so the rest of the test session keeps its single CPU device and its speed.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rope_lie import sharding

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "cfg, devices, expected",
    [
        ({"data": -1, "fsdp": 1}, 8, (8, 1)),
        ({"data": 2, "fsdp": -1}, 8, (2, 4)),
        ({"data": -1}, 4, (4, 1)),
        ({"data": 1, "fsdp": 1}, 1, (1, 1)),
    ],
)
def test_mesh_shape_fills_the_rest(cfg, devices, expected):
    assert sharding.mesh_shape(cfg, devices) == expected


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"data": -1, "fsdp": -1}, "At most one"),
        ({"data": 3, "fsdp": -1}, "does not fit 8 devices"),
        ({"data": 2, "fsdp": 2}, "uses 4 devices"),
        ({"data": -1, "model": 2}, "Unknown mesh axes"),
    ],
)
def test_bad_meshes_fail_clearly(cfg, match):
    with pytest.raises(ValueError, match=match):
        sharding.mesh_shape(cfg, 8)


def test_param_rule_shards_largest_divisible_dim_of_big_arrays():
    assert sharding.param_logical_axes((64, 256), 4, 1024) == ("replicated", "fsdp")
    assert sharding.param_logical_axes((256, 256), 4, 1024) == ("fsdp", "replicated")  # tie
    assert sharding.param_logical_axes((6, 255), 4, 0) == ("replicated", "replicated")
    assert sharding.param_logical_axes((64, 8), 4, 1024) == ("replicated", "replicated")  # small
    assert sharding.param_logical_axes((), 4, 0) == ()
    assert sharding.param_logical_axes((64, 256), 1, 0) == ("replicated", "replicated")
    spec = sharding.logical_to_spec(("replicated", "fsdp"))
    assert spec == P(None, "fsdp")
    assert sharding.logical_to_spec(("batch",)) == P(("data", "fsdp"))


def test_single_device_batch_sharding_roundtrip():
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1}, jax.devices()[:1])
    batch = {"image": np.arange(24, dtype=np.float32).reshape(4, 3, 2, 1)}
    out = sharding.shard_batch(batch, mesh)
    np.testing.assert_array_equal(np.asarray(out["image"]), batch["image"])


# One train step (and a second one) of a tiny ViT with dropout on 1 device, on an 8-way data
# mesh and on a 2x4 data x fsdp mesh, from the same initial state and batch. Adam's eps=1 keeps
# the update about linear in the gradient: with eps ~ 0 its first steps are ~ lr * sign(g), which
# turns the float reassociation noise of near-zero gradients (each mesh reduces in another order)
# into differences of order lr.
_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np, ml_collections as mc
    from rope_lie import sharding, train

    config = mc.ConfigDict(dict(
        fsdp_min_size=256,
        model=dict(variant="pico/4", image_shape=(16, 16), channels=3, num_classes=5,
                   pe="rope_mixed", dropout=0.1, pool="mean"),
        optim=dict(name="adamw", lr=1e-1, b1=0.9, b2=0.999, eps=1.0, weight_decay=1e-2,
                   grad_clip=1.0, warmup_steps=0, end_lr_ratio=0.0),
    ))
    rng = np.random.default_rng(0)
    batch_np = {"image": rng.normal(size=(16, 16, 16, 3)).astype(np.float32),
                "label": rng.integers(0, 5, size=16).astype(np.int32)}
    meshes = {"single": ({"data": 1, "fsdp": 1}, jax.devices()[:1]),
              "data8": ({"data": 8, "fsdp": 1}, None),
              "data2_fsdp4": ({"data": 2, "fsdp": 4}, None)}
    out = {}
    for name, (mesh_cfg, devices) in meshes.items():
        mesh = sharding.make_mesh(mesh_cfg, devices)
        with jax.set_mesh(mesh):
            setup, _, init, _ = train.create_setup_and_state(config, mesh, total_steps=10)
            state, other = init(jax.random.key(0))
            step = train.make_train_step(setup)
            losses = []
            for _ in range(2):
                state, m = step(state, sharding.shard_batch(batch_np, mesh), other,
                                jax.random.key(1))
                losses.append(float(m["loss"]))
            leaves = jax.tree_util.tree_leaves_with_path(state["params"])
            specs = sorted({str(x.sharding.spec) for _, x in leaves})
            params = {jax.tree_util.keystr(p): np.asarray(x).tolist() for p, x in leaves}
        out[name] = {"losses": losses, "specs": specs, "params": params}
    json.dump(out, sys.stdout)
    """
)


@pytest.fixture(scope="module")
def eight_device_results():
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags.strip())
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("mesh", ["data8", "data2_fsdp4"])
def test_sharded_train_steps_match_single_device(eight_device_results, mesh):
    single, sharded = eight_device_results["single"], eight_device_results[mesh]
    np.testing.assert_allclose(sharded["losses"], single["losses"], rtol=1e-6)
    assert sharded["params"].keys() == single["params"].keys()
    for key, value in single["params"].items():
        np.testing.assert_allclose(sharded["params"][key], value, atol=1e-5, err_msg=key)


def test_fsdp_mesh_really_shards_params(eight_device_results):
    data8_specs = eight_device_results["data8"]["specs"]
    assert not any("fsdp" in spec or "data" in spec for spec in data8_specs), data8_specs
    fsdp_specs = eight_device_results["data2_fsdp4"]["specs"]
    assert any("fsdp" in spec for spec in fsdp_specs), fsdp_specs


def _main_on_devices(num_devices: int, workdir, *flags: str) -> subprocess.CompletedProcess:
    """`python -m rope_lie.main` on the quickstart's smoke recipe with simulated CPU devices."""
    xla = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={num_devices}"
    env = dict(os.environ, XLA_FLAGS=xla.strip())
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "rope_lie.main", "--config=configs/quickstart.py:smoke"]
    cmd += [f"--workdir={workdir}", "--config.tensorboard=False", "--config.model.variant=pico/8"]
    cmd += list(flags)  # pico/8: the quickstart's path and data on the smallest ViT
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


def test_a_training_batch_that_does_not_split_fails_before_training(tfds_dir, tmp_path):
    data = f"--config.dataset.data_dir={tfds_dir}"
    proc = _main_on_devices(8, tmp_path, data, "--config.batch_size=12")
    assert proc.returncode != 0
    assert "batch_size=12 is not a positive multiple of the 8 devices" in proc.stderr
    assert not os.path.exists(tmp_path / "checkpoints")  # nothing was trained


def test_padded_batch_size_rounds_up_to_the_mesh():
    mesh = sharding.make_mesh({"data": -1}, jax.devices()[:1])
    assert sharding.padded_batch_size(250, mesh) == 250
    sharding.check_batch_size(7, mesh)
    with pytest.raises(ValueError, match=r"batch_size=0 is not a positive multiple of the 1"):
        sharding.check_batch_size(0, mesh)
