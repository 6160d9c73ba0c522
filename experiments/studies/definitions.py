"""The studies: arms, reported evaluations and the papers' numbers (../shared/STUDIES.md).

Arms name their variant plainly: "RoPE-Mixed (Heo et al.)" is rope-vit's RoPE-Mixed on patch
indices; "RoPE-Mixed = LieRE b2 (LieRE paper)" is what the LieRE paper's tables call RoPE-Mixed
(LieRE with 2x2 blocks, LieRE's init and [0, 1] positions); "VisionLlama (LieRE paper)" is the
LieRE reference code's fixed tiled rotation, "VisionLLaMA AS2D" the VisionLLaMA paper's.

CPU scale runs ``configs/arrows.py`` at ``res=cpu`` (ViT-mu/8, 500 steps of 128 on 20,000
layouts of an 8x8 grid of 8 px cells, about 4-5 minutes a run on 2 cores); ``--scale paper``
runs the same arms with ``res=paper`` (ViT-B/12, 800,000 layouts, the paper's optimiser).
"""

from __future__ import annotations

from experiments.studies.lib import Arm, Study

# --------------------------------------------------------------------------- arrows arms


def _arrows(name: str, label: str, arg: str, **kw) -> Arm:
    # Evaluate once, at the end (the recipe also evaluates half-way).
    return Arm(name, label, "arrows", arg, overrides=(("eval_every_steps", 0),), **kw)


APE = _arrows("ape", "APE (N(0,1) init, LieRE ref.)", "pe=ape")
VL_LIERE = _arrows("visionllama_liere", "VisionLlama (LieRE paper)", "pe=visionllama_liere")
VL_AS2D = _arrows("visionllama_as2d", "VisionLLaMA AS2D", "pe=visionllama")
MIXED_HEO = _arrows("rope_mixed_heo", "RoPE-Mixed (Heo et al.)", "pe=rope_mixed")
LIERE_B2 = _arrows("liere_b2", "RoPE-Mixed = LieRE b2 (LieRE paper)", "pe=liere,block=2")
LIERE_B8 = _arrows("liere_b8", "LieRE 8x8", "pe=liere,block=8")
LIERE_DENSE = _arrows(
    "liere_dense", "LieRE dense (16x16 = H)", "pe=liere,block=16", paper_arg="pe=liere,block=64"
)

ARROWS_EVALS = ("g08", "g12", "g16", "g20", "g08_shuffled")

STUDIES: dict[str, Study] = {}


def _add(study: Study) -> Study:
    STUDIES[study.name] = study
    return study


_add(
    Study(
        name="arrows",
        title="Spatial arrows: which encodings learn positions, and extrapolate to larger grids",
        arms=(APE, VL_LIERE, VL_AS2D, MIXED_HEO, LIERE_B2, LIERE_B8, LIERE_DENSE),
        evals=ARROWS_EVALS,
        # LieRE Table 3 (ViT-B, 108 / 168 / 276 px = 1x / 1.56x / 2.56x the grid); our g12 is
        # 1.5x and g20 2.5x. The paper has no shuffled-arrows column (Table 5 is CIFAR-100).
        paper={
            "ape": {"g08": 0.451, "g12": 0.410, "g20": 0.401},
            "visionllama_liere": {"g08": 0.464, "g12": 0.486, "g20": 0.486},
            "liere_b2": {"g08": 1.000, "g12": 0.986, "g20": 0.886},
            "liere_b8": {"g08": 0.995, "g12": 0.997, "g20": 0.997},
            "liere_dense": {"g08": 1.000, "g12": 1.000, "g20": 1.000},
        },
        comparisons=(("liere_b8", "liere_b2"), ("liere_b2", "rope_mixed_heo")),
    )
)
