"""The volumes studies: spatial arrows in 3D on CPU, UCF101 (``configs/ucf101.py``) at paper
scale."""

from __future__ import annotations

import dataclasses

from experiments.studies.definitions.common import CIFAR_EVALS
from experiments.studies.lib import Arm, Study


def _volume(name: str, label: str, arg: str) -> Arm:
    # CPU: spatial_arrows_3d; paper scale: the LieRE paper's 3D task, UCF101 (ViT-B).
    return Arm(name, label, "arrows3d", arg, paper_arg=arg, paper_recipe="ucf101")


VOLUMES_STUDY = Study(
    name="volumes",
    title="Spatial arrows in volumes (6x6x6 cells): 3D encodings",
    arms=(
        _volume("ape", "APE (N(0,1) init, LieRE ref.)", "pe=ape"),
        _volume("visionllama_liere", "VisionLlama (LieRE paper)", "pe=visionllama_liere"),
        _volume("liere_b2", "RoPE-Mixed = LieRE b2 (LieRE paper)", "pe=liere,block=2"),
        _volume("liere_b8", "LieRE 8x8", "pe=liere,block=8"),
    ),
    evals=("g6", "g8", "g6_shuffled"),
    # Table 1 / Table 5, UCF101 (not arrows): APE 40.9, VisionLlama 45.0, RoPE-Mixed 46.3,
    # LieRE8 47.0; shuffle drops 0.0 / 17.7 / 39.1 / 40.9 % (README compares the ordering).
    comparisons=(("liere_b8", "liere_b2"), ("liere_b2", "ape")),
    paper_scale=dict(
        evals=CIFAR_EVALS,  # configs/ucf101.py: test and test_shuffled clips
        paper={
            "ape": {"test": 0.409},
            "visionllama_liere": {"test": 0.450},
            "liere_b2": {"test": 0.463},
            "liere_b8": {"test": 0.470},
        },
    ),
)

V_LONG_STEPS = 2400  # 4x the volumes recipe's 600 steps


def _volume_long(base: Arm) -> Arm:
    """The volumes arm at 4x the steps, held-out evaluations every 300 steps along the way."""
    return dataclasses.replace(
        base,
        arg=f"{base.arg},steps={V_LONG_STEPS}",
        overrides=base.overrides + (("eval_every_steps", 300),),
        paper_arg=base.paper_arg,  # the paper scale (UCF101) has its own schedule
    )


_V_ARMS = {arm.name: arm for arm in VOLUMES_STUDY.arms}
_V_LONG_ARMS = ("liere_b8", "liere_b2", "ape")
VOLUMES_LONG_STUDY = dataclasses.replace(
    VOLUMES_STUDY,
    name="volumes_long",
    title=f"Spatial arrows in volumes at {V_LONG_STEPS} steps (4x): does the 3D task lift off?",
    # LieRE 8x8 is the pilot; 2x2 and APE follow at this length if the pilot lifts off.
    arms=tuple(_volume_long(_V_ARMS[name]) for name in _V_LONG_ARMS),
    comparisons=(("liere_b8", "liere_b2"), ("liere_b8", "ape"), ("liere_b2", "ape")),
    paper_scale=dict(
        evals=CIFAR_EVALS,
        paper={k: v for k, v in VOLUMES_STUDY.paper_scale["paper"].items() if k in _V_LONG_ARMS},
    ),
)
