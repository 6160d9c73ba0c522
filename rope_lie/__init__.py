"""rope_lie: rotary and Lie-group position encodings for Vision Transformers in JAX/Flax.

A trained run (or a converted model) loads back as an NNX model and its config::

    import rope_lie
    model, config = rope_lie.load("workdirs/quickstart")
    logits_BV = model((images_BHWC / 255 - config.dataset.mean) / config.dataset.std)  # numpy 0-255
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ml_collections as mc

    from rope_lie.models import ViT

__version__ = "0.1.0"


def load(
    workdir: str, step: int | None = None, *, attention: str | None = None
) -> tuple[ViT, mc.ConfigDict]:
    """The trained model of a workdir and its config (``rope_lie.loading.load``).

    Args:
      workdir: a training run's workdir, or a directory written by ``rope_lie.convert``.
      step: the checkpoint step to load; None = the latest.
      attention: None: the run's attention backend (``model.attention``), refused where it
        cannot run; or another backend, which computes the same attention (``"xla"`` runs
        everywhere: a model trained with ``"cudnn"`` on a GPU, loaded on a CPU).

    Returns:
      (model, config): the NNX ViT with the checkpoint's parameters, and the workdir's
      ``config.json``.
    """
    try:
        from rope_lie import loading  # JAX and Flax are imported only when a model is loaded
    except ModuleNotFoundError as e:  # the core install: one line naming the extra to install
        from rope_lie import _extras

        _extras.raise_missing(e, "rope_lie.load")

    return loading.load(workdir, step, attention=attention)
