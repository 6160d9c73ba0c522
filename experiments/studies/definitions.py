"""The studies: arms, reported evaluations and the papers' numbers (experiments/studies/README.md).

Arms name their variant plainly: "RoPE-Mixed (Heo et al.)" is rope-vit's RoPE-Mixed on patch
indices; "RoPE-Mixed = LieRE b2 (LieRE paper)" is what the LieRE paper's tables call RoPE-Mixed
(LieRE with 2x2 blocks, LieRE's init and [0, 1] positions); "VisionLlama (LieRE paper)" is the
LieRE reference code's fixed tiled rotation, "VisionLLaMA AS2D" the VisionLLaMA paper's.

CPU scale runs ``configs/arrows.py`` at ``res=cpu`` (ViT-mu/8, 500 steps of 128 on 20,000
layouts of an 8x8 grid of 8 px cells, 6-7 minutes a run on the 2-core AMD EPYC: arrows/README.md).
``--scale paper`` runs the paper's own experiment for each study: arrows at ``res=paper``
(ViT-B/12, 800,000 layouts, the paper's optimiser) for ``arrows`` and ``resolution``;
``configs/cifar100.py`` (ViT-B, the LieRE paper's CIFAR-100 recipe) for ``block_size``,
``sharing``, ``init`` and ``data_fraction``, whose tables are CIFAR-100's; ``configs/ucf101.py``
for ``volumes`` and ``configs/cayley.py`` (MNIST) for ``cayley``. Each study's ``paper_scale``
names the evaluations those recipes make.
"""

from __future__ import annotations

import dataclasses

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
    "liere_dense",
    "LieRE dense (16x16 = H)",
    "pe=liere,block=16",
    paper_arg="pe=liere,block=64,res=paper",  # ViT-B: H = 64
)

ARROWS_EVALS = ("g08", "g12", "g16", "g20", "g08_shuffled")
# configs/arrows.py at res=paper: the 9x9 training grid (108 px), 14x14 (168 px) and 23x23
# (276 px), the LieRE paper's Table 3 sizes; no 16 / 20 grid, no rescaled scenes.
ARROWS_PAPER_EVALS = ("g09", "g14", "g23", "g09_shuffled")
TO_PAPER_GRID = {"g08": "g09", "g12": "g14", "g20": "g23"}  # the same Table 3 column
# configs/cifar100.py and configs/ucf101.py
CIFAR_EVALS = ("test", "test_shuffled")


