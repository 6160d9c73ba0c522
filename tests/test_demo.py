"""rope_lie/demo.py: the tour measures what its closing line claims, on a smaller grid."""

import pytest

from rope_lie import demo, encodings
from tests.encodings.test_contract import RELATIVE


@pytest.fixture
def small(monkeypatch):
    """4 heads of 12 channels on a 3x3 grid: the same checks, a fraction of the compile time."""
    monkeypatch.setattr(demo, "NUM_HEADS", 4)
    monkeypatch.setattr(demo, "HEAD_DIM", 12)
    monkeypatch.setattr(demo, "GRID", (3, 3))


def test_every_rotary_case_keeps_norms_and_is_relative_where_the_math_says(small):
    for label, name, hparams in demo.CASES:
        result = demo.check_rotary(name, hparams)
        assert result["norm_err"] < 1e-4, (label, result)
        if name in RELATIVE or hparams.get("block_size") == 2:
            assert result["shift_err"] < 1e-5, (label, result)
        else:  # 2D LieRE with blocks > 2: its generators do not commute
            assert result["shift_err"] > 1e-2, (label, result)
        enc = encodings.encoder(
            name, num_heads=demo.NUM_HEADS, head_dim=demo.HEAD_DIM, num_axes=2, **hparams
        )
        assert result["params"] == enc.param_count(), label


def test_the_tour_shows_every_2d_example_of_every_rotary_family():
    names = {name for _, name, _ in demo.CASES}
    assert names == set(encodings.ROTARY) - {"rope"}  # rope is 1D
    assert len(demo.CASES) == sum(
        2 in ranks for m in encodings.ROTARY.values() for _, ranks in m.FAMILY.examples
    )


def test_alibi_bias_is_symmetric_and_shift_invariant(small):
    result = demo.check_alibi()
    assert result == {"params": 0, "symmetric": True, "shift_err": 0.0}


def test_main_prints_a_row_per_case(small, monkeypatch, capsys):
    monkeypatch.setattr(demo, "CASES", demo.CASES[:2])  # the checks themselves are tested above
    demo.main()
    out = capsys.readouterr().out
    for label, _, _ in demo.CASES:
        assert f"\n{label}  " in out, label
    assert "alibi (bias)" in out and "symmetric: True" in out
