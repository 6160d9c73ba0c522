"""Extrapolation tools (encodings/extrapolation.py): NTK and YaRN against their formulas written
here in float64 numpy and against HuggingFace transformers' numbers; per-axis factors; PI as a
change of positions for every family; YaRN on RoPE-Mixed's learned table; the q/k scale of
YaRN's attention factor and of logit scaling; errors."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rope_lie import encodings
from rope_lie.encodings import extrapolation as ex
from rope_lie.encodings import positions, rope_mixed, state
from tests.encodings.reference import normal

# Numbers from HuggingFace transformers 5.24.0 (torch 2.14.1, CPU, float32),
# src/transformers/modeling_rope_utils.py, computed with a LlamaConfig(head_dim=dim,
# max_position_embeddings=L, rope_parameters=...):
# - NTK: `_compute_dynamic_ntk_parameters(config, seq_len=int(s * L))` with
#   rope_parameters=dict(rope_type="dynamic", factor=1.0, rope_theta=base), whose base at s times
#   the length is base * s ** (dim / (dim - 2)), the NTK-aware base;
# - YaRN: `_compute_yarn_parameters(config)` with rope_parameters=dict(rope_type="yarn",
#   factor=s, original_max_position_embeddings=L, rope_theta=base) (beta_fast 32, beta_slow 1,
#   truncate True, the defaults).
# Rows: (dim, base, L, s, attention_factor, inv_freq).
HF_NTK = [
    (8, 100.0, 7, 2.0, 1.0, [1.0, 0.2509901523590088, 0.06299605220556259, 0.015811389312148094]),
    (
        16,
        10000.0,
        14,
        4.0,
        1.0,
        [
            1.0,
            0.25941282510757446,
            0.06729500740766525,
            0.01745718903839588,
            0.0045286184176802635,
            0.0011747815879061818,
            0.0003047533973585814,
            7.905694656074047e-05,
        ],
    ),
    (
        64,
        10000.0,
        2048,
        8.0,
        1.0,
        [
            1.0,
            0.701242208480835,
            0.4917406737804413,
            0.3448293209075928,
            0.2418089061975479,
            0.16956660151481628,
            0.11890726536512375,
            0.08338279277086258,
            0.05847154185175896,
            0.04100271314382553,
            0.028752831742167473,
            0.02016269974410534,
            0.014138937927782536,
            0.009914820082485676,
            0.00695269089192152,
            0.004875520244240761,
            0.0034189207945019007,
            0.0023974915966391563,
            0.0016812224639579654,
            0.0011789441341534257,
            0.0008267254452221096,
            0.0005797347985208035,
            0.0004065345274284482,
            0.000285079178865999,
            0.00019990955479443073,
            0.0001401850167894736,
            9.830365888774395e-05,
            6.893467798363417e-05,
            4.8339905333705246e-05,
            3.389798803254962e-05,
            2.3770699044689536e-05,
            1.666901880525984e-05,
        ],
    ),
]
HF_YARN = [
    (
        8,
        100.0,
        7,
        2.0,
        1.0693147180559945,
        [1.0, 0.15811388194561005, 0.05000000074505806, 0.015811389312148094],
    ),
    (
        16,
        100.0,
        14,
        1.5714285714285714,
        1.0451985123743057,
        [
            1.0,
            0.46009743213653564,
            0.2012358456850052,
            0.11316324025392532,
            0.06363637000322342,
            0.03578535467386246,
            0.020123586058616638,
            0.011316323652863503,
        ],
    ),
    (
        64,
        10000.0,
        2048,
        8.0,
        1.2079441541679836,
        [
            1.0,
            0.7498942017555237,
            0.5623413324356079,
            0.4216965138912201,
            0.3162277638912201,
            0.23713736236095428,
            0.17782793939113617,
            0.1333521455526352,
            0.10000000149011612,
            0.06994204968214035,
            0.0486641488969326,
            0.03365462273359299,
            0.0231089536100626,
            0.015733150765299797,
            0.010601281188428402,
            0.007052276749163866,
            0.00461538415402174,
            0.002956313779577613,
            0.0018384235445410013,
            0.0010947888949885964,
            0.0006081303581595421,
            0.00029642172739841044,
            0.00022228492889553308,
            0.00016669018077664077,
            0.0001250000059371814,
            9.373677312396467e-05,
            7.029266271274537e-05,
            5.271206100587733e-05,
            3.9528473280370235e-05,
            2.9642173103638925e-05,
            2.2228492525755428e-05,
            1.666901880525984e-05,
        ],
    ),
]


# ---------------------------------------------------------------- the formulas, written here


def ntk_reference(dim, base, s):
    """NTK-aware: base' = base * s^(d / (d - 2)); inv_freq = 1 / base'^(arange(0, d, 2) / d)."""
    scaled = base * s ** (dim / (dim - 2.0))
    return 1.0 / scaled ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def yarn_reference(dim, base, s, length, beta_fast=32.0, beta_slow=1.0, truncate=True):
    """YaRN's frequencies and attention factor, step by step as the published formulas say."""

    def corr_dim(num_rot):
        return dim * np.log(length / (num_rot * 2 * np.pi)) / (2 * np.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    extrap = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    interp = extrap / s
    extrap_factor = 1 - ramp
    inv_freq = interp * (1 - extrap_factor) + extrap * extrap_factor
    return inv_freq, (0.1 * np.log(s) + 1.0 if s > 1 else 1.0)


CONFIGS = [
    (dim, base, length, s)
    for dim in (4, 8, 16, 64)
    for base in (10.0, 100.0, 10000.0)
    for length in (7, 14, 2048)
    for s in (1.0, 36 / 28, 2.0, 8.0)
]


@pytest.mark.parametrize("dim, base, length, s", CONFIGS)
def test_ntk_and_yarn_are_the_published_formulas(dim, base, length, s):
    np.testing.assert_allclose(
        ex.ntk_inv_freq(dim, base, s), ntk_reference(dim, base, s), rtol=1e-12
    )
    inv_freq, factor = yarn_reference(dim, base, s, length)
    np.testing.assert_allclose(ex.yarn_inv_freq(dim, base, s, length), inv_freq, rtol=1e-12)
    assert ex.yarn_attention_factor(s) == pytest.approx(factor, rel=1e-14)


@pytest.mark.parametrize("dim, base, length, s, attention_factor, inv_freq", HF_NTK)
def test_ntk_matches_transformers(dim, base, length, s, attention_factor, inv_freq):
    np.testing.assert_allclose(ex.ntk_inv_freq(dim, base, s), inv_freq, rtol=1e-6)
    assert ex.ntk_base(base, s, dim) == pytest.approx(base * s ** (dim / (dim - 2)))


@pytest.mark.parametrize("dim, base, length, s, attention_factor, inv_freq", HF_YARN)
def test_yarn_matches_transformers(dim, base, length, s, attention_factor, inv_freq):
    np.testing.assert_allclose(ex.yarn_inv_freq(dim, base, s, length), inv_freq, rtol=1e-6)
    assert ex.yarn_attention_factor(s) == pytest.approx(attention_factor, rel=1e-12)


def test_ntk_keeps_the_highest_frequency_and_divides_the_lowest_by_s():
    for dim, s in ((8, 2.0), (16, 4.0), (64, 1.5)):
        plain, scaled = ntk_reference(dim, 100.0, 1.0), ex.ntk_inv_freq(dim, 100.0, s)
        assert scaled[0] == plain[0]
        assert scaled[-1] == pytest.approx(plain[-1] / s, rel=1e-12)


# ---------------------------------------------------------------- per axis, in the families


def _scaling(tool, factors, extents, qk_scale=1.0):
    return ex.Scaling(tool, tuple(factors), tuple(extents), qk_scale)


def _angles(enc, params, pos, scaling):
    out = ex.precompute(enc, params, pos, num_prefix=0, scaling=scaling)
    return np.asarray(out.angle_TNF[:, 0], np.float64)


@pytest.mark.parametrize("tool", ["ntk", "yarn"])
def test_rope_axial_gets_each_axis_its_own_1d_formula(tool):
    """H = 16, A = 2: each axis owns 4 pairs, a 1D RoPE of d = 8 with base 100. The grown axis
    (s = 2) follows the 1D formula with d = 8; the other (s = 1) is untouched, bit for bit."""
    enc = encodings.encoder("rope_axial", num_heads=1, head_dim=16, num_axes=2)
    pos = positions.grid_positions((14, 7), "integer")
    got = _angles(enc, {}, pos, _scaling(tool, (2.0, 1.0), (7.0, 7.0)))
    if tool == "ntk":
        freq0 = ntk_reference(8, 100.0, 2.0)
    else:
        freq0 = yarn_reference(8, 100.0, 2.0, 7)[0]
    plain = 100.0 ** (-np.arange(0, 8, 2) / 8)
    want = np.concatenate([np.outer(pos[:, 0], freq0), np.outer(pos[:, 1], plain)], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    untouched = np.asarray(enc.precompute({}, pos).angle_TNF[:, 0])
    np.testing.assert_array_equal(got[:, 4:], untouched[:, 4:])


def test_yarn_keeps_the_fastest_pair_of_a_short_axis_as_transformers_does():
    """RoPE-Axial's axis of 7 tokens (d = 8, base 100): its fastest pair turns 7 / (2 pi) = 1.1
    times, barely above beta_slow, yet transformers' range clipped at pair 0 keeps it whole;
    the unclipped ramp in log-turns (the learned tables' rule) nearly interpolates it."""
    turns = 7.0 / (2 * np.pi)
    assert 1.0 < turns < 1.2
    got = ex.yarn_inv_freq(8, 100.0, 2.0, 7.0)
    assert got[0] == 1.0 and np.allclose(got[1:], 100.0 ** (-np.arange(2, 8, 2) / 8) / 2.0)
    learned = ex.yarn_learned_frequencies(jnp.ones((1, 1, 1)), (2.0,), (7.0,))
    gamma = np.log(32.0 / turns) / np.log(32.0)
    np.testing.assert_allclose(float(learned[0, 0, 0]), gamma / 2.0 + 1.0 - gamma, rtol=1e-6)
    assert 0.51 < float(learned[0, 0, 0]) < 0.52
    # Unclipped, a fixed spectrum follows the learned tables' rule pair by pair.
    for dim, base, length in ((8, 100.0, 7.0), (16, 10000.0, 14.0), (32, 100.0, 3.0)):
        freq = base ** (-np.arange(0, dim, 2) / dim)
        unclipped = ex.yarn_inv_freq(dim, base, 2.0, length, clipped=False)
        rule = ex.yarn_learned_frequencies(
            jnp.asarray(freq[None, None], jnp.float32), (2.0,), (length,)
        )
        np.testing.assert_allclose(unclipped, np.asarray(rule[0, 0]), rtol=1e-5)
    # ... and Scaling(yarn_clipped=False) takes that path in a family's state.
    enc = encodings.encoder("rope_axial", num_heads=1, head_dim=16, num_axes=2)
    pos = positions.grid_positions((14, 7), "integer")
    scaling = dataclasses.replace(_scaling("yarn", (2.0, 1.0), (7.0, 7.0)), yarn_clipped=False)
    freq0 = ex.yarn_inv_freq(8, 100.0, 2.0, 7.0, clipped=False)
    np.testing.assert_allclose(
        _angles(enc, {}, pos, scaling)[:, :4], np.outer(pos[:, 0], freq0), rtol=1e-6, atol=1e-6
    )


def test_visionllama_axes_are_interleaved_but_scaled_per_axis():
    """VisionLLaMA's pair j belongs to axis j mod 2: NTK per axis reads each axis's spectrum."""
    enc = encodings.encoder("visionllama", num_heads=1, head_dim=16, num_axes=2)
    pos = positions.grid_positions((3, 6), "integer")
    got = _angles(enc, {}, pos, _scaling("ntk", (1.0, 3.0), (3.0, 2.0)))
    freq_col = ntk_reference(8, 10000.0, 3.0)
    np.testing.assert_allclose(got[:, 1::2], np.outer(pos[:, 1], freq_col), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(
        got[:, 0::2], np.asarray(enc.precompute({}, pos).angle_TNF)[:, 0, 0::2]
    )


def test_dinov3_spectrum_has_a_first_frequency_of_2_pi():
    """DINOv3's frequencies are 2 pi base^(-2i/d): YaRN counts turns with that 2 pi (a pair
    kept by the ramp is kept, one interpolated is divided by s); NTK keeps 2 pi and divides
    the lowest frequency by s."""
    enc = encodings.encoder("dinov3", num_heads=1, head_dim=16, num_axes=2)
    pos = positions.grid_positions((1, 2), "integer")  # (0, 0), (0, 1): angles = axis-1 freqs
    plain = 2 * np.pi * 100.0 ** (-np.arange(0, 8, 2) / 8)
    ntk = _angles(enc, {}, pos, _scaling("ntk", (1.0, 2.0), (7.0, 7.0)))[1, 4:]
    np.testing.assert_allclose(ntk, 2 * np.pi * ntk_reference(8, 100.0, 2.0), rtol=1e-6)
    yarn = _angles(enc, {}, pos, _scaling("yarn", (1.0, 2.0), (7.0, 7.0)))[1, 4:]
    # Turns over L = 7: 7 f / (2 pi) = 7 100^(-2i/8), so the correction range is
    # low = max(floor(8 ln(7 / 32) / (2 ln 100)), 0) = 0, high = ceil(8 ln(7) / (2 ln 100))
    # = ceil(1.69) = 2 (transformers' with 2 pi f_0 = 2 pi in the turns).
    ramp = np.clip(np.arange(4) / 2.0, 0.0, 1.0)
    np.testing.assert_allclose(yarn, plain * (ramp / 2.0 + 1.0 - ramp), rtol=1e-6)
    # the 1D table 100^(-2i/8) with L = 7 has another range (0, 1): the 2 pi counts
    assert ex.yarn_correction_range(8, 100.0, 7.0) == (0, 1)
    assert ex.yarn_correction_range(8, 100.0, 7.0, first_freq=2 * np.pi) == (0, 2)


def test_p_rope_pairs_stay_unrotated_and_the_others_follow_the_full_spectrum():
    enc = encodings.encoder("rope_axial", num_heads=1, head_dim=16, num_axes=2, rotary_fraction=0.5)
    pos = positions.grid_positions((4, 4), "integer")
    got = _angles(enc, {}, pos, _scaling("ntk", (2.0, 2.0), (2.0, 2.0)))
    freq = ntk_reference(8, 100.0, 2.0)
    freq[2:] = 0.0  # p = 0.5 keeps the 2 highest of each axis's 4
    want = np.concatenate([np.outer(pos[:, 0], freq), np.outer(pos[:, 1], freq)], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_spectrum_that_is_not_geometric_per_axis_is_refused():
    enc = encodings.encoder(
        "rope_axial", num_heads=1, head_dim=24, num_axes=3, layout="mrope_interleaved", base=10000.0
    )
    pos = positions.grid_positions((2, 2, 2), "integer")
    with pytest.raises(ValueError, match="axis 0 are not a geometric spectrum"):
        ex.precompute(enc, {}, pos, num_prefix=0, scaling=_scaling("ntk", (2, 2, 2), (1, 1, 1)))


# ---------------------------------------------------------------- PI, every family


ROTARY_CASES = [
    (name, dict(module.FAMILY.examples[0][0]))
    for name, module in sorted(encodings.ROTARY.items())
    if name != "nope" and 2 in module.FAMILY.examples[0][1]
]


@pytest.mark.parametrize("name, settings", ROTARY_CASES)
def test_pi_at_twice_the_grid_rotates_token_2i_as_training_token_i(name, settings):
    """PI with s = 2 per axis puts evaluation token (2i, 2j) where training token (i, j) was:
    the same R(p) for every family, relative or not (LieRE)."""
    enc = encodings.encoder(name, num_heads=2, head_dim=12, num_axes=2, **settings)
    params = enc.init(jax.random.key(3))
    train, evaluated = (3, 4), (6, 8)
    scaling = ex.resolve(
        "pi", family=name, grid=evaluated, train_grid=train, convention="integer", num_prefix=1
    )
    pos_eval = positions.grid_positions(evaluated, "integer", num_prefix=1)
    pos_train = positions.grid_positions(train, "integer", num_prefix=1)
    x = normal((1, 1 + 12, 2, 12))
    eval_tokens = [0] + [1 + 2 * i * 8 + 2 * j for i in range(3) for j in range(4)]
    x_eval = jnp.zeros((1, 1 + 48, 2, 12)).at[:, jnp.asarray(eval_tokens)].set(x)
    got = ex.precompute(enc, params, pos_eval, num_prefix=1, scaling=scaling).rotate(x_eval)
    want = enc.precompute(params, pos_train, num_prefix=1).rotate(x)
    np.testing.assert_allclose(got[:, jnp.asarray(eval_tokens)], want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- YaRN on a learned table


def test_yarn_whose_correction_range_is_empty_is_refused():
    """A 7-token axis under the "sequential" convention spans 7 / 6 positions: the fastest pair
    turns 0.19 times, every pair fewer than beta_slow, and transformers' clipped range comes
    out empty (0, -1): the ramp keeps every frequency and "yarn" would change the temperature
    only. Refused, naming what to use; unclipped, every pair is interpolated."""
    assert ex.yarn_correction_range(8, 100.0, 7 / 6) == (0, -1)
    enc = encodings.encoder("rope_axial", num_heads=1, head_dim=16, num_axes=2)
    pos = positions.grid_positions((14, 7), "sequential")
    scaling = _scaling("yarn", (2.0, 1.0), (7 / 6, 7 / 6))
    with pytest.raises(ValueError, match=r"axis 0's fastest pair turns 0.19 times .* use 'pi'"):
        _angles(enc, {}, pos, scaling)
    unclipped = _angles(enc, {}, pos, dataclasses.replace(scaling, yarn_clipped=False))
    np.testing.assert_allclose(unclipped[:, :4], _angles(enc, {}, pos, None)[:, :4] / 2.0)


def test_yarn_on_learned_frequencies_is_transformers_ramp_before_its_rounding():
    """Axis-aligned RoPE-Mixed frequencies equal to a 1D spectrum whose correction range lies
    inside the table (pairs 8.06 to 20.1 of 32): the continuous ramp (linear in log turns)
    equals transformers' ramp with truncate=False."""
    dim, base, length, s = 64, 10000.0, 2048.0, 8.0
    spectrum = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    freqs_ANF = np.zeros((2, 1, dim // 2))
    freqs_ANF[0, 0] = spectrum  # every pair on axis 0
    got = ex.yarn_learned_frequencies(freqs_ANF, (s, 1.0), (length, 5.0))
    want, _ = yarn_reference(dim, base, s, length, truncate=False)
    np.testing.assert_allclose(got[0, 0], want, rtol=1e-5)
    np.testing.assert_array_equal(got[1], 0.0)


def test_yarn_on_learned_frequencies_keeps_fast_pairs_and_interpolates_slow_ones():
    length, s = 7.0, 2.0
    fast, slow = 40 * 2 * np.pi / length, 0.5 * 2 * np.pi / length  # 40 and 0.5 turns
    f = np.array([[[fast, -slow]], [[slow, fast]]])  # (A=2, N=1, F=2), mixed directions
    got = np.asarray(ex.yarn_learned_frequencies(f, (s, s), (length, length)))
    np.testing.assert_allclose(got, [[[fast, -slow / s]], [[slow / s, fast]]], rtol=1e-6)
    # an axis that did not grow keeps its components
    got = np.asarray(ex.yarn_learned_frequencies(f, (s, 1.0), (length, length)))
    np.testing.assert_allclose(got[1], f[1], rtol=1e-6)


def test_rope_mixed_yarn_state_is_rope_mixed_with_the_scaled_frequencies():
    enc = encodings.encoder("rope_mixed", num_heads=2, head_dim=8, num_axes=2, rotary_fraction=0.5)
    params = enc.init(jax.random.key(0))
    scaling = ex.resolve(
        "yarn",
        family="rope_mixed",
        grid=(14, 14),
        train_grid=(7, 7),
        convention="integer",
        num_prefix=1,
    )
    pos = positions.grid_positions((14, 14), "integer", num_prefix=1)
    got = ex.precompute(enc, params, pos, num_prefix=1, scaling=scaling)
    assert isinstance(got, state.ScaledQK)
    scaled = ex.yarn_learned_frequencies(params["freqs_ANF"], (2.0, 2.0), (7.0, 7.0))
    want = rope_mixed.precompute(
        rope_mixed.params_from_freqs(scaled), pos, num_heads=2, head_dim=8, rotary_fraction=0.5
    )
    np.testing.assert_allclose(got.state.angle_TNF, want.angle_TNF, rtol=1e-6, atol=1e-6)
    assert float(got.qk_scale) == pytest.approx(0.1 * math.log(4.0) + 1.0)


# ---------------------------------------------------------------- the q/k scale


def _logits(pe_state, q, k):
    q, k = pe_state.rotate(q), pe_state.rotate(k)
    return np.einsum("btnh,bsnh->bnts", np.asarray(q, np.float64), np.asarray(k, np.float64))


@pytest.mark.parametrize("name, settings", ROTARY_CASES)
def test_logit_scaling_multiplies_every_logit_by_the_log_ratio(name, settings):
    enc = encodings.encoder(name, num_heads=2, head_dim=12, num_axes=2, **settings)
    params = enc.init(jax.random.key(1))
    scaling = ex.resolve(
        "logit", family=name, grid=(6, 8), train_grid=(3, 4), convention="integer", num_prefix=1
    )
    ratio = math.log(49) / math.log(13)
    assert scaling.tool is None and scaling.qk_scale**2 == pytest.approx(ratio)
    pos = positions.grid_positions((6, 8), "integer", num_prefix=1)
    q, k = normal((1, 49, 2, 12), 1), normal((1, 49, 2, 12), 2)
    plain = enc.precompute(params, pos, num_prefix=1)
    scaled = ex.precompute(enc, params, pos, num_prefix=1, scaling=scaling)
    np.testing.assert_allclose(
        _logits(scaled, q, k), ratio * _logits(plain, q, k), rtol=1e-4, atol=1e-4
    )
    folded = scaled.to_fold()  # a P to fold (Cayley-STRING, ComRoPE) stays the family's
    assert isinstance(folded, state.ScaledQK)
    assert (folded.fold_NHH is None) == (plain.to_fold().fold_NHH is None)


def test_alibi_bias_is_scaled_with_the_logits():
    enc = encodings.encoder("alibi", num_heads=2, head_dim=8, num_axes=2)
    params = enc.init(jax.random.key(0))
    pos = positions.grid_positions((4, 4), "integer", num_prefix=1)
    scaling = _scaling(None, (1.0, 1.0), (1.0, 1.0), qk_scale=1.5)
    got = ex.precompute(enc, params, pos, num_prefix=1, scaling=scaling).bias_BNTS
    want = enc.precompute(params, pos, num_prefix=1).bias_BNTS
    np.testing.assert_allclose(got, 2.25 * np.asarray(want), rtol=1e-6)


def test_scaled_state_keeps_the_dtype():
    inner = state.PairAngles(jnp.zeros((3, 1, 4)))
    x = normal((2, 3, 1, 8), dtype=jnp.bfloat16)
    out = state.ScaledQK(inner, jnp.float32(2.0)).rotate(x)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), 2 * np.asarray(x, np.float32))


# ---------------------------------------------------------------- resolve


def test_resolve_factors_extents_and_identity():
    kw = dict(family="rope_axial", train_grid=(7, 7), convention="integer", num_prefix=1)
    s = ex.resolve("yarn", grid=(14, 9), **kw)
    assert s.factors == (2.0, 9 / 7) and s.extents == (7.0, 7.0)
    assert s.qk_scale == pytest.approx(0.1 * math.log(2 * 9 / 7) + 1)
    # an axis that shrank is not stretched; a grid no larger than training is the identity
    assert ex.resolve("pi", grid=(14, 5), **kw).factors == (2.0, 1.0)
    for tool in ("pi", "ntk", "yarn", "logit", "pi+logit"):
        assert ex.resolve(tool, grid=(7, 7), **kw) is None
        if tool != "logit" and tool != "pi+logit":
            assert ex.resolve(tool, grid=(5, 7), **kw) is None
    seq = ex.resolve(
        "pi",
        family="liere",
        grid=(14, 14),
        train_grid=(7, 7),
        convention="sequential",
        num_prefix=1,
    )
    assert seq.extents == pytest.approx((7 / 6, 7 / 6))


@pytest.mark.parametrize(
    "spec, family, convention, match",
    [
        ("bogus", "rope_axial", "integer", "expected one of"),
        ("pi+ntk", "rope_axial", "integer", "expected one of"),
        ("yarn+logit", "rope_axial", "integer", "its own attention factor"),
        ("ntk", "rope_mixed", "integer", "supports \\('pi', 'yarn', 'logit'\\)"),
        ("yarn", "liere", "sequential", "supports \\('pi', 'logit'\\)"),
        ("pi", "nope", "integer", "supports \\('logit',\\)"),
        ("pi", "dinov3", "centred", "keep the training range"),
        ("ntk", "visionllama", "autoscale", "keep the training range"),
    ],
)
def test_unsupported_tools_name_what_is_supported(spec, family, convention, match):
    with pytest.raises(ValueError, match=match):
        ex.resolve(
            spec, family=family, grid=(8, 8), train_grid=(4, 4), convention=convention, num_prefix=1
        )


def test_tools_for_reads_the_family_declarations():
    assert ex.tools_for("rope", "integer") == ("pi", "ntk", "yarn", "logit")
    assert ex.tools_for("rope_mixed", "integer") == ("pi", "yarn", "logit")
    assert ex.tools_for("cayley_string", "integer") == ("pi", "logit")
    assert ex.tools_for("comrope", "sequential") == ("pi", "logit")
    assert ex.tools_for("rope_axial", "sequential") == ("pi", "ntk", "logit")  # yarn: empty range
    assert ex.tools_for("rope_mixed", "sequential") == ("pi", "yarn", "logit")  # unclipped rule
    assert ex.tools_for("dinov3", "centred") == ("logit",)
