"""Every recipe in configs/ builds its model, names valid datasets and fits 4 and 8 devices; bad
configs fail clearly. Which tests run the recipes end to end: see ``CATALOGUE`` below.
"""

import functools
import glob
import importlib
import inspect
import json
import os
import sys
from unittest import mock

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds
from flax import nnx

from rope_lie import config_lib as common
from rope_lie import train
from rope_lie.data import catalog
from rope_lie.encodings import cayley_string
from rope_lie.models import vit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = [
    ("quickstart", ""),
    ("quickstart", "pe=ape"),
    ("arrows", "pe=rope_mixed"),
    ("arrows", "pe=liere,block=64,res=paper"),
    ("digits", ""),
    ("digits", "pe=ape"),
    ("arrows", "pe=visionllama_liere"),
    ("arrows3d", "pe=liere,block=8"),
    ("arrows3d", "pe=visionllama_liere"),
    ("cifar100", "pe=liere,block=8"),
    ("cifar100", "pe=visionllama"),
    ("imagenet", "pe=rope_mixed"),
    ("imagenet", "pe=ape,finetune,init_from=/nonexistent/run"),
    ("ucf101", "pe=liere"),
    ("cayley", "dataset=cifar10,generator=dense"),
    ("cayley", "dataset=cifar10,generator=topk,k=24"),
    ("cayley", "dataset=mnist,generator=banded,bw=4"),
    ("cayley", "dataset=mnist,generator=block2x2"),
    ("fashion_mnist", "pe=liere,block=8"),
    ("cayley", "dataset=fashion_mnist,generator=banded,bw=2"),
    ("fashion_mnist", "pe=cayley_string,generator=block2x2,scale_aug"),
    ("arrows", "pe=rope_mixed,naflex"),
    ("arrows", "pe=liere,mixed_grids"),
    ("digits", "naflex,min_side=2,max_side=5"),
    ("fashion_mnist", "pe=alibi,naflex"),
    ("fashion_mnist", "pe=rope_axial,extrapolation_evals,rpe=2"),
]
# End-to-end runs of the recipes, one per distinct path through data and model: the catalogue
# recipes on mock data (tests/test_recipes_mock_data.py), digits in tests/test_train.py and
# tests/test_naflex_train.py, arrows in tests/test_finetune.py, fashion_mnist in
# tests/test_fashion_mnist_idx.py; the quickstart's own smoke run is .ci/run's first step (LieRE
# mu/8 on spatial_arrows at three grids, shuffled patches). Every recipe's model, config keys and
# datasets are checked without training below.
CATALOGUE = [("imagenet", ""), ("ucf101", ""), ("cayley", "dataset=cifar10")]


def get_config(recipe: str, arg: str):
    return importlib.import_module(f"configs.{recipe}").get_config(arg)


