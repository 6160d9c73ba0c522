"""Resolution extrapolation: evaluating a rotary encoding on a larger grid than it was trained
on, without retraining.

Four tools, each chosen at evaluation from the training grid (``resolve``) and applied where
the encoder state is made (``precompute``; ``ViT.precompute_pe(grid, extrapolation=...)``):

- ``"pi"``, position interpolation (Chen et al., "Extending Context Window of Large Language
  Models via Positional Interpolation", arXiv:2306.15595): positions times the training extent
  over the evaluation extent, per axis, p_a -> p_a / s_a, so the evaluation grid covers the
  training grid's range of positions. Every family with positions (for learned generators,
  LieRE, Cayley-STRING, ComRoPE, RoPE-Mixed, position scaling is the tool).
- ``"ntk"``, NTK-aware base scaling (bloc97, 2023; the formula of HuggingFace transformers'
  ``modeling_rope_utils._compute_dynamic_ntk_parameters``, whose base at sequence length
  s L with ``factor=1`` is this one): base' = base s^(d / (d - 2)), d the rotary dimension.
  Per axis (below). Families with a fixed spectrum: rope, rope_axial, visionllama, dinov3.
- ``"yarn"``, YaRN (Peng et al., "YaRN: Efficient Context Window Extension of Large Language
  Models", arXiv:2309.00071), as transformers implements it (``_compute_yarn_parameters``):
  NTK-by-parts, each pair's frequency divided by s (interpolated) or kept (extrapolated) by
  how many turns its wavelength makes over the training extent L, with a linear ramp between
  ``beta_fast`` = 32 and ``beta_slow`` = 1 turns, and the attention factor
  sqrt(1/t) = 0.1 ln(s) + 1 on q and on k (transformers multiplies it into cos and sin), so the
  logits times its square. A factor per axis. Fixed spectra and RoPE-Mixed's learned one.
- ``"logit"``, logit scaling with the token count: attention logits times
  log(n_eval) / log(n_train), n the tokens attended over (prefix tokens included). The source
  is Chiang and Cholak, "Overcoming a Theoretical Limitation of Self-Attention" (ACL 2022,
  arXiv:2202.12172), whose log-length scaled attention multiplies the logits by log n;
  Scalable-Softmax (Nakanishi, arXiv:2501.19399) is the same with a learned factor per head. We
  follow it at evaluation only, as the ratio to the training count: a model trained without
  the factor is one trained with it whose q.k absorbed 1 / log(n_train), so the training grid
  is unchanged and a larger one gets log(n_eval) / log(n_train). Any family, NoPE and ALiBi
  included (ALiBi's bias is scaled with the logits). It combines with ``pi`` or ``ntk``
  (``"pi+logit"``); YaRN brings its own factor, so ``"yarn+logit"`` is refused.

**Factors.** Per axis, s_a = max(1, n_a / n_train_a) (tokens along axis a at evaluation and in
training): an axis that did not grow is left alone, on a grid no larger than the training one
the frequency tools are the identity (the same numbers as without them). The tools act on
positions that run on past the training range as the grid grows: conventions ``"integer"`` and
``"sequential"`` (the others already keep the training range: ``"normalized"``, the centred
ones, and ``"autoscale"``, which is position interpolation built in; ``"diagonal"`` shears time
into space). The training extent L_a, in position units, is n_train_a positions of the training
spacing: n_train_a for integer positions (transformers' ``original_max_position_embeddings``),
n_train_a / (n_train_a - 1) for sequential ones.

**NTK and YaRN per axis.** In rope_axial, visionllama and dinov3 every pair turns with one axis
only, and the n_a pairs of axis a form a 1D RoPE spectrum of their own, f_0 b^(-2i/d_a),
i < n_a, d_a = 2 n_a (RoPE-Axial: f_0 = 1, b = base; DINOv3: f_0 = 2 pi). So each axis is a 1D
RoPE of dimension d_a, and the 1D formulas apply to it with its own factor s_a: NTK's
b' = b s_a^(d_a / (d_a - 2)) keeps the axis's highest frequency and divides its lowest by
exactly s_a (what that axis needs to cover s_a times its extent), as in 1D; YaRN's ramp counts
turns over that axis's extent L_a. One factor for all axes would over-interpolate an axis that
did not grow (a wider, not taller, image) or under-interpolate one that did. The spectrum of an
axis is read from the family's ``pair_spectrum`` (sorted by decreasing frequency, f_0 and b
from its first two pairs, checked geometric; transformers' formulas with base b and a factor
f_0 in the turns); a table that is not geometric per axis (RoPE-Axial's
``"mrope_interleaved"`` time axis) or has fewer than 2 pairs on an axis is an error. Pairs of
frequency 0 (p-RoPE's, the LieRE-variant leftovers) stay 0.

**YaRN on short axes keeps the fastest pair.** transformers clips the correction range's low
end to pair 0, so whenever an axis's fastest pair turns fewer than ``beta_fast`` times over the
training extent (every image grid here; in a language model it turns hundreds of times), that
pair gets ramp 0 and keeps its frequency, however few turns it makes. ``"yarn"`` follows
transformers; ``Scaling(yarn_clipped=False)`` (``dataclasses.replace`` on ``resolve``'s result,
then ``ViT.pe_states(positions, scaling)``) leaves the range unrounded and unclipped, a ramp
linear in log-turns. On RoPE-Axial at 7 tokens an axis (base 100, 4 pairs per axis at head
dimension 16) the fastest pair makes 1.1 turns over the training extent, and keeping it is
what leaves YaRN at the untreated model's accuracy in ``fashion_extrapolation``, where the
ramp without the clip (linear in log-turns, as for learned tables below) comes within about 2
points of ``"pi"`` on resized images (that study's README gives the figures). Where even the
fastest pair turns fewer than ``beta_slow`` times (a short axis under ``"sequential"``, whose
extent is n / (n - 1) positions), transformers' range is empty and its ramp keeps every pair:
``"yarn"`` would change the temperature only, so it is refused there, naming ``"pi"`` (what
YaRN's rule asks for every pair then) and ``yarn_clipped=False``.

**YaRN on a learned table.** The by-parts rule works by wavelength, so it applies to
RoPE-Mixed's learned frequencies too: pair j of head n turns by sum_a p_a f[a, n, j], and
each component f[a, n, j] is a frequency along axis a, with r = L_a |f[a, n, j]| / (2 pi)
turns over the training extent. Each component is scaled by the ramp of its own turns and axis
factor. Without a pair index there is no index range to round to or clip to: transformers'
ramp, linear in the pair index between the correction range's ends (rounded out, and clipped
to the table's pairs), is linear in log(turns) before that rounding and clipping (tested where
the range lies inside the table), and that is the ramp used here:
gamma = clip(ln(beta_fast / r) / ln(beta_fast / beta_slow), 0, 1), f' = f (gamma / s + 1 - gamma).
NTK needs a base, so it is refused for learned frequencies.

YaRN's attention factor takes s = prod_a s_a, the token ratio when no axis shrinks (an axis
below its training size counts as 1, so a grid wider but shorter than the training grid still
gets a temperature above 1): in 1D, YaRN's s is both the
length ratio and the ratio of keys attended over, and its temperature corrects the attention's
entropy, which grows with the keys (a choice of ours for several axes; transformers has one
axis).

Everything here is float64 numpy on the settings (static) and float32 JAX on the parameters and
positions; no flax.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rope_lie.encodings import family as family_lib
from rope_lie.encodings import state as state_lib

FREQUENCY_TOOLS = ("pi", "ntk", "yarn")
TOOLS = (*FREQUENCY_TOOLS, "logit")
# Conventions whose positions run on past the training range as the grid grows.
GROWING_CONVENTIONS = ("integer", "sequential")
BETA_FAST = 32.0  # YaRN: pairs turning more than this over the training extent are kept
BETA_SLOW = 1.0  # YaRN: pairs turning less than this are interpolated


@dataclasses.dataclass(frozen=True)
class Scaling:
    """One tool resolved at one evaluation grid (``resolve``): what ``precompute`` applies.

    Attributes:
      tool: ``"pi"``, ``"ntk"``, ``"yarn"``, or None (logit scaling only).
      factors: s_a per axis, >= 1.
      extents: L_a per axis, the training extent in position units.
      qk_scale: q and k each times this (the logits times its square); 1.0 for none.
      beta_fast, beta_slow: YaRN's ramp ends, in turns over the training extent.
      yarn_clipped: YaRN on fixed spectra with transformers' correction range (True) or the
        unclipped one (False; ``yarn_inv_freq``).
    """

    tool: str | None
    factors: tuple[float, ...]
    extents: tuple[float, ...]
    qk_scale: float = 1.0
    beta_fast: float = BETA_FAST
    beta_slow: float = BETA_SLOW
    yarn_clipped: bool = True


def parse(spec: str) -> tuple[str | None, bool]:
    """``"pi"``, ``"ntk"``, ``"yarn"``, ``"logit"`` or a frequency tool with ``"+logit"``.

    Args:
      spec: the tool, e.g. ``"ntk+logit"``.

    Returns:
      (frequency tool or None, whether logits are scaled).
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"extrapolation={spec!r}: expected a tool name, one of {TOOLS}")
    names = spec.split("+")
    unknown = [n for n in names if n not in TOOLS]
    frequency = [n for n in names if n in FREQUENCY_TOOLS]
    if unknown or len(set(names)) != len(names) or len(frequency) > 1:
        raise ValueError(
            f"extrapolation={spec!r}: expected one of {TOOLS}, or one of {FREQUENCY_TOOLS} "
            "with '+logit' (e.g. 'pi+logit')"
        )
    if frequency == ["yarn"] and "logit" in names:
        raise ValueError(
            f"extrapolation={spec!r}: YaRN scales the logits by its own attention factor; "
            "use 'yarn' alone"
        )
    return (frequency[0] if frequency else None), "logit" in names


