"""Position encodings as pure JAX functions (no flax below this package).

Three kinds, each an explicit dict from name to module:

- ``ROTARY``: ``init(key, *, num_heads, head_dim, num_axes, **hparams) -> params`` and
  ``apply(params, x_BTNH, pos_TA | pos_BTA, **APPLY_HPARAMS) -> x_BTNH`` (rotate q or k).
- ``BIAS``: ``init(...)`` and ``bias(params, pos_TA, pos_SA, ...) -> bias_NTS``.
- ``ADDITIVE``: tables added to the tokens before the first layer.

Each module's ``APPLY_HPARAMS`` names the hyperparameters that ``apply``/``bias`` also need
(e.g. RoPE's ``base``); all others are used by ``init`` only.
"""

from rope_lie.encodings import (
    alibi,
    ape,
    cayley_string,
    circulant_string,
    comrope,
    dinov3,
    liere,
    nope,
    positions,
    rope,
    rope_axial,
    rope_mixed,
    sincos,
    visionllama,
)

ROTARY = {
    "nope": nope,
    "rope": rope,
    "rope_axial": rope_axial,
    "rope_mixed": rope_mixed,
    "visionllama": visionllama,
    "liere": liere,
    "cayley_string": cayley_string,
    "circulant_string": circulant_string,
    "comrope": comrope,
    "dinov3": dinov3,
}
BIAS = {"alibi": alibi}
ADDITIVE = {"ape": ape, "sincos": sincos}

__all__ = ["ADDITIVE", "BIAS", "ROTARY", "positions"]