def count_params(config) -> int:
    model = nnx.eval_shape(lambda: train.build_model(config.model, jax.random.key(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_the_liere_papers_baselines_are_what_its_code_ran():
    # "RoPE-Mixed" in the LieRE paper: LieRE with 2x2 blocks, LieRE's init and positions.
    mixed = get_config("arrows", "pe=liere,block=2").model
    assert (mixed.pe, dict(mixed.pe_hparams), mixed.position_convention) == (
        "liere",
        dict(block_size=2),
        "sequential",
    )
    # Heo et al.'s RoPE-Mixed stays its own arm, on patch indices.
    heo = get_config("arrows", "pe=rope_mixed").model
    assert (heo.pe, heo.position_convention) == ("rope_mixed", "integer")
    # "VisionLlama" in the LieRE paper: its fixed tiled rotation on [0, 1] positions.
    vl = get_config("arrows", "pe=visionllama_liere").model
    assert (vl.pe, dict(vl.pe_hparams), vl.position_convention) == (
        "visionllama",
        dict(variant="liere"),
        "sequential",
    )
    assert get_config("arrows", "pe=visionllama").model.pe_hparams.to_dict() == {}


def test_the_model_config_is_the_vits_keyword_arguments():
    fields = common.pe_fields("liere")
    model = common.model_config(
        variant="mu", image_shape=(8, 8), channels=1, num_classes=2, **fields
    )
    vit_args = set(inspect.signature(vit.ViT.__init__).parameters) - {"self", "rngs"}
    assert set(model) == vit_args - {"patch_size"}  # None: the variant's patch
    with_patch = common.model_config(
        variant="mu", patch_size=2, image_shape=(8, 8), channels=1, num_classes=2, **fields
    )
    assert set(with_patch) == vit_args and with_patch.patch_size == 2


@pytest.mark.parametrize(
    "recipe, std", [("arrows", 1.0), ("cifar100", 1.0), ("imagenet", 1.0), ("quickstart", 0.02)]
)
def test_ape_init_std_follows_the_recipes_reference(recipe, std):
    config = get_config(recipe, "pe=ape")
    assert config.model.additive_hparams.init_std == std
    model = nnx.eval_shape(lambda: train.build_model(config.model, jax.random.key(0)))
    grid_GD = model.additive_params["grid_GD"]  # the table the model builds, drawn here alone
    table = vit.init_additive_params(
        "ape",
        nnx.Rngs(0),
        grid_GD.shape[:-1],
        grid_GD.shape[-1],
        1,
        config.model.additive_hparams.to_dict(),
    )
    values = np.concatenate([np.ravel(v[...]) for v in table.values()])
    assert abs(values.std() / std - 1) < 0.05
    assert get_config(recipe, "pe=ape,ape_std=0.5").model.additive_hparams.init_std == 0.5
    assert get_config(recipe, "pe=liere").model.additive_hparams.to_dict() == {}


def test_imagenet_finetune_is_the_papers_second_recipe():
    c = get_config("imagenet", "pe=liere,finetune,init_from=/runs/liere8_224")
    assert c.init_from == "/runs/liere8_224" and c.model.image_shape == (256, 256)
    assert (c.optim.lr, c.num_epochs, c.dataset.image_size) == (1e-5, 30.0, 256)
    assert {"val192", "val224", "val256", "val320", "val384", "val448"} <= set(c.evals)
    with pytest.raises(ValueError, match="finetune needs init_from"):
        get_config("imagenet", "finetune")


def test_arrows_init_scale_is_lieres_and_only_lieres():
    assert get_config("arrows", "pe=liere,block=2,init_scale=1").model.pe_hparams.init_scale == 1
    assert "init_scale" not in get_config("arrows", "pe=liere").model.pe_hparams  # 2 pi default
    with pytest.raises(ValueError, match=r"init_scale=1.0 is for pe=liere, not pe=ape"):
        get_config("arrows", "pe=ape,init_scale=1")


def test_digits_takes_the_cayley_generators_and_the_string_vit():
    model = get_config("digits", "pe=cayley_string,generator=topk,k=24,variant=string").model
    assert model.variant == "string" and model.pe_hparams.to_dict() == dict(
        generator="topk", k=24, init_std=common.TOPK_INIT_STD
    )
    assert count_params(get_config("digits", "pe=cayley_string,generator=banded,bw=2")) > 0


@pytest.mark.parametrize("pe", ["ape", "sincos", "alibi", "rope_mixed", "visionllama_liere"])
def test_digits_accepts_every_pe_and_keeps_normalized_positions(pe):
    model = get_config("digits", f"pe={pe}").model
    assert model.position_convention == "normalized"
    assert model.additive == (pe if pe in ("ape", "sincos") else "none")
    assert count_params(get_config("digits", f"pe={pe}")) > 0


@pytest.mark.parametrize("recipe, arg", RECIPES)
def test_recipe_builds_its_full_size_model(recipe, arg):
    config = get_config(recipe, arg)
    assert count_params(config) > 0
    config.lock()  # what main does: every key must already exist
    assert config.dataset.name and config.evals


@pytest.mark.parametrize("smoke", [False, True])
@pytest.mark.parametrize("recipe, arg", RECIPES)
def test_recipe_datasets_are_valid(recipe, arg, smoke):
    # The training data's settings pass the pipeline's checks, and every evaluation names a
    # dataset that TFDS or this project can build (a misspelt name raises here).
    config = get_config(recipe, ",".join(filter(None, [arg, "smoke" if smoke else ""])))
    catalog.check_config(config.dataset)
    for entry in config.evals.values():
        tfds.builder(entry.name or config.dataset.name, data_dir="/nonexistent")


def test_paper_model_sizes():
    # LieRE paper: ViT-B, 85.2 M parameters for 2D tasks (plus the head and encoder params).
    assert 85e6 < count_params(get_config("cifar100", "pe=rope_mixed")) < 86.5e6
    # Sparse Cayley-STRING study: 0.116-0.118 M parameters on CIFAR-10 (Table 1).
    for generator in ("dense", "block2x2", "banded", "topk"):
        n = count_params(get_config("cayley", f"dataset=cifar10,generator={generator}"))
        assert 0.110e6 < n < 0.125e6, (generator, n)


def test_fashion_naflex_evals_off_keeps_every_fixed_size_evaluation():
    """`naflex_evals=false` drops only the NaFlex evaluations (the token path at the px grids),
    and changes nothing else in the run."""
    on = get_config("fashion_mnist", "pe=liere,naflex")
    off = get_config("fashion_mnist", "pe=liere,naflex,naflex_evals=false")
    naflex_evals = {n for n in on.evals if "naflex_side" in on.evals[n]}
    assert naflex_evals == {"naflex_s05", "naflex_s07", "naflex_s09", "naflex_s11", "naflex_s14"}
    fixed_size = set(get_config("fashion_mnist", "pe=liere").evals)
    assert set(off.evals) == set(on.evals) - naflex_evals == fixed_size
    for name in off.evals:
        assert off.evals[name].to_dict() == on.evals[name].to_dict(), name
    del on.evals, off.evals
    assert on.to_dict() == off.to_dict()


@pytest.mark.parametrize("dataset", ["cifar10", "mnist"])
def test_topk_recipes_start_from_a_random_generator(dataset):
    """From S = 0, top_k would keep the first k entries forever: the recipes draw S."""
    hparams = get_config("cayley", f"dataset={dataset},generator=topk").model.pe_hparams
    assert hparams["init_std"] > 0

    @jax.jit  # one program, not dozens of single ops
    def generator(key):
        params = cayley_string.init(key, num_heads=4, head_dim=12, num_axes=2, **hparams)
        return cayley_string.generator(params, k=hparams["k"])

    mask = np.asarray(generator(jax.random.key(0))) != 0
    assert mask[0].sum() >= hparams["k"]  # k entries kept, and their transposes
    first_k = np.zeros(12 * 12, bool)  # what top_k picks from all-equal scores
    first_k[np.flatnonzero(~np.eye(12, dtype=bool).ravel())[: hparams["k"]]] = True
    assert not np.array_equal(mask[0].ravel(), first_k | first_k.reshape(12, 12).T.ravel())


def _smoke(recipe, arg, tfds_dir, workdir, **overrides):
    config = get_config(recipe, ",".join(filter(None, [arg, "smoke"])))
    config.dataset.data_dir = tfds_dir
    config.update_from_flattened_dict(overrides)
    final = train.train_and_evaluate(config, str(workdir))
    assert final["step"] == config.total_steps
    for name, res in final["evals"].items():
        assert np.isfinite(res["loss"]) and 0 <= res["accuracy"] <= 1, (name, res)
    return final


def _digits(tfds_dir, **model):
    config = get_config("digits", "smoke")
    config.dataset.data_dir = tfds_dir
    config.model.update(model)
    return config


@pytest.mark.parametrize(
    "model, error, match",
    [
        (dict(pe="fourier"), ValueError, "unknown pe='fourier'"),
        (
            dict(pe="liere", pe_hparams=dict(block_size=64)),
            ValueError,
            r"block_size=64 .*head_dim=16",
        ),
        (dict(patch_size=3), ValueError, r"not divisible by patch_size=\(3, 3\)"),
        (dict(image_shape=(16, 16)), ValueError, "does not match dataset"),
    ],
)
def test_bad_model_configs_fail_clearly(tfds_dir, tmp_path, model, error, match):
    with pytest.raises(error, match=match):
        train.train_and_evaluate(_digits(tfds_dir, **model), str(tmp_path))


def test_missing_catalogue_dataset_says_how_to_prepare_it(tmp_path):
    config = get_config("cifar100", "smoke")
    config.dataset.data_dir = str(tmp_path)
    with pytest.raises(FileNotFoundError, match="tfds build cifar100"):
        train.train_and_evaluate(config, str(tmp_path / "work"))


def test_unknown_recipe_argument_fails_clearly():
    with pytest.raises(ValueError, match="Unknown config argument 'pee'"):
        get_config("quickstart", "pee=liere")
    with pytest.raises(ValueError, match="res='huge'"):
        get_config("arrows", "res=huge")
    with pytest.raises(ValueError, match="not a boolean"):
        common.parse_arg("smoke=maybe", smoke=False)
    with pytest.raises(ValueError, match=r"epochs='ten' is not a float \(its default is 3.0\)"):
        get_config("fashion_mnist", "epochs=ten")


# Arguments that used to be dropped or overridden without a word: the config was the one
# without them (or, for pe twice and smoke, another one than asked for).
SILENT = [
    ("quickstart", "pe=rope_mixed,pe=ape", "'pe' is given twice"),
    ("quickstart", "pe=rope_mixed,block=8", "block=8 does nothing here: it needs pe=liere"),
    ("fashion_mnist", "pe=liere,ape_std=0.02", "ape_std=0.02 does nothing here: it needs pe=ape"),
    ("digits", "pe=liere,generator=banded", "generator='banded' does nothing"),
    ("digits", "pe=cayley_string,bw=3", "needs pe=cayley_string,generator=banded"),
    ("digits", "pe=cayley_string,generator=dense,k=5", "needs pe=cayley_string,generator=topk"),
    ("fashion_mnist", "pe=ape,rotary_fraction=1.0", "rotary_fraction=1.0 does nothing here"),
    ("fashion_mnist", "pe=ape,rescale=2", "rescale=2.0 does nothing here"),
    ("fashion_mnist", "pe=sincos,rpe=2", "rpe=2.0 does nothing here"),
    ("fashion_mnist", "min_side=4", "min_side=4 does nothing here: it needs naflex"),
    ("arrows", "max_side=9", "max_side=9 does nothing here: it needs naflex"),
    ("imagenet", "init_from=/a/run", "init_from='/a/run' does nothing here: it needs finetune"),
    ("fashion_mnist", "smoke,epochs=50", "epochs=50.0 does nothing here: it needs smoke and"),
    ("arrows", "smoke,steps=100", "steps=100 does nothing here: it needs smoke off"),
    ("fashion_mnist", "plateau,epochs=5", "epochs=5.0 does nothing here"),
    ("arrows3d", "steps=0", "steps=0: expected a positive number of training steps"),
]


@pytest.mark.parametrize("recipe, arg, match", SILENT, ids=[f"{r}:{a}" for r, a, _ in SILENT])
def test_an_argument_that_would_do_nothing_is_refused(recipe, arg, match):
    with pytest.raises(ValueError, match=match):
        get_config(recipe, arg)


@pytest.mark.parametrize(
    "recipe, arg",
    [
        ("quickstart", "pe=liere,block=4"),
        ("digits", "pe=comrope,block=4"),
        ("digits", "pe=cayley_string,generator=banded,bw=3"),
        ("fashion_mnist", "pe=ape,ape_std=0.02"),
        ("fashion_mnist", "pe=rope_mixed,rotary_fraction=0.5,rescale=2"),
        ("fashion_mnist", "naflex,min_side=4"),
        ("fashion_mnist", "pe=liere,epochs=5"),
        ("arrows", "steps=100"),
    ],
)
def test_the_same_arguments_where_they_act_are_taken(recipe, arg):
    assert get_config(recipe, arg).model.pe


# ml_collections' config_flags loads a recipe file with importlib's deprecated load_module().
@pytest.mark.filterwarnings("ignore:the load_module\\(\\) method is deprecated:DeprecationWarning")
def test_every_recipe_loads_by_path_from_any_directory(tmp_path, monkeypatch):
    """What --config=/abs/path/configs/<recipe>.py:<arg> does in another directory: absl loads
    the file by path, and only the installed package is importable (not the repository root,
    not configs/). Running a loaded recipe is what every end-to-end test does."""
    from absl import flags
    from ml_collections import config_flags

    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p) != REPO])
    for name in [m for m in sys.modules if m == "configs" or m.startswith("configs.")]:
        monkeypatch.delitem(sys.modules, name)  # imported by the tests above
    monkeypatch.chdir(tmp_path)
    recipes = sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))
    cayley = os.path.join(REPO, "configs", "cayley.py")
    assert cayley in recipes
    for spec in [f"{path}:smoke" for path in recipes] + [f"{cayley}:dataset=cifar10,smoke"]:
        flag_values = flags.FlagValues()
        config_flags.DEFINE_config_file("config", None, flag_values=flag_values)
        flag_values(["main", f"--config={spec}"])
        assert flag_values.config.model.variant and flag_values.config.dataset.name, spec