def tools_for(name: str, convention: str) -> tuple[str, ...]:
    """The tools a family supports under a position convention (single tools, ``TOOLS``).

    Args:
      name: a rotary or bias family.
      convention: the model's position convention.

    Returns:
      the tool names, ``"logit"`` always; the frequency tools only for conventions in
      ``GROWING_CONVENTIONS``; ``"ntk"`` for fixed spectra, ``"yarn"`` for learned ones and
      for fixed ones under ``"integer"`` (under ``"sequential"`` a fixed spectrum's pairs all
      turn fewer than ``beta_slow`` times over the training extent, where clipped YaRN is
      refused: ``_check_yarn_range``), ``"pi"`` for every family with positions (not NoPE).
    """
    fam = family_lib.family_of(name)
    tools = []
    if convention in GROWING_CONVENTIONS and name != "nope":
        tools.append("pi")
        if fam.pair_spectrum is not None:
            tools.append("ntk")
        fixed_yarn = fam.pair_spectrum is not None and convention != "sequential"
        if fixed_yarn or fam.learned_frequencies is not None:
            tools.append("yarn")
    return (*tools, "logit")


def axis_factors(grid: Sequence[int], train_grid: Sequence[int]) -> np.ndarray:
    """s_a = max(1, n_a / n_train_a): how much each axis grew (float64 (A,))."""
    grid, train_grid = np.asarray(grid, np.float64), np.asarray(train_grid, np.float64)
    if grid.shape != train_grid.shape:
        raise ValueError(f"grid {tuple(grid)} and training grid {tuple(train_grid)} differ in rank")
    return np.maximum(grid / train_grid, 1.0)


