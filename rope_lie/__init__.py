"""rope_lie: rotary and Lie-group position encodings for Vision Transformers in JAX/Flax."""

__version__ = "0.1.0"
