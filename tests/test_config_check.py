"""rope_lie/config_check.py: the recipes pass; each bad value is named with its valid range."""

import pytest

from rope_lie import config_check, config_lib


def _base():
    config = config_lib.base_config()
    config.model = {"dropout": 0.0}
    return config


@pytest.mark.parametrize("recipe", ["quickstart", "digits", "arrows", "cifar100", "cayley"])
@pytest.mark.parametrize("arg", [None, "smoke"])
def test_every_recipe_passes(recipe, arg):
    import importlib

    config_check.validate(importlib.import_module(f"configs.{recipe}").get_config(arg))


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("optim.lr", float("nan"), "optim.lr=nan: expected a finite number >= 0"),
        ("optim.lr", -1e-3, "optim.lr=-0.001: expected a finite number >= 0"),
        ("optim.lr", float("inf"), "optim.lr=inf"),
        ("total_steps", -5, "total_steps=-5: expected an integer >= 1, or 0 to train num_epochs"),
        ("batch_size", 0, "batch_size=0: expected an integer >= 1"),
        ("eval_batch_size", -1, "eval_batch_size=-1"),
        ("log_every_steps", 0, "log_every_steps=0"),
        ("checkpoint.every_steps", 0, "checkpoint.every_steps=0"),
        ("checkpoint.keep", 0, "checkpoint.keep=0"),
        ("optim.b2", 1.0, "optim.b2=1.0: expected a number in [0, 1)"),
        ("optim.weight_decay", -0.1, "optim.weight_decay=-0.1: expected a finite number >= 0"),
        ("optim.grad_clip", float("nan"), "optim.grad_clip=nan"),
        ("optim.warmup_steps", -1, "optim.warmup_steps=-1: expected an integer >= 0"),
        ("optim.end_lr_ratio", 2.0, "optim.end_lr_ratio=2.0: expected a number in [0, 1]"),
        ("optim.name", "sgd", "optim.name='sgd': expected 'adam' or 'adamw'"),
        ("model.dropout", 1.0, "model.dropout=1.0"),
        ("mesh.data", 0, "mesh.data=0: expected -1 (the remaining devices) or an integer >= 1"),
        ("init_head", "fresh", "init_head='fresh'"),
        ("seed", -1, "seed=-1: expected an integer >= 0"),
        ("data_seed", -2, "data_seed=-2: expected None or an integer >= 0"),
        ("model.norm_eps", -1.0, "model.norm_eps=-1.0: expected a finite number > 0"),
        ("distributed.num_processes", -3, "distributed.num_processes=-3: expected an integer"),
    ],
)
def test_a_bad_value_is_named_with_what_is_expected(key, value, message):
    config = _base()
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
        node = node[part]
    with node.ignore_type():
        node[leaf] = value
    with pytest.raises(ValueError) as raised:
        config_check.validate(config)
    assert message in str(raised.value)


def test_position_augment_is_refused_beside_token_batches():
    import importlib

    recipe = importlib.import_module("configs.fashion_mnist")
    with pytest.raises(ValueError, match="position_augment=.*with naflex or model.patch_dropout"):
        config_check.validate(recipe.get_config("pe=dinov3,rescale=2,naflex"))
    config = recipe.get_config("pe=rope_mixed,rpe=2")
    config_check.validate(config)
    config.model.patch_dropout = 0.25
    with pytest.raises(ValueError, match="augments the positions of image batches only"):
        config_check.validate(config)


def test_total_steps_zero_needs_epochs_and_one_eval_schedule():
    config = _base()
    config.total_steps, config.num_epochs = 0, 0.0
    with pytest.raises(ValueError, match="total_steps=0 and num_epochs=0.0: no steps"):
        config_check.validate(config)
    config = _base()
    config.eval_every_steps, config.eval_every_epochs = 10, 1.0
    with pytest.raises(ValueError, match="set one of them, not both"):
        config_check.validate(config)
    config = _base()
    config.total_steps = 5
    config_check.validate(config)  # a valid config passes


def test_a_warmup_as_long_as_the_run_is_refused_before_it_starts():
    """``--config.total_steps=100`` on the quickstart (warmup 100) would otherwise fail only
    when the optimizer is built; a run sized in epochs is checked there, by the split's size."""
    import importlib

    config = importlib.import_module("configs.quickstart").get_config()
    config.total_steps = 100
    with pytest.raises(ValueError, match="optim.warmup_steps=100 and total_steps=100"):
        config_check.validate(config)
    config.optim.warmup_steps = 99
    config_check.validate(config)


def test_data_shards_that_do_not_divide_the_batch_are_named():
    config = _base()
    config.batch_size, config.data_shards = 8, 3
    with pytest.raises(ValueError, match="data_shards=3 and batch_size=8: each batch is made"):
        config_check.validate(config)
    config.data_shards = 4
    config_check.validate(config)