def training_extents(convention: str, train_grid: Sequence[int]) -> np.ndarray:
    """L_a: the training grid's extent along each axis in position units (float64 (A,)).

    ``"integer"``: n positions 0, ..., n - 1 of spacing 1, L = n (transformers'
    ``original_max_position_embeddings``); ``"sequential"``: linspace(0, 1, n), L = n / (n - 1).
    """
    n = np.asarray(train_grid, np.float64)
    if convention == "integer":
        return n
    if convention == "sequential":
        return n / np.maximum(n - 1.0, 1.0)
    raise ValueError(
        f"position convention {convention!r} keeps positions in the training range (or shears "
        f"them): the frequency tools need one of {GROWING_CONVENTIONS}"
    )


def logit_scale(num_tokens: int, train_tokens: int) -> float:
    """log(n) / log(n_train): the factor on the logits (Chiang and Cholak 2022, as a ratio)."""
    if train_tokens < 2:
        raise ValueError(f"logit scaling needs >= 2 training tokens, got {train_tokens}")
    return math.log(num_tokens) / math.log(train_tokens)


def ntk_base(base: float, factor: float, dim: int) -> float:
    """NTK-aware base: base s^(d / (d - 2)) (transformers' dynamic NTK at s times the length)."""
    if dim <= 2:
        raise ValueError(f"NTK scaling needs a rotary dimension > 2, got {dim}")
    return base * factor ** (dim / (dim - 2))


def ntk_inv_freq(dim: int, base: float, factor: float, first_freq: float = 1.0) -> np.ndarray:
    """first_freq / base'^(2i / d), i < d / 2, base' = ``ntk_base`` (float64)."""
    return first_freq / ntk_base(base, factor, dim) ** (np.arange(0, dim, 2) / dim)


