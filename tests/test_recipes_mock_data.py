"""The catalogue recipes run a few steps on tfds.testing.mock_data: the recipe's own dataset
name, splits and features, random examples. ImageNet (inception crop, RandAugment, evaluation at
another size), UCF101 (video tubelets) and Cayley-STRING's CIFAR-10 (the "string" ViT) each take
a path of their own; cifar100's is theirs (CIFAR's pipeline with RandAugment: ImageNet's
training path and Cayley's crop; its data on mock data: tests/data/test_pipeline.py).
"""

import pytest
import tensorflow_datasets as tfds

from rope_lie.data import catalog
from tests.test_configs import CATALOGUE, _smoke, get_config


@pytest.mark.parametrize("recipe, arg", CATALOGUE)
def test_catalogue_recipe_runs_on_mock_data(recipe, arg, tmp_path):
    # The recipe's own dataset (name, config, splits) gets metadata with known split sizes, so
    # catalog.prepare finds it prepared and mock_data serves random examples of its features.
    config = get_config(recipe, ",".join(filter(None, [arg, "smoke"])))
    name, tfds_dir = config.dataset.name, str(tmp_path / "tfds")
    splits = {config.dataset.train_split, config.dataset.eval_split}
    splits |= {e.split for e in config.evals.values() if e.split}
    splits = tuple(sorted({s.split("[")[0] for s in splits}))  # "train[:90%]" -> "train"
    catalog.write_mock_metadata(name, tfds_dir, num_examples=16, splits=splits)
    policy = tfds.testing.MockPolicy.USE_FILES
    # Synchronous checkpoints: while as_dataset runs, mock_data swaps in a process-wide mock file
    # system, and a background Orbax save writing at that moment would land in the mock.
    with tfds.testing.mock_data(num_examples=16, data_dir=tfds_dir, policy=policy):
        final = _smoke(recipe, arg, tfds_dir, tmp_path / "work", **{"checkpoint.async_save": False})
    assert final["evals"], recipe
