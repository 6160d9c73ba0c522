"""positions.py: conventions, token order, prefix tokens and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie.encodings import positions


def test_integer_grid_is_row_major_with_prefix_at_zero():
    pos = np.asarray(positions.grid_positions((2, 3), "integer", num_prefix=1))
    expected = [[0, 0], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    np.testing.assert_array_equal(pos, expected)


def test_sequential_spans_zero_one_at_train_grid_and_grows():
    at_train = np.asarray(positions.grid_positions((4,), "sequential"))[:, 0]
    np.testing.assert_allclose(at_train, np.linspace(0, 1, 4))
    bigger = np.asarray(positions.grid_positions((8,), "sequential", train_grid=(4,)))[:, 0]
    np.testing.assert_allclose(bigger, np.linspace(0, 2, 8))


def test_normalized_is_a_fixed_range_at_every_resolution():
    for n in (3, 9):
        pos = np.asarray(positions.grid_positions((n, n), "normalized"))
        assert pos.min() == -1.0 and pos.max() == 1.0


def test_autoscale_keeps_the_anchor_range():
    pos = np.asarray(positions.grid_positions((8, 4), "autoscale", anchor_grid=(4, 4)))
    np.testing.assert_allclose(np.unique(pos[:, 0]), np.arange(8) * 0.5)
    np.testing.assert_allclose(np.unique(pos[:, 1]), np.arange(4))


def test_3d_shape_and_axis_order():
    pos = np.asarray(positions.grid_positions((2, 3, 4), "integer"))
    assert pos.shape == (24, 3)
    np.testing.assert_array_equal(pos[1], [0, 0, 1])  # last axis varies fastest
    np.testing.assert_array_equal(pos[4], [0, 1, 0])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"grid_shape": (2, 2, 2, 2)}, r"rank 1, 2 or 3"),
        ({"grid_shape": (0, 3)}, r"positive integers"),
        ({"grid_shape": (3, 3), "convention": "polar"}, r"'polar'.*expected one of"),
        ({"grid_shape": (3, 3), "num_prefix": -1}, r"num_prefix=-1"),
        ({"grid_shape": (3, 3), "convention": "sequential", "train_grid": (3,)}, r"rank 1"),
        ({"grid_shape": (3,), "convention": "normalized", "value_range": (1, 0)}, r"lo < hi"),
        (
            {"grid_shape": (2, 3, 3), "temporal_spacing": 2.0},
            r"temporal_spacing=2.0 is the 'diagonal' convention's; got convention='integer'",
        ),
        (
            {"grid_shape": (2, 3, 3), "convention": "diagonal", "temporal_spacing": 0},
            r"temporal_spacing=0 must be a positive finite number",
        ),
        (
            {"grid_shape": (2, 3, 3), "convention": "diagonal", "temporal_spacing": float("nan")},
            r"temporal_spacing=nan must be a positive finite number",
        ),
    ],
)
def test_errors_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        positions.grid_positions(**kwargs)


@pytest.mark.parametrize("convention", positions.CONVENTIONS)
@pytest.mark.parametrize("grid", [(1, 5), (3, 4), (6, 2), (2, 3, 4)])
def test_index_positions_are_grid_positions_per_example(convention, grid):
    """Traceable positions from (index, grid) equal grid_positions of each example's grid."""
    ref = (4,) * len(grid)
    index_TA = positions.grid_indices(grid)
    got = positions.index_positions(
        index_TA[None], np.asarray([grid]), convention, train_grid=ref, anchor_grid=ref
    )
    expected = positions.grid_positions(grid, convention, train_grid=ref, anchor_grid=ref)
    np.testing.assert_allclose(got[0], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("grid", [(2, 3, 4), (3, 1, 6)])
def test_index_positions_are_grid_positions_for_a_diagonal_with_spacing(grid):
    """The traced centres floor((n - 1) / 2) and delta: each example of a batch at its grid."""
    grids = np.asarray([grid, (1, 2, 2)])
    index_BTA = np.stack([positions.grid_indices(grid)] * 2)
    index_BTA[1] = np.minimum(index_BTA[1], grids[1] - 1)  # inside the second example's grid
    got = positions.index_positions(index_BTA, grids, "diagonal", temporal_spacing=2.5)
    for b in range(2):
        expected = positions.grid_positions(tuple(grids[b]), "diagonal", temporal_spacing=2.5)
        rows = np.ravel_multi_index(index_BTA[b].T, tuple(grids[b]))
        np.testing.assert_array_equal(got[b], np.asarray(expected)[rows])
    with pytest.raises(ValueError, match="temporal_spacing=2.5 is the 'diagonal'"):
        positions.index_positions(index_BTA, grids, "centred", temporal_spacing=2.5)


def test_convention_hparams_are_checked_against_the_convention():
    assert positions.check_hparams("diagonal", {"temporal_spacing": 2.0}) == {
        "temporal_spacing": 2.0
    }
    assert positions.check_hparams("integer", None) == {}
    with pytest.raises(ValueError, match=r"\['temporal_spacing'\].*'centred' does not take"):
        positions.check_hparams("centred", {"temporal_spacing": 2.0})
    with pytest.raises(ValueError, match="unknown position convention 'spiral'"):
        positions.check_hparams("spiral", {})


@pytest.mark.parametrize(
    "grid",
    [
        jnp.array([4, 3]),
        np.array([4, 3], np.uint8),
        np.array([4, 3], np.int64),
        (jnp.int32(4), np.int16(3)),
        [4, 3],
    ],
    ids=["jax_int32", "numpy_uint8", "numpy_int64", "scalars", "list"],
)
def test_a_concrete_integer_array_is_a_grid(grid):
    """Integer arrays (numpy or JAX, any integer dtype) and integer scalars give the grid of
    the same Python ints: the positions and indices of (4, 3)."""
    np.testing.assert_array_equal(
        positions.grid_positions(grid, "centred", num_prefix=1),
        positions.grid_positions((4, 3), "centred", num_prefix=1),
    )
    np.testing.assert_array_equal(positions.grid_indices(grid), positions.grid_indices((4, 3)))
    ref = positions.index_positions(
        positions.grid_indices((4, 3)), np.asarray([4, 3]), "sequential", train_grid=grid
    )
    np.testing.assert_allclose(ref, positions.grid_positions((4, 3), "sequential"), atol=1e-6)


@pytest.mark.parametrize(
    "grid, match",
    [
        ((4, 4.5), r"grid_shape=\(4, 4.5\) holds 4.5; expected 1 to 3 positive integers"),
        (jnp.array([4.0, 4.0]), r"holds 4.0 \(float32\); expected 1 to 3 positive integers"),
        ((True, 3), r"holds the boolean True; expected"),
        (np.array([True, True]), r"holds the boolean True \(bool\); expected"),
        ((0, 3), r"grid_shape=\(0, 3\) holds 0; expected 1 to 3 positive integers"),
        (np.array([3, -1]), r"holds -1; expected"),
        (jnp.array([[2, 2]]), r"has 2 dims; expected"),
        (4, r"grid_shape=4 is not a sequence; expected"),
        ((2, 2, 2, 2), r"rank 1, 2 or 3"),
    ],
)
def test_an_invalid_grid_is_named_with_what_was_expected(grid, match):
    with pytest.raises(ValueError, match=match):
        positions.grid_positions(grid)


def test_a_traced_grid_is_refused_naming_it():
    """A grid sets the token count, so it must be static: under jit, an array or an entry that
    is traced is an error saying so (not jax's ConcretizationTypeError from deep inside)."""
    with pytest.raises(ValueError, match=r"grid_shape=.*is a traced value: a grid is static"):
        jax.jit(positions.grid_positions)(jnp.array([2, 2]))
    with pytest.raises(ValueError, match=r"holds a traced value .*: a grid is static"):
        jax.jit(lambda n: positions.grid_positions((n, 2)))(2)


def test_grid_indices_row_major():
    np.testing.assert_array_equal(
        positions.grid_indices((2, 3))[:4], [[0, 0], [0, 1], [0, 2], [1, 0]]
    )


def test_index_positions_errors():
    with pytest.raises(ValueError, match="needs its reference grid"):
        positions.index_positions(np.zeros((1, 2, 2), int), np.ones((1, 2)), "sequential")
    with pytest.raises(ValueError, match="unknown position convention 'x'"):
        positions.index_positions(np.zeros((1, 2, 2), int), np.ones((1, 2)), "x")
    # a token batch's coordinates between grid cells would be positions nobody asked for
    with pytest.raises(TypeError, match="integer grid coordinates, got dtype float32"):
        positions.index_positions(np.full((1, 2, 2), 0.5, np.float32), np.ones((1, 2)), "integer")


@pytest.mark.parametrize("convention", ["integer", "sequential"])
def test_randomize_draws_a_sorted_subset_of_a_larger_grids_positions(convention):
    """RPE-2D: per axis, n sorted distinct indices of the round(scale n) of a larger grid, each
    token at the position the convention gives that index there; prefix tokens at 0."""
    grid, scale = (3, 5), 2.0
    wide = positions.randomized_grid(grid, scale)
    assert wide == (6, 10)
    full = np.asarray(positions.grid_positions(wide, convention, train_grid=grid))
    full_rows, full_cols = full[:, 0].reshape(wide)[:, 0], full[:, 1].reshape(wide)[0]
    seen_rows, seen_cols = set(), set()
    for seed in range(40):
        pos = np.asarray(
            positions.randomize(
                jax.random.key(seed), grid, convention, scale=scale, num_prefix=2, train_grid=grid
            )
        )
        assert pos.shape == (2 + 15, 2) and np.all(pos[:2] == 0)
        rows, cols = pos[2:, 0].reshape(grid), pos[2:, 1].reshape(grid)
        assert np.all(rows == rows[:, :1]) and np.all(cols == cols[:1])
        rows, cols = rows[:, 0], cols[0]
        assert np.all(np.diff(rows) > 0) and np.all(np.diff(cols) > 0)
        assert set(rows) <= set(full_rows) and set(cols) <= set(full_cols)
        seen_rows |= set(rows)
        seen_cols |= set(cols)
    assert seen_rows == set(full_rows) and seen_cols == set(full_cols)  # every index reachable


def test_randomize_at_scale_1_is_the_usual_grid():
    got = positions.randomize(jax.random.key(0), (4, 3), "integer", scale=1.0, num_prefix=1)
    np.testing.assert_array_equal(got, positions.grid_positions((4, 3), "integer", num_prefix=1))
    with pytest.raises(ValueError, match="randomize=0.5 must be None or a number >= 1"):
        positions.randomized_grid((4, 3), 0.5)