def yarn_attention_factor(factor: float) -> float:
    """YaRN's sqrt(1/t) = 0.1 ln(s) + 1 for s > 1, else 1 (transformers' ``get_mscale``)."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_correction_range(
    dim: int,
    base: float,
    extent: float,
    beta_fast: float = BETA_FAST,
    beta_slow: float = BETA_SLOW,
    first_freq: float = 1.0,
    clipped: bool = True,
) -> tuple[float, float]:
    """transformers' ``find_correction_range`` (``truncate=True``): the pair indices between
    which the ramp runs, floor/ceil of d ln(L f_0 / (2 pi beta)) / (2 ln base), clipped to
    [0, d - 1]. ``clipped=False``: the same indices unrounded and unclipped (the ramp is then
    linear in log-turns, the learned tables' rule; see the module docstring)."""

    def correction_dim(turns: float) -> float:
        return dim * math.log(extent * first_freq / (turns * 2 * math.pi)) / (2 * math.log(base))

    if not clipped:
        return correction_dim(beta_fast), correction_dim(beta_slow)
    low = math.floor(correction_dim(beta_fast))
    high = math.ceil(correction_dim(beta_slow))
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(
    dim: int,
    base: float,
    factor: float,
    extent: float,
    beta_fast: float = BETA_FAST,
    beta_slow: float = BETA_SLOW,
    first_freq: float = 1.0,
    clipped: bool = True,
) -> np.ndarray:
    """YaRN's frequencies of a 1D spectrum first_freq base^(-2i/d), as transformers'
    ``_compute_yarn_parameters`` (float64; ``first_freq`` = 1 is transformers' table).

    Args:
      dim: d, the rotary dimension (d / 2 pairs).
      base: the spectrum's base.
      factor: s.
      extent: L, the training extent in positions.
      beta_fast, beta_slow: the ramp's ends, in turns over L.
      first_freq: f_0, the highest frequency.
      clipped: transformers' correction range (True), or the unclipped one (False), under
        which a short axis's fastest pair is interpolated by its turns (module docstring).

    Returns:
      (d / 2,) frequencies.
    """
    low, high = yarn_correction_range(
        dim, base, extent, beta_fast, beta_slow, first_freq, clipped=clipped
    )
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0.0, 1.0)
    extrapolated = first_freq / base ** (np.arange(0, dim, 2) / dim)
    keep = 1.0 - ramp  # transformers' inv_freq_extrapolation_factor
    return extrapolated / factor * (1.0 - keep) + extrapolated * keep


def yarn_learned_frequencies(
    freqs_ANF: jax.Array,
    factors: Sequence[float],
    extents: Sequence[float],
    beta_fast: float = BETA_FAST,
    beta_slow: float = BETA_SLOW,
) -> jax.Array:
    """YaRN on learned frequencies ``f[a, n, j]`` (RoPE-Mixed), component by component.

    Component (a, n, j) turns r = L_a |f| / (2 pi) times over axis a's training extent; it is
    scaled by gamma / s_a + 1 - gamma, gamma = clip(ln(beta_fast / r) / ln(beta_fast /
    beta_slow), 0, 1) (the module docstring: transformers' ramp before its rounding and
    clipping).

    Args:
      freqs_ANF: (A, N, F) learned frequencies.
      factors: s_a per axis.
      extents: L_a per axis.
      beta_fast, beta_slow: the ramp's ends.

    Returns:
      float32 (A, N, F).
    """
    f = jnp.asarray(freqs_ANF, jnp.float32)
    shape = (-1, 1, 1)
    s_A11 = jnp.asarray(factors, jnp.float32).reshape(shape)
    extent_A11 = jnp.asarray(extents, jnp.float32).reshape(shape)
    turns = extent_A11 * jnp.abs(f) / (2 * math.pi)
    # ln(beta_fast / r) with r = 0 (a pair that does not turn) is +inf: gamma 1, and 0 / s = 0.
    log_ratio = jnp.log(beta_fast) - jnp.log(jnp.maximum(turns, jnp.finfo(jnp.float32).tiny))
    gamma = jnp.clip(log_ratio / math.log(beta_fast / beta_slow), 0.0, 1.0)
    return f * (gamma / s_A11 + 1.0 - gamma)