@pytest.mark.parametrize("devices", [4, 8])
@pytest.mark.parametrize("recipe, arg", RECIPES)
def test_every_recipe_and_its_smoke_fit_4_and_8_devices(recipe, arg, devices):
    """Issue 15: the quickstart trained, then died evaluating on 4 devices. Every recipe's
    training batch splits over 4 and 8 devices (checked before step 1 by the same function),
    and its eval batches pad to them. End to end: tests/test_sharding.py (quickstart on 8
    devices), tests/test_multiprocess.py (2 processes x 2 devices)."""
    from rope_lie import sharding

    mesh = type("Mesh", (), {"shape": {"data": devices, "fsdp": 1}})()
    for smoke in (False, True):
        config = get_config(recipe, ",".join(filter(None, [arg, "smoke" if smoke else ""])))
        sharding.check_batch_size(config.batch_size, mesh)
        padded = sharding.padded_batch_size(config.eval_batch_size, mesh)
        assert padded % devices == 0 and 0 <= padded - config.eval_batch_size < devices


def _parsed(recipe, arg, *overrides):
    """The recipe's config as ``rope_lie.main`` reads it: absl's ``--config`` flag and overrides."""
    from absl import flags
    from ml_collections import config_flags

    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=flag_values)
    path = os.path.join(REPO, "configs", f"{recipe}.py")
    argv = ["main", f"--config={path}:{arg}" if arg else f"--config={path}", *overrides]
    with mock.patch.object(sys, "argv", argv):  # config_flags reads the overrides there
        flag_values(argv)
    return flag_values.config


