"""What studies of several domains share: evaluation names and arm variants."""

from __future__ import annotations

import dataclasses

from experiments.studies.lib import Arm

# configs/cifar100.py and configs/ucf101.py
CIFAR_EVALS = ("test", "test_shuffled")


def normalized(base: Arm, label: str) -> Arm:
    """`base` with positions in [-1, 1] (``model.position_convention="normalized"``)."""
    return dataclasses.replace(
        base,
        name=f"{base.name}_normalized",
        label=label,
        overrides=base.overrides + (("model.position_convention", "normalized"),),
    )