def _axis_spectrum(freq_F: np.ndarray, pairs: np.ndarray, axis: int, name: str):
    """(pairs by decreasing frequency, f_0, base) of one axis's geometric spectrum."""
    order = pairs[np.argsort(-freq_F[pairs], kind="stable")]
    if len(order) < 2:
        raise ValueError(
            f"{name}: axis {axis} has {len(order)} rotating pair(s); NTK and YaRN need a "
            "spectrum of at least 2 pairs per axis"
        )
    dim = 2 * len(order)
    first, ratio = freq_F[order[0]], freq_F[order[1]] / freq_F[order[0]]
    expected = first * ratio ** np.arange(len(order))
    if not np.allclose(freq_F[order], expected, rtol=1e-9, atol=0.0) or ratio >= 1.0:
        raise ValueError(
            f"{name}: the frequencies of axis {axis} are not a geometric spectrum "
            f"f_0 base^(-2i/d) ({freq_F[order].tolist()}): NTK and YaRN are defined per axis "
            "for such spectra only (use 'pi')"
        )
    return order, float(first), float(ratio ** (-dim / 2.0))


def spectrum_multipliers(
    name: str,
    axis_F: np.ndarray,
    freq_F: np.ndarray,
    scaling: Scaling,
) -> np.ndarray:
    """freq' / freq of every pair of a fixed table under NTK or YaRN, per axis (float64 (F,)).

    Args:
      name: the family (for errors).
      axis_F: (F,) axis of every pair.
      freq_F: (F,) its frequency (``Family.pair_spectrum``).
      scaling: tool ``"ntk"`` or ``"yarn"``, the factors and extents.

    Returns:
      (F,) multipliers; 1 on axes with s_a = 1 and for pairs of frequency 0.
    """
    axis_F, freq_F = np.asarray(axis_F), np.asarray(freq_F, np.float64)
    out = np.ones(len(freq_F))
    for axis, (s, extent) in enumerate(zip(scaling.factors, scaling.extents, strict=True)):
        pairs = np.flatnonzero((axis_F == axis) & (freq_F != 0))
        if s == 1.0 or len(pairs) == 0:
            continue
        order, first, base = _axis_spectrum(freq_F, pairs, axis, name)
        dim = 2 * len(order)
        if scaling.tool == "ntk":
            scaled = ntk_inv_freq(dim, base, s, first)
        else:
            if scaling.yarn_clipped:
                _check_yarn_range(name, axis, dim, base, extent, scaling, first)
            scaled = yarn_inv_freq(
                dim,
                base,
                s,
                extent,
                scaling.beta_fast,
                scaling.beta_slow,
                first,
                clipped=scaling.yarn_clipped,
            )
        out[order] = scaled / freq_F[order]
    return out


def _check_yarn_range(
    name: str, axis: int, dim: int, base: float, extent: float, scaling: Scaling, first: float
) -> None:
    """Refuse clipped YaRN where transformers' correction range is empty: every pair of the
    axis turns fewer than ``beta_slow`` times over the training extent (a short axis under the
    ``"sequential"`` convention, say), so its ramp keeps every frequency and the tool would
    change the attention temperature only."""
    low, high = yarn_correction_range(
        dim, base, extent, scaling.beta_fast, scaling.beta_slow, first
    )
    if high < low:
        turns = extent * first / (2 * math.pi)
        raise ValueError(
            f"yarn on {name}: axis {axis}'s fastest pair turns {turns:.2f} times over the "
            f"training extent of {extent:.3g} positions, fewer than beta_slow="
            f"{scaling.beta_slow}, so transformers' correction range is empty and YaRN would "
            "keep every frequency, changing the temperature only; use 'pi' (every pair "
            "interpolated, as YaRN's rule asks here) or Scaling(yarn_clipped=False)"
        )


