"""PyTorch after TensorFlow crashes the process: check the import order before importing torch.

torch 2.14.1's Linux wheels depend on triton, which ``torch._dynamo`` (imported by torchvision,
so by timm) loads; loading triton's ``libtriton.so`` into a process that has already loaded
TensorFlow (rope_lie's data pipeline, ``rope_lie.train``) ends it with a segmentation fault
(``import tensorflow; import triton`` crashes; the other order works). The
converters call ``check()`` first, so the user gets this explanation instead of a crash.
"""

from __future__ import annotations

import importlib.util
import sys


def check() -> None:
    """Raise if TensorFlow is loaded and triton (installed) is not yet: importing it would crash."""
    if "tensorflow" not in sys.modules or "triton" in sys.modules:
        return
    if importlib.util.find_spec("triton") is None:
        return
    raise RuntimeError(
        "TensorFlow is already imported in this process, and importing PyTorch's triton after "
        "it crashes the process (segmentation fault). Convert in a fresh process "
        "(python -m rope_lie.convert ...), or import torch and timm before rope_lie.train / "
        "rope_lie.data."
    )