@pytest.mark.parametrize(
    "recipe, arg, overrides, expected",
    [
        ("quickstart", "", [], {"eval_every_steps": 250}),
        ("quickstart", "", ["--config.total_steps=100"], {"eval_every_steps": 50}),
        (
            "quickstart",
            "",
            ["--config.eval_every_steps=100", "--config.total_steps=400"],
            {"eval_every_steps": 100},
        ),
        ("arrows", "", ["--config.total_steps=300"], {"eval_every_steps": 150}),
        ("cayley", "", [], {"optim.warmup_steps": 468, "checkpoint.every_steps": 468}),
        (
            "cayley",
            "dataset=cifar10",
            ["--config.batch_size=512"],
            {"optim.warmup_steps": 97, "checkpoint.every_steps": 97},
        ),
        (
            "cayley",
            "",
            ["--config.optim.warmup_steps=10", "--config.batch_size=512"],
            {"optim.warmup_steps": 10, "checkpoint.every_steps": 117},
        ),
    ],
)
@pytest.mark.filterwarnings("ignore:the load_module\\(\\) method is deprecated:DeprecationWarning")
def test_fields_a_recipe_derives_follow_the_command_lines_overrides(
    recipe, arg, overrides, expected
):
    """A recipe's "half-way" evaluation or "one epoch" of warmup is a reference to the field it
    comes from, so an override of that field moves it (an overridden ``total_steps`` would
    otherwise keep an evaluation step past the end, a larger batch a warmup of 40 % of the
    run); the derived field's own override wins; config.json holds the values."""
    config = _parsed(recipe, arg, *overrides)
    written = json.loads(config.to_json_best_effort())
    for key, value in expected.items():
        assert functools.reduce(lambda tree, name: tree[name], key.split("."), config) == value
        assert functools.reduce(lambda tree, name: tree[name], key.split("."), written) == value
