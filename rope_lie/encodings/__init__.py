"""Position encodings as pure JAX functions (no flax below this package).

An encoder is a value: ``encoder(name, num_heads=, head_dim=, num_axes=, **settings)`` holds
every static setting, and its ``init(key)``, ``precompute(params, pos)`` (the state that rotates
q and k, or ALiBi's bias) and ``apply(params, x, pos)`` use them (``family.py``).

Three kinds of family, each an explicit dict from name to module:

- ``ROTARY``: ``init(key, *, num_heads, head_dim, num_axes, **settings) -> params`` and
  ``apply(params, x_BTNH, pos_TA | pos_BTA) -> x_BTNH`` (rotate q or k);
- ``BIAS``: ``init(...)`` and ``bias(params, pos_TA, pos_SA, ...) -> bias_NTS``;
- ``ADDITIVE``: tables added to the tokens before the first layer.

A module's ``init`` returns its arrays tagged with its settings, so its ``apply`` uses them.
Each rotary and bias module declares itself in ``FAMILY`` (``family.Family``): adding a family
is its module, its tests and its line in a dict below.
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
from rope_lie.encodings.family import Encoder, Family, Params, encoder, family_of

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


def families() -> dict[str, Family]:
    """Every rotary and bias family's self-description, by name."""
    return {name: module.FAMILY for name, module in {**ROTARY, **BIAS}.items()}


__all__ = [
    "ADDITIVE",
    "BIAS",
    "ROTARY",
    "Encoder",
    "Family",
    "Params",
    "encoder",
    "families",
    "family_of",
    "positions",
]