def _paper_grids(paper: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Table 3's numbers keyed by the res=paper evaluations instead of their CPU analogues."""
    return {arm: {TO_PAPER_GRID[k]: v for k, v in cells.items()} for arm, cells in paper.items()}


def _on_cifar100(arm: Arm) -> Arm:
    """`arm` with configs/cifar100.py at --scale paper (the same argument, LieRE dense = 64x64
    at ViT-B's H = 64); the CPU run is unchanged."""
    paper_arg = arm.arg.replace("block=16", "block=64")
    return dataclasses.replace(arm, paper_recipe="cifar100", paper_arg=paper_arg)


STUDIES: dict[str, Study] = {}


def _add(study: Study) -> Study:
    STUDIES[study.name] = study
    return study


ARROWS_TABLE3 = {
    "ape": {"g08": 0.451, "g12": 0.410, "g20": 0.401},
    "visionllama_liere": {"g08": 0.464, "g12": 0.486, "g20": 0.486},
    "liere_b2": {"g08": 1.000, "g12": 0.986, "g20": 0.886},
    "liere_b8": {"g08": 0.995, "g12": 0.997, "g20": 0.997},
    "liere_dense": {"g08": 1.000, "g12": 1.000, "g20": 1.000},
}
_add(
    Study(
        name="arrows",
        title="Spatial arrows: which encodings learn positions, and extrapolate to larger grids",
        arms=(APE, VL_LIERE, VL_AS2D, MIXED_HEO, LIERE_B2, LIERE_B8, LIERE_DENSE),
        evals=ARROWS_EVALS,
        # LieRE Table 3 (ViT-B, 108 / 168 / 276 px = 1x / 1.56x / 2.56x the grid); our g12 is
        # 1.5x and g20 2.5x. The paper has no shuffled-arrows column (Table 5 is CIFAR-100).
        paper=ARROWS_TABLE3,
        comparisons=(("liere_b8", "liere_b2"), ("liere_b2", "rope_mixed_heo")),
        paper_scale=dict(evals=ARROWS_PAPER_EVALS, paper=_paper_grids(ARROWS_TABLE3)),
    )
)

# --------------------------------------------------------------------------- block size

LIERE_B4 = _arrows("liere_b4", "LieRE 4x4", "pe=liere,block=4")
_add(
    Study(
        name="block_size",
        title="LieRE block size (2 = the paper's RoPE-Mixed, 16 = dense at H = 16)",
        arms=tuple(_on_cifar100(a) for a in (LIERE_B2, LIERE_B4, LIERE_B8, LIERE_DENSE)),
        evals=ARROWS_EVALS,
        # Table 10 is CIFAR-100 / UCF101, not arrows: the paper's shape (peak at 8x8) is what
        # we compare, not its numbers. CIFAR-100 2 / 4 / 8 / 16 / 64: 68.84 / 69.28 / 70.32 /
        # 69.85 / 69.99 (README).
        comparisons=(
            ("liere_b8", "liere_b2"),
            ("liere_b8", "liere_b4"),
            ("liere_b8", "liere_dense"),
        ),
        paper_scale=dict(
            evals=CIFAR_EVALS,
            paper={
                "liere_b2": {"test": 0.6884},
                "liere_b4": {"test": 0.6928},
                "liere_b8": {"test": 0.7032},
                "liere_dense": {"test": 0.6999},  # block 64 at ViT-B
            },
        ),
    )
)

# --------------------------------------------------------------------------- sharing

SHARING = {
    "layers": (("model.share_pe_layers", True),),
    "heads": (("model.share_pe_heads", True),),
    "all": (("model.share_pe_layers", True), ("model.share_pe_heads", True)),
}


def _shared(base: Arm, what: str) -> Arm:
    return dataclasses.replace(
        base,
        name=f"{base.name}_shared_{what}",
        label=f"{base.label}, shared across {what}",
        overrides=base.overrides + SHARING[what],
    )


_add(
    Study(
        name="sharing",
        title="Sharing LieRE's generators across layers, heads or both",
        arms=tuple(
            _on_cifar100(arm)
            for base in (LIERE_B2, LIERE_B8)
            for arm in (base, *(_shared(base, w) for w in SHARING))
        ),
        evals=ARROWS_EVALS,
        # Table 4 is CIFAR-100 (RoPE-Mixed / LieRE8): independent 68.8 / 70.3, layers 68.7 /
        # 69.8, heads 69.5 / 69.7, all 68.3 / 69.5; not arrows numbers (README).
        comparisons=tuple(
            (base.name, f"{base.name}_shared_{w}") for base in (LIERE_B2, LIERE_B8) for w in SHARING
        ),
        paper_scale=dict(
            evals=CIFAR_EVALS,
            paper={
                f"{base}{suffix}": {"test": value}
                for base, values in (
                    ("liere_b2", (0.688, 0.687, 0.695, 0.683)),
                    ("liere_b8", (0.703, 0.698, 0.697, 0.695)),
                )
                for suffix, value in zip(
                    ("", "_shared_layers", "_shared_heads", "_shared_all"), values, strict=True
                )
            },
        ),
    )
)

# --------------------------------------------------------------------------- initialisation


def _init_one(base: Arm) -> Arm:
    return dataclasses.replace(
        base,
        name=f"{base.name}_init1",
        label=f"{base.label}, init U[0, 1)",
        arg=f"{base.arg},init_scale=1",
        paper_arg=None,
    )


_add(
    Study(
        name="init",
        title="LieRE generator init: U[0, 2 pi) (reference) vs U[0, 1)",
        arms=tuple(
            _on_cifar100(a) for a in (LIERE_B8, _init_one(LIERE_B8), LIERE_B2, _init_one(LIERE_B2))
        ),
        evals=ARROWS_EVALS,
        # Table 7 (CIFAR-100, paired z-test, 1 - 2 pi): LieRE8 -1.18 points (p = 0.070),
        # RoPE-Mixed (= b2) -2.55 points (p = 0.00012).
        comparisons=(("liere_b8_init1", "liere_b8"), ("liere_b2_init1", "liere_b2")),
        default_seeds=5,
        paper_scale=dict(evals=CIFAR_EVALS),  # Table 7 gives differences, not accuracies
    )
)

# --------------------------------------------------------------------------- data fraction

FRACTIONS = (0.05, 0.2)  # of the 20,000 training layouts; 1.0 is the arrows study's run


def _fraction(base: Arm, fraction: float) -> Arm:
    return dataclasses.replace(
        base,
        name=f"{base.name}_f{round(100 * fraction):03d}",
        label=f"{base.label}, {100 * fraction:g} % of the layouts",
        overrides=base.overrides + (("dataset.train_fraction", fraction),),
    )


_DATA_ARMS = (APE, VL_LIERE, LIERE_B2, LIERE_B8)
_add(
    Study(
        name="data_fraction",
        title="Training on fewer layouts (same 500 steps): who still learns positions",
        arms=tuple(
            _on_cifar100(arm)
            for base in _DATA_ARMS
            for arm in (base, *(_fraction(base, f) for f in FRACTIONS))
        ),
        evals=ARROWS_EVALS,
        comparisons=tuple(
            (f"liere_b8_f{round(100 * f):03d}", f"liere_b2_f{round(100 * f):03d}")
            for f in FRACTIONS
        ),
        curves=(
            "% of the 20,000 training layouts",
            tuple(
                (
                    base.label,
                    ((100.0, base.name), *((100 * f, _fraction(base, f).name) for f in FRACTIONS)),
                )
                for base in _DATA_ARMS
            ),
        ),
        # Fig. 4 trains on 20-90 % of CIFAR-100; Table 1 gives the full-data accuracies.
        paper_scale=dict(
            evals=CIFAR_EVALS,
            paper={
                "ape": {"test": 0.639},
                "visionllama_liere": {"test": 0.655},
                "liere_b2": {"test": 0.688},
                "liere_b8": {"test": 0.703},
            },
        ),
    )
)

# --------------------------------------------------------------------------- resolution

NOPE = _arrows("nope", "NoPE", "pe=nope")
ALIBI = _arrows("alibi", "2D ALiBi (integer)", "pe=alibi")


def _normalized(base: Arm, label: str) -> Arm:
    return dataclasses.replace(
        base,
        name=f"{base.name}_normalized",
        label=label,
        overrides=base.overrides + (("model.position_convention", "normalized"),),
    )


RESOLUTION_EVALS = ("g08", "g12", "g16", "g20", "px080", "px096", "px128")
_add(
    Study(
        name="resolution",
        title="Resolution: larger grids (extrapolation) and the same scenes at more pixels",
        arms=(
            APE,
            NOPE,
            MIXED_HEO,
            _normalized(MIXED_HEO, "RoPE-Mixed (Heo et al.), [-1, 1] positions"),
            ALIBI,
            _normalized(ALIBI, "2D ALiBi, [-1, 1] positions"),
            LIERE_B8,
        ),
        evals=RESOLUTION_EVALS,
        # Seed 004's ImageNet-100 table (224 / 384 px, same images at more pixels): APE 55.48 /
        # 55.88, NoPE 53.86 / 54.16, RoPE-Mixed 55.26 / 58.92, 2D ALiBi 60.74 / 65.76; the
        # ordering (ALiBi > RoPE-Mixed > APE > NoPE above the training size) is compared.
        comparisons=(("alibi", "rope_mixed_heo"), ("rope_mixed_heo", "ape")),
        eval_curves=(
            "test size / training size (per side)",
            (
                (
                    "larger grid, same 8 px cells (extrapolation)",
                    ((1.0, "g08"), (1.5, "g12"), (2.0, "g16"), (2.5, "g20")),
                ),
                (
                    "same 8x8 scene, more pixels (interpolation)",
                    ((1.0, "g08"), (1.25, "px080"), (1.5, "px096"), (2.0, "px128")),
                ),
            ),
        ),
        # res=paper evaluates larger grids only (no rescaled scenes): the extrapolation panel.
        paper_scale=dict(
            evals=ARROWS_PAPER_EVALS[:3],
            eval_curves=(
                "test size / training size (per side)",
                (
                    (
                        "larger grid, same 12 px cells (extrapolation)",
                        ((1.0, "g09"), (14 / 9, "g14"), (23 / 9, "g23")),
                    ),
                ),
            ),
        ),
    )
)

# --------------------------------------------------------------------------- Cayley-STRING


def _cayley(name: str, label: str, arg: str) -> Arm:
    # CPU: sklearn digits with the study's ViT; paper scale: the study's recipe on MNIST.
    paper_arg = "dataset=mnist," + arg.replace("pe=cayley_string,", "")
    return Arm(
        name,
        label,
        "digits",
        f"{arg},variant=string",
        paper_arg=paper_arg,
        paper_recipe="cayley",
    )


_add(
    Study(
        name="cayley",
        title="Sparse Cayley-STRING generators on sklearn digits (the study's H = 12 ViT)",
        arms=(
            _cayley("dense", "Cayley-STRING dense", "pe=cayley_string,generator=dense"),
            _cayley(
                "block2x2", "Cayley-STRING 2x2 (closed form)", "pe=cayley_string,generator=block2x2"
            ),
            _cayley(
                "banded", "Cayley-STRING banded (bw 2)", "pe=cayley_string,generator=banded,bw=2"
            ),
            _cayley(
                "topk",
                "Cayley-STRING top-k (k 24, init N(0, 0.02))",
                "pe=cayley_string,generator=topk,k=24",
            ),
            _cayley("rope_mixed", "RoPE-Mixed (no P)", "pe=rope_mixed"),
        ),
        evals=("size8", "size16", "size8_shuffled"),
        # Study Table 1 (MNIST best accuracy 0.9595-0.9681 for all generators; CIFAR-10
        # 0.7299-0.7374): all about equal. Digits is our stand-in (no downloads here).
        comparisons=(("dense", "block2x2"), ("dense", "topk"), ("dense", "rope_mixed")),
        paper_scale=dict(evals=("test",)),  # configs/cayley.py: the 10,000 MNIST test images
    )
)

# --------------------------------------------------------------------------- volumes


def _volume(name: str, label: str, arg: str) -> Arm:
    # CPU: spatial_arrows_3d; paper scale: the LieRE paper's 3D task, UCF101 (ViT-B).
    return Arm(name, label, "arrows3d", arg, paper_arg=arg, paper_recipe="ucf101")


_add(
    Study(
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


_V_ARMS = {arm.name: arm for arm in STUDIES["volumes"].arms}
_V_LONG_ARMS = ("liere_b8", "liere_b2", "ape")
_add(
    dataclasses.replace(
        STUDIES["volumes"],
        name="volumes_long",
        title=f"Spatial arrows in volumes at {V_LONG_STEPS} steps (4x): does the 3D task lift off?",
        # LieRE 8x8 is the pilot; 2x2 and APE follow at this length if the pilot lifts off.
        arms=tuple(_volume_long(_V_ARMS[name]) for name in _V_LONG_ARMS),
        paper_scale=dict(
            evals=CIFAR_EVALS,
            paper={
                k: v
                for k, v in STUDIES["volumes"].paper_scale["paper"].items()
                if k in _V_LONG_ARMS
            },  # fmt: skip
        ),
    )
)

# --------------------------------------------------------------------------- Fashion-MNIST


def _fashion(name: str, label: str, arg: str, **kw) -> Arm:
    # configs/fashion_mnist.py: ViT-mu/4 on the 60,000 28x28 images, evaluated once, at the end.
    # No paper scale: the papers did not use Fashion-MNIST, so --scale paper runs the same.
    return Arm(name, label, "fashion_mnist", arg, paper_arg=arg, **kw)


F_APE = _fashion("ape", "APE (N(0,1) init, LieRE ref.)", "pe=ape")
F_NOPE = _fashion("nope", "NoPE", "pe=nope")
F_VL_LIERE = _fashion("visionllama_liere", "VisionLlama (LieRE paper)", "pe=visionllama_liere")
F_VL_AS2D = _fashion("visionllama_as2d", "VisionLLaMA AS2D", "pe=visionllama")
F_MIXED_HEO = _fashion("rope_mixed_heo", "RoPE-Mixed (Heo et al.)", "pe=rope_mixed")
F_LIERE_B2 = _fashion("liere_b2", "RoPE-Mixed = LieRE b2 (LieRE paper)", "pe=liere,block=2")
F_LIERE_B8 = _fashion("liere_b8", "LieRE 8x8", "pe=liere,block=8")
F_LIERE_DENSE = _fashion("liere_dense", "LieRE dense (16x16 = H)", "pe=liere,block=16")
F_CAYLEY_B2 = _fashion(
    "cayley_block2x2",
    "Cayley-STRING 2x2 (closed form)",
    "pe=cayley_string,generator=block2x2",
)
F_ALIBI = _fashion("alibi", "2D ALiBi (integer)", "pe=alibi")
F_COMROPE = _fashion("comrope_ld", "ComRoPE-LD (8x8 blocks)", "pe=comrope")
F_DINOV3 = _fashion("dinov3", "DINOv3 RoPE (centred positions)", "pe=dinov3")
F_DINOV3_AUG = _fashion(
    "dinov3_rescale2",
    "DINOv3 RoPE, coordinates rescaled in training (x[1/2, 2])",
    "pe=dinov3,rescale=2",
)
FASHION_MAIN = (F_APE, F_MIXED_HEO, F_LIERE_B2, F_LIERE_B8)  # 5 seeds; the other arms 3
FASHION_EVALS = ("test", "test_shuffled")
FASHION_RESOLUTION_EVALS = (
    "test", "px36", "px44", "px56", "canvas36", "canvas44", "canvas56",
)  # fmt: skip

_add(
    Study(
        name="fashion",
        title="Fashion-MNIST: accuracy and the shuffled-patch drop (LieRE Tables 1 and 5)",
        arms=(
            *FASHION_MAIN,
            F_NOPE,
            F_VL_LIERE,
            F_VL_AS2D,
            F_LIERE_DENSE,
            F_CAYLEY_B2,
            F_ALIBI,
            F_COMROPE,
            F_DINOV3,
        ),
        evals=FASHION_EVALS,
        # Table 1 (CIFAR-100, not Fashion-MNIST): APE 63.9, VisionLlama 65.5, RoPE-Mixed (= b2)
        # 68.8, LieRE8 70.3, LieRE64 70.0; Table 5 drops 69.3 / 54.8 / 75.1 / 82.5 / 84.6 %.
        # The ordering and the drops are compared, not the numbers.
        paper={
            "ape": {"test": 0.639},
            "visionllama_liere": {"test": 0.655},
            "liere_b2": {"test": 0.688},
            "liere_b8": {"test": 0.703},
            "liere_dense": {"test": 0.700},
        },
        comparisons=(
            ("liere_b8", "liere_b2"),
            ("liere_b2", "ape"),
            ("liere_b8", "ape"),
            ("liere_b2", "rope_mixed_heo"),
        ),
        default_seeds=3,
    )
)


def _scale_aug(base: Arm) -> Arm:
    return dataclasses.replace(
        base,
        name=f"{base.name}_scaleaug",
        label=f"{base.label}, scale-augmented",
        arg=f"{base.arg},scale_aug",
        paper_arg=f"{base.arg},scale_aug",
    )


_F_RES_BASE = (
    F_APE,
    F_NOPE,
    F_MIXED_HEO,
    _normalized(F_MIXED_HEO, "RoPE-Mixed (Heo et al.), [-1, 1] positions"),
    F_ALIBI,
    F_LIERE_B8,
)
_add(
    Study(
        name="fashion_resolution",
        title="Fashion-MNIST at other resolutions: more pixels, and a larger canvas",
        arms=(
            *_F_RES_BASE,
            *(_scale_aug(a) for a in _F_RES_BASE),
            F_DINOV3,
            F_DINOV3_AUG,
        ),
        evals=FASHION_RESOLUTION_EVALS,
        # Seed 004's ImageNet-100 table (224 / 384 px, more pixels): APE 55.48 / 55.88, NoPE
        # 53.86 / 54.16, RoPE-Mixed 55.26 / 58.92, 2D ALiBi 60.74 / 65.76.
        comparisons=(("alibi", "rope_mixed_heo"), ("alibi_scaleaug", "rope_mixed_heo_scaleaug")),
        eval_curves=(
            "test side / training side (28 px)",
            (
                (
                    "same image, more pixels",
                    ((1.0, "test"), (36 / 28, "px36"), (44 / 28, "px44"), (2.0, "px56")),
                ),
                (
                    "same image on a larger canvas",
                    (
                        (1.0, "test"),
                        (36 / 28, "canvas36"),
                        (44 / 28, "canvas44"),
                        (2.0, "canvas56"),
                    ),
                ),
            ),
        ),
    )
)

F_FRACTIONS = (0.1, 0.2, 0.5)  # of the 60,000 training images, same epochs; 1.0 is `fashion`'s


def _f_fraction(base: Arm, fraction: float, fixed_steps: int | None = None) -> Arm:
    suffix = f"_f{round(100 * fraction):03d}" + ("_steps" if fixed_steps else "")
    extra = (("dataset.train_fraction", fraction),)
    if fixed_steps:
        extra += (("total_steps", fixed_steps),)
    return dataclasses.replace(
        base,
        name=base.name + suffix,
        label=f"{base.label}, {100 * fraction:g} %" + (" (same steps)" if fixed_steps else ""),
        overrides=base.overrides + extra,
    )


_F_DATA_ARMS = (F_APE, F_VL_LIERE, F_LIERE_B2, F_LIERE_B8)
F_FULL_STEPS = 1404  # 3 x (60,000 // 128) steps: the fixed-steps control's length
_add(
    Study(
        name="fashion_data_fraction",
        title="Fashion-MNIST with 10-100 % of the training set (same epochs; LieRE Fig. 4)",
        arms=tuple(
            arm
            for base in _F_DATA_ARMS
            for arm in (
                base,
                *(_f_fraction(base, f) for f in F_FRACTIONS),
                _f_fraction(base, 0.1, F_FULL_STEPS),
            )
        ),
        evals=FASHION_EVALS,
        comparisons=tuple(
            (f"liere_b8_f{round(100 * f):03d}", f"ape_f{round(100 * f):03d}") for f in F_FRACTIONS
        ),
        curves=(
            "% of the 60,000 training images (same epochs)",
            tuple(
                (
                    base.label,
                    (
                        (100.0, base.name),
                        *((100 * f, _f_fraction(base, f).name) for f in F_FRACTIONS),
                    ),
                )
                for base in _F_DATA_ARMS
            ),
        ),
    )
)


def _cayley_fashion(name: str, label: str, arg: str) -> Arm:
    # configs/cayley.py's MNIST recipe (the study's H = 12 ViT, 10 epochs, AdamW 2e-3, wd 1e-4)
    # on Fashion-MNIST; evaluated once, at the end (no model is picked on the test set).
    return Arm(
        name,
        label,
        "cayley",
        f"dataset=fashion_mnist,{arg}",
        overrides=(("eval_every_epochs", 0.0),),
        paper_arg=f"dataset=fashion_mnist,{arg}",  # no paper scale on Fashion-MNIST
    )


_add(
    Study(
        name="cayley_fashion",
        title="Sparse Cayley-STRING generators on Fashion-MNIST (the study's MNIST recipe)",
        arms=(
            _cayley_fashion("dense", "Cayley-STRING dense", "generator=dense"),
            _cayley_fashion("block2x2", "Cayley-STRING 2x2 (closed form)", "generator=block2x2"),
            _cayley_fashion("banded", "Cayley-STRING banded (bw 2)", "generator=banded,bw=2"),
            _cayley_fashion(
                "topk", "Cayley-STRING top-k (k 24, init N(0, 0.02))", "generator=topk,k=24"
            ),
            _cayley_fashion("rope_mixed", "RoPE-Mixed (no P)", "pe=rope_mixed"),
        ),
        evals=("test",),
        # Study Table 1, MNIST (best over epochs): dense 0.9680, 2x2 0.9595, banded bw 2
        # 0.9681, top-k k 24 0.9650: all about equal. Fashion-MNIST is our real-image analogue.
        paper={
            "dense": {"test": 0.9680},
            "block2x2": {"test": 0.9595},
            "banded": {"test": 0.9681},
            "topk": {"test": 0.9650},
        },
        comparisons=(("dense", "block2x2"), ("dense", "banded"), ("dense", "rope_mixed")),
    )
)


# --------------------------------------------------------------------------- mixed sizes (NaFlex)


def _naflex(base: Arm) -> Arm:
    """The same arm trained on mixed-size batches (the recipe's ``naflex`` argument)."""
    paper_arg = None if base.paper_arg is None else f"{base.paper_arg},naflex"
    return dataclasses.replace(
        base,
        name=f"{base.name}_naflex",
        label=f"{base.label}, mixed sizes (NaFlex)",
        arg=f"{base.arg},naflex",
        paper_arg=paper_arg,
    )


A_ALIBI = _arrows("alibi", "2D ALiBi (integer)", "pe=alibi")
_NAFLEX_ARROWS = (LIERE_B8, MIXED_HEO, APE, A_ALIBI)
_add(
    Study(
        name="naflex",
        title="Spatial arrows trained on mixed sizes (6-10 patches a side, NaFlex) vs fixed 8x8",
        arms=tuple(arm for base in _NAFLEX_ARROWS for arm in (base, _naflex(base))),
        # Evaluations both kinds of run make: larger grids of the same cells, and the training
        # grid's scenes at more pixels (the NaFlex runs also record naflex_sNN).
        evals=(*ARROWS_EVALS, "px080", "px096", "px128"),
        comparisons=tuple((f"{base.name}_naflex", base.name) for base in _NAFLEX_ARROWS),
        paper_scale=dict(evals=ARROWS_PAPER_EVALS),  # res=paper: larger grids only
    )
)
_NAFLEX_FASHION = (F_LIERE_B8, F_MIXED_HEO, F_APE, F_ALIBI)
_add(
    Study(
        name="fashion_naflex",
        title="Fashion-MNIST trained on mixed sizes (5-9 patches a side, NaFlex) vs fixed 28 px",
        arms=tuple(arm for base in _NAFLEX_FASHION for arm in (base, _naflex(base))),
        evals=FASHION_RESOLUTION_EVALS,
        comparisons=tuple((f"{base.name}_naflex", base.name) for base in _NAFLEX_FASHION),
    )
)