def resolve(
    spec: str,
    *,
    family: str,
    grid: Sequence[int],
    train_grid: Sequence[int],
    convention: str,
    num_prefix: int,
) -> Scaling | None:
    """A tool at an evaluation grid: the factors, extents and q/k scale it applies.

    Args:
      spec: ``parse``'s argument, e.g. ``"yarn"`` or ``"pi+logit"``.
      family: the model's rotary or bias family (``tools_for`` says what it supports).
      grid: the evaluation token grid.
      train_grid: the training token grid.
      convention: the model's position convention.
      num_prefix: prefix tokens (counted in n for logit scaling).

    Returns:
      the ``Scaling``, or None when it changes nothing at this grid (every axis no larger than
      in training and no logit factor other than 1): the plain state is then exact.
    """
    tool, logit = parse(spec)
    supported = tools_for(family, convention)
    if tool is not None and tool not in supported:
        why = (
            f"positions under convention {convention!r} keep the training range"
            if convention not in GROWING_CONVENTIONS
            else "NTK needs a fixed spectrum, YaRN a pair frequency table, PI positions"
        )
        raise ValueError(
            f"extrapolation={spec!r} is not defined for pe={family!r} with "
            f"position_convention={convention!r} ({why}); it supports {supported}"
        )
    grid, train_grid = tuple(int(n) for n in grid), tuple(int(n) for n in train_grid)
    factors = axis_factors(grid, train_grid)
    extents = np.ones(len(grid))
    if tool is not None:
        extents = training_extents(convention, train_grid)
        if np.all(factors == 1.0):
            tool = None
    qk_scale = 1.0
    if tool == "yarn":
        qk_scale = yarn_attention_factor(float(np.prod(factors)))
    if logit:
        ratio = logit_scale(num_prefix + math.prod(grid), num_prefix + math.prod(train_grid))
        qk_scale = math.sqrt(ratio)
    if tool is None and qk_scale == 1.0:
        return None
    return Scaling(
        tool, tuple(float(s) for s in factors), tuple(float(x) for x in extents), qk_scale
    )


def precompute(
    encoder: family_lib.Encoder,
    params: Mapping[str, jax.Array],
    pos: jax.Array,
    *,
    num_prefix: int,
    scaling: Scaling | None,
) -> state_lib.State:
    """The encoder's state at positions ``pos`` under a resolved tool.

    Args:
      encoder: the layer's ``Encoder``.
      params: its parameters.
      pos: ``pos_TA`` or ``pos_BTA`` of the evaluation grid (the model's convention).
      num_prefix: prefix tokens.
      scaling: ``resolve``'s result; None: the plain ``encoder.precompute``.

    Returns:
      the family's state with its positions or frequencies rescaled, inside a
      ``state.ScaledQK`` when q and k are scaled.
    """
    if scaling is None:
        return encoder.precompute(params, pos, num_prefix=num_prefix)
    fam = encoder.family
    if scaling.tool is not None and scaling.tool not in tools_for(encoder.name, "integer"):
        raise ValueError(
            f"extrapolation {scaling.tool!r} is not defined for {encoder.name}: it supports "
            f"{tools_for(encoder.name, 'integer')}"
        )
    if scaling.tool == "pi":
        pos = jnp.asarray(pos, jnp.float32)
        s_XA = jnp.asarray(scaling.factors, jnp.float32).reshape((1,) * (pos.ndim - 1) + (-1,))
        pos_scaled = pos / s_XA
        pe_state = encoder.precompute(params, pos_scaled, num_prefix=num_prefix)
    elif fam.pair_spectrum is not None and scaling.tool in ("ntk", "yarn"):
        axis_F, freq_F = fam.pair_spectrum(encoder.head_dim, encoder.num_axes, encoder.hparams)
        scale_F = spectrum_multipliers(encoder.name, axis_F, freq_F, scaling)
        pe_state = encoder.precompute(params, pos, num_prefix=num_prefix)
        if not isinstance(pe_state, state_lib.PairAngles):
            raise TypeError(f"{encoder.name}: expected pair angles, got {type(pe_state).__name__}")
        # The angles are pos_a * freq_j, linear in the frequency: rescale them.
        angle = pe_state.angle_TNF
        angle = angle * jnp.asarray(scale_F, jnp.float32).reshape((1,) * (angle.ndim - 1) + (-1,))
        pe_state = pe_state._replace(angle_TNF=angle)
    elif scaling.tool == "yarn":  # a learned table (tools_for)
        key = fam.learned_frequencies
        scaled = yarn_learned_frequencies(
            params[key], scaling.factors, scaling.extents, scaling.beta_fast, scaling.beta_slow
        )
        # A plain dict: the Encoder passes its own settings (rotary_fraction, ...).
        pe_state = encoder.precompute({**dict(params), key: scaled}, pos, num_prefix=num_prefix)
    else:  # logit scaling only
        pe_state = encoder.precompute(params, pos, num_prefix=num_prefix)
    if scaling.qk_scale != 1.0:
        pe_state = state_lib.ScaledQK(pe_state, jnp.float32(scaling.qk_scale))
    return pe_state
