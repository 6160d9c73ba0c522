"""Stored models keep loading: tiny converted-model workdirs written by an earlier rope_lie.

``tests/fixtures/checkpoints_v1`` holds, for eleven ``pe=`` choices (every family with
parameters or settings that ``apply`` needs), a 2-layer ViT (width 16, 2 heads of 8, 8x8 px
inputs, 4 px patches) saved by ``rope_lie.interop.workdir.save`` before the encoders recorded
their settings, and ``logits.npz``: the logits that code gave on two fixed batches, at the
training size and at 12x12 px. Today's ``rope_lie.load`` must read every one and give the same
logits to float32 rounding (a different compiled program: not bitwise).

``tests/fixtures/workdir_9435363`` holds the ``config.json`` of a training run of commit
9435363, whose dataset section predates ``augment.crop_area_min``: its ``config.py`` must still
give a config the input pipeline and the resume accept.
"""

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import rope_lie

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "checkpoints_v1"
PES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())


def test_the_fixtures_are_there():
    assert len(PES) == 11, PES


@pytest.mark.parametrize("pe", PES)
def test_an_old_checkpoint_gives_its_old_logits(pe):
    stored = np.load(FIXTURES / "logits.npz")
    model, config = rope_lie.load(str(FIXTURES / pe))
    assert config.interop.name == pe
    for images, key in ((stored["images"], pe), (stored["images12"], f"{pe}@12")):
        np.testing.assert_allclose(
            np.asarray(model(jnp.asarray(images))), stored[key], rtol=1e-5, atol=1e-5
        )


def test_a_run_whose_attention_cannot_run_here_loads_with_another(tmp_path):
    """A model trained with cuDNN's attention, loaded on a CPU: refused with what to pass,
    then loaded with ``attention="xla"``, which computes the same attention."""
    import json
    import shutil

    pe = PES[0]
    workdir = tmp_path / pe
    shutil.copytree(FIXTURES / pe, workdir)
    config = json.loads((workdir / "config.json").read_text())
    config["model"]["attention"] = "cudnn"
    (workdir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model.attention='cudnn' needs platform .*'xla'\) loads"):
        rope_lie.load(str(workdir))
    model, _ = rope_lie.load(str(workdir), attention="xla")
    stored = np.load(FIXTURES / "logits.npz")
    np.testing.assert_allclose(
        np.asarray(model(jnp.asarray(stored["images"]))), stored[pe], rtol=1e-5, atol=1e-5
    )


OLD_WORKDIR = pathlib.Path(__file__).parent / "fixtures" / "workdir_9435363"


def _old_workdir(tmp_path):
    """A copy of the config.json of a run of commit 9435363 (configs/digits.py:smoke,pe=liere;
    ``dataset.data_dir`` set to None), beside a checkpoint step folder."""
    import shutil

    workdir = tmp_path / "old"
    (workdir / "checkpoints" / "6").mkdir(parents=True)
    shutil.copy(OLD_WORKDIR / "config.json", workdir / "config.json")
    return str(workdir)


def test_a_workdir_written_before_crop_area_min_resumes_through_its_config_py(tmp_path):
    """The dataset field ``augment.crop_area_min`` came after commit 9435363: its workdir's
    config.py (``run_config.recipe_config``) gives the dataset's default, 0.08, the area
    range that tree's inception crop had; the dataset section passes the pipeline's check and
    the resume's."""
    from rope_lie import run_config
    from rope_lie.data import catalog

    workdir = _old_workdir(tmp_path)
    config = run_config.recipe_config(f"{workdir}/config.py")
    catalog.check_config(config.dataset)
    assert config.dataset.augment.crop_area_min == 0.08
    run_config.check_resume(workdir, config)


def test_a_missing_dataset_field_whose_default_changed_is_refused(tmp_path, monkeypatch):
    """Were the old trees' value of an added field not today's default, the field is not
    filled: the error names the file, the field and both values."""
    from rope_lie import run_config

    monkeypatch.setitem(run_config.ADDED_DATASET_FIELDS, "augment.crop_area_min", 0.5)
    workdir = _old_workdir(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"old/config.json lacks dataset.augment.crop_area_min: .* used 0.5; the default "
        r"for 'sklearn_digits/size8' is 0.08, .*Set dataset.augment.crop_area_min to 0.5",
    ):
        run_config.read(workdir)


def test_a_model_field_of_a_newer_rope_lie_is_named(tmp_path):
    """A config.json written by a newer rope_lie, with a model field this one lacks: the error
    names the field and says where it may come from, not ``ViT.__init__``'s bare TypeError."""
    import json
    import shutil

    workdir = tmp_path / "newer"
    shutil.copytree(FIXTURES / PES[0], workdir)
    config = json.loads((workdir / "config.json").read_text())
    config["model"]["rotary_mode"] = "interleaved"
    (workdir / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"config.model has \['rotary_mode'\], which this rope_lie's ViT does not take: a "
        r"field of a newer rope_lie .* or not a ViT argument",
    ):
        rope_lie.load(str(workdir))


def test_a_converted_model_records_its_model_and_the_old_ones_load_as_before(tmp_path):
    """A directory written by today's ``interop.workdir.save`` records config.model in its
    checkpoint: its config.json edited in a field that keeps the shapes is refused by
    ``rope_lie.load``. The fixtures hold no record: edited alike, they load as before."""
    import json
    import shutil

    from flax import nnx

    from rope_lie.interop import workdir

    def edit(directory):
        config = json.loads((directory / "config.json").read_text())
        config["model"]["position_convention"] = "normalized"
        (directory / "config.json").write_text(json.dumps(config))

    model, config = rope_lie.load(str(FIXTURES / "rope_mixed"))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    saved = tmp_path / "saved"
    workdir.save(str(saved), config, params)
    rope_lie.load(str(saved))
    edit(saved)
    with pytest.raises(
        ValueError,
        match=r"The checkpoint at step 0 in .*/saved/checkpoints was trained with another model "
        r"than this config.model: model.position_convention='integer' there, 'normalized' here",
    ):
        rope_lie.load(str(saved))
    old = tmp_path / "old"
    shutil.copytree(FIXTURES / "rope_mixed", old)
    edit(old)
    rope_lie.load(str(old))
