"""The optional installs' modules, and the one-line error when a command needs a missing one.

The core install (``pip install rope_lie``: jax, numpy, chex) runs the encoders and
``python -m rope_lie.demo``; the training stack (``rope_lie.main``, ``rope_lie.load``) needs the
``train`` extra, and ``rope_lie.convert`` the ``interop`` extra. Where one of their modules is
missing, the user gets one line naming it and the install that brings it, instead of a
``ModuleNotFoundError`` from deep inside an import. Standard library only: this module runs in
the core install.
"""

from __future__ import annotations

import sys

# Top-level modules of the distributions that the train extra declares and the core does not
# (pyproject.toml; tests/test_dependencies.py checks the two agree).
TRAIN_MODULES = frozenset(
    {
        "absl",
        "flax",
        "importlib_resources",
        "ml_collections",
        "optax",
        "orbax",
        "PIL",
        "sklearn",
        "tensorboard",
        "tensorflow",
        "tensorflow_datasets",
        "tqdm",
    }
)
INTEROP_MODULES = frozenset({"torch", "torchvision", "timm"})  # the interop extra beyond train
EXTRAS = {"train": TRAIN_MODULES, "interop": TRAIN_MODULES | INTEROP_MODULES}


def missing_extra(error: ModuleNotFoundError, what: str, extra: str = "train") -> str | None:
    """The one-line message for ``error`` when it is a module of ``extra`` that is not
    installed; None when it is another module (a bug or a broken install: keep its traceback).

    Args:
      error: the ``ModuleNotFoundError`` raised while importing what ``what`` needs.
      what: what the user ran, e.g. ``"python -m rope_lie.main"`` or ``"rope_lie.load"``.
      extra: the extra that provides it, a key of ``EXTRAS``.

    Returns:
      e.g. ``python -m rope_lie.main needs the train extra, which is not installed (no module
      named 'flax'): pip install "rope_lie[train]" (pip install -e ".[train]" in a clone)``.
    """
    module = (error.name or "").split(".")[0]
    if module not in EXTRAS[extra]:
        return None
    return (
        f"{what} needs the {extra} extra, which is not installed (no module named {module!r}): "
        f'pip install "rope_lie[{extra}]" (pip install -e ".[{extra}]" in a clone)'
    )


def raise_missing(error: ModuleNotFoundError, what: str, extra: str = "train") -> None:
    """Re-raise ``error`` as a ``ModuleNotFoundError`` whose message is ``missing_extra``'s
    (no chained traceback), or unchanged when it is not a module of ``extra``. For library
    calls (``rope_lie.load``); call inside the ``except`` block."""
    message = missing_extra(error, what, extra)
    if message is None:
        raise error
    raise ModuleNotFoundError(message, name=error.name) from None


def exit_missing(error: ModuleNotFoundError, what: str, extra: str = "train") -> None:
    """For a command line's top-level imports: print ``error: <missing_extra's message>`` on
    stderr and exit with status 2 (the commands' status for an error in what was asked), or
    re-raise ``error`` unchanged when it is not a module of ``extra``."""
    message = missing_extra(error, what, extra)
    if message is None:
        raise error
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)
