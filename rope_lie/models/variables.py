"""Parameter types that the optimiser reads: weight decay is decided by a parameter's type.

``optim.should_decay``: a plain ``nnx.Param`` with two or more dims is a weight and is decayed;
a ``NoDecay`` never is (biases, normalisation scales, class tokens, layer scales, and the
position-encoding parameters, ``PositionParam``: decaying those pulls the rotations towards the
identity, i.e. towards NoPE, RoPE-Mixed arXiv:2403.13298 Sec. 3). Parameters with fewer than 2
dims are never decayed either (flax's own biases and norm scales; DeiT/timm practice).
"""

from __future__ import annotations

from flax import nnx


class NoDecay(nnx.Param):
    """A parameter that weight decay leaves alone (a bias, a scale, a token, an encoder's)."""
