"""The Fashion-MNIST studies (``configs/fashion_mnist.py``, and ``configs/cayley.py``'s MNIST
recipe for ``cayley_fashion``). The papers did not use Fashion-MNIST: ``--scale paper`` runs the
same recipes."""

from __future__ import annotations

import dataclasses

from configs import fashion_mnist
from experiments.studies.definitions.common import normalized
from experiments.studies.lib import Arm, Study


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
F_DINOV3_P075 = _fashion(
    "dinov3_p075",
    "DINOv3 RoPE, p-RoPE 0.75 (lowest frequency per axis unrotated)",
    "pe=dinov3,rotary_fraction=0.75",
)
FASHION_MAIN = (F_APE, F_MIXED_HEO, F_LIERE_B2, F_LIERE_B8)  # 5 seeds; the other arms 3
FASHION_EVALS = ("test", "test_shuffled")
FASHION_RESOLUTION_EVALS = ("test", "px36", "px44", "px56", "canvas36", "canvas44", "canvas56")

FASHION_STUDY = Study(
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
        F_DINOV3_P075,
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
        ("comrope_ld", "liere_b8"),  # ComRoPE's claim: +1.6 over LieRE (ImageNet)
        ("dinov3", "rope_mixed_heo"),  # centred [-1, 1] positions vs integer ones
        ("dinov3_p075", "dinov3"),  # p-RoPE: a quarter of the pairs unrotated
    ),
    default_seeds=3,
)


def _scale_aug(base: Arm) -> Arm:
    return dataclasses.replace(
        base,
        name=f"{base.name}_scaleaug",
        label=f"{base.label}, scale-augmented",
        arg=f"{base.arg},scale_aug",
        paper_arg=f"{base.arg},scale_aug",
    )


F_MIXED_NORMALIZED = normalized(F_MIXED_HEO, "RoPE-Mixed (Heo et al.), [-1, 1] positions")
_F_RES_BASE = (F_APE, F_NOPE, F_MIXED_HEO, F_MIXED_NORMALIZED, F_ALIBI, F_LIERE_B8)
FASHION_RESOLUTION_STUDY = Study(
    name="fashion_resolution",
    title="Fashion-MNIST at other resolutions: more pixels, and a larger canvas",
    arms=(
        *_F_RES_BASE,
        *(_scale_aug(a) for a in _F_RES_BASE),
        F_COMROPE,
        F_DINOV3,
        F_DINOV3_AUG,
        F_DINOV3_P075,
    ),
    evals=FASHION_RESOLUTION_EVALS,
    # Seed 004's ImageNet-100 table (224 / 384 px, more pixels): APE 55.48 / 55.88, NoPE
    # 53.86 / 54.16, RoPE-Mixed 55.26 / 58.92, 2D ALiBi 60.74 / 65.76.
    comparisons=(
        ("alibi", "rope_mixed_heo"),
        ("alibi_scaleaug", "rope_mixed_heo_scaleaug"),
        ("dinov3_rescale2", "dinov3"),  # DINOv3's coordinate rescaling, the one change
        ("comrope_ld", "liere_b8"),  # ComRoPE's claim: +2.9 over LieRE at a higher resolution
        ("dinov3", "rope_mixed_heo"),  # centred [-1, 1] positions vs integer ones
        ("dinov3_p075", "dinov3"),  # p-RoPE: the lowest frequencies off, at other sizes
        ("rope_mixed_heo_normalized", "rope_mixed_heo"),  # the position convention alone
        ("dinov3", "rope_mixed_heo_normalized"),  # DINOv3 vs RoPE-Mixed, both in [-1, 1]
    ),
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

F_AXIAL = _fashion("rope_axial", "RoPE-Axial (Heo et al.)", "pe=rope_axial")
# The tools each integer-position arm takes (rope_lie.encodings.extrapolation.tools_for: the
# recipe's extrapolation_evals adds exactly these evaluations; tested).
EXTRAPOLATION_TOOLS = {
    "rope_mixed_heo": ("pi", "yarn", "logit"),  # learned frequencies: no base for NTK
    "rope_axial": ("pi", "ntk", "yarn", "logit"),
    "liere_b8": ("pi", "logit"),  # learned generators: position scaling
}
TOOL_LABELS = {
    "pi": "position interpolation",
    "ntk": "NTK-aware base",
    "yarn": "YaRN",
    "logit": "logits x log n / log n_train",
}


def _with_tools(base: Arm) -> tuple[Arm, ...]:
    """`base` trained once with every tool's evaluations beside its own, and one arm per tool
    reading them (``eval_suffix``): each tool is an evaluation of the same trained run, so
    the comparison with the arm is paired by seed."""
    arg = f"{base.arg},extrapolation_evals"
    trained = dataclasses.replace(base, arg=arg, paper_arg=arg)
    return (
        trained,
        *(
            dataclasses.replace(
                trained,
                name=f"{base.name}_{tool}",
                label=f"{base.label} + {TOOL_LABELS[tool]}",
                eval_suffix=f"@{tool}",
            )
            for tool in EXTRAPOLATION_TOOLS[base.name]
        ),
    )


def _rpe(base: Arm, scale: int = 2) -> Arm:
    """`base` trained with RPE-2D's randomized positions from a grid `scale` times larger."""
    arg = f"{base.arg},rpe={scale}"
    return dataclasses.replace(
        base,
        name=f"{base.name}_rpe{scale}",
        label=f"{base.label}, RPE-2D positions ({scale}x grid) in training",
        arg=arg,
        paper_arg=arg,
    )


_F_INTEGER = (F_MIXED_HEO, F_AXIAL, F_LIERE_B8)
FASHION_EXTRAPOLATION_STUDY = Study(
    name="fashion_extrapolation",
    title="Fashion-MNIST above the training size: extrapolation tools for integer positions",
    arms=(
        *(arm for base in _F_INTEGER for arm in _with_tools(base)),
        *(_rpe(base) for base in _F_INTEGER),
        # positions relative to the image's extent: fashion_resolution's runs, reused
        F_MIXED_NORMALIZED,
        F_DINOV3,
        F_COMROPE,
    ),
    evals=FASHION_RESOLUTION_EVALS,
    comparisons=(
        *(
            (f"{base.name}_{tool}", base.name)
            for base in _F_INTEGER
            for tool in EXTRAPOLATION_TOOLS[base.name]
        ),
        *((f"{base.name}_rpe2", base.name) for base in _F_INTEGER),
        # does a tool close the gap to positions relative to the extent?
        ("rope_mixed_heo_pi", "rope_mixed_heo_normalized"),
        ("rope_mixed_heo_yarn", "rope_mixed_heo_normalized"),
        ("rope_mixed_heo_rpe2", "rope_mixed_heo_normalized"),
        ("rope_axial_ntk", "dinov3"),
        ("rope_axial_yarn", "dinov3"),
        ("liere_b8_pi", "comrope_ld"),
    ),
    eval_curves=FASHION_RESOLUTION_STUDY.eval_curves,
)

F_FRACTIONS = (0.1, 0.2, 0.5)  # of the 60,000 training images, same epochs; 1.0 is `fashion`'s


def _f_fraction(base: Arm, fraction: float, fixed_steps: int | None = None) -> Arm:
    suffix = f"_f{round(100 * fraction):03d}" + ("_steps" if fixed_steps else "")
    extra = (("dataset.train_fraction", fraction),)
    if fixed_steps:
        extra += (("total_steps", fixed_steps),)
    else:  # fewer steps: the warmup keeps its share of the run (10 %: 20 of 138 steps)
        extra += (("optim.warmup_steps", round(fashion_mnist.WARMUP_STEPS * fraction)),)
    # Only test and test_shuffled (this study's evaluations): at 10 % of the data the six
    # resolution evaluations would cost more than the training.
    arg = f"{base.arg},resolution_evals=false"
    return dataclasses.replace(
        base,
        name=base.name + suffix,
        label=f"{base.label}, {100 * fraction:g} %" + (" (same steps)" if fixed_steps else ""),
        arg=arg,
        paper_arg=arg,
        overrides=base.overrides + extra,
    )


_F_DATA_ARMS = (F_APE, F_VL_LIERE, F_LIERE_B2, F_LIERE_B8)
F_FULL_STEPS = 1404  # 3 x (60,000 // 128) steps: the fixed-steps control's length
FASHION_DATA_FRACTION_STUDY = Study(
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
    comparisons=(
        *((f"liere_b8_f{round(100 * f):03d}", f"ape_f{round(100 * f):03d}") for f in F_FRACTIONS),
        ("liere_b8", "ape"),
        # The fixed-steps control: the gap at equal steps, and what 10 % of the data costs each
        # arm when the run is as long as the full one.
        ("liere_b8_f010_steps", "ape_f010_steps"),
        ("ape_f010_steps", "ape"),
        ("liere_b8_f010_steps", "liere_b8"),
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


CAYLEY_FASHION_STUDY = Study(
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


# ------------------------------------------------------------------ training to a plateau

PLATEAU_EVALS = ("test", "test_shuffled", "px56", "px56_shuffled")
# test along the way every epoch (the held-out curve), the other three at the end only
PLATEAU_EVAL_ARG = "resolution_evals=false,px56,curve_every=1"
# epochs; each length after 20 only if the doubling before it still added >= 0.3 points to an arm
PLATEAU_LENGTHS = (10, 20, 40, 80, 160, 320, 640)
# The warm-up stays the recipe's 200 steps at every length: it lets AdamW's moment estimates
# settle over the first steps, which does not depend on how long the run goes on. Scaled with
# the run (14 % of it), it would be 2,600 steps at 40 epochs, holding the learning rate low for
# five epochs and shifting every held-out curve, so that steps to an accuracy would differ
# between lengths for the schedule's sake. The cosine decay stretches with the run.


def at_epochs(base: Arm, epochs: float, name: str | None = None) -> Arm:
    """`base` trained for `epochs` (the recipe's 200 warm-up steps kept), evaluated on
    PLATEAU_EVALS with the held-out curve."""
    arg = f"{base.arg},epochs={epochs:g},{PLATEAU_EVAL_ARG}"
    return dataclasses.replace(
        base,
        name=name or f"{base.name}_e{round(epochs):03d}",
        label=f"{base.label}, {epochs:g} epochs",
        arg=arg,
        paper_arg=arg,
    )


FASHION_PLATEAU_LENGTH_STUDY = Study(
    name="fashion_plateau_length",
    title="Fashion-MNIST: where does test accuracy stop rising? (APE, LieRE 8x8, 10-640 epochs)",
    # In this order: 10 and 20 epochs of both arms first, then 40 ... 640 while needed.
    arms=tuple(at_epochs(base, e) for e in PLATEAU_LENGTHS for base in (F_APE, F_LIERE_B8)),
    evals=PLATEAU_EVALS,
    comparisons=(),  # one seed per arm: read as curves, no test over seeds
    default_seeds=1,
    curves=(
        "epochs (the whole cosine schedule stretched; 200 warm-up steps)",
        tuple(
            (base.label, tuple((float(e), at_epochs(base, e).name) for e in PLATEAU_LENGTHS))
            for base in (F_APE, F_LIERE_B8)
        ),
    ),
)


# fashion_plateau's input: the data in memory, augmented in JAX (rope_lie/in_memory.py), which
# runs where TensorFlow does not (a lent GPU: at 80 epochs the study is ~60 CPU-hours here). All
# its runs use it, on any machine, so seed k of every arm sees the same batches wherever it
# trained (TFDS's input draws other ones).
PLATEAU_INPUT = "input=memory"


def at_plateau(base: Arm) -> Arm:
    """`base` trained at the plateau schedule (configs/fashion_mnist.py's PLATEAU_EPOCHS), its
    epochs spelled out, on ``PLATEAU_INPUT``; while PLATEAU_EPOCHS is None (not measured yet),
    the recipe's `plateau` argument, which refuses to build until it is set. Not the same runs
    as `fashion_plateau_length`'s (TFDS input): every seed is trained here."""
    if fashion_mnist.PLATEAU_EPOCHS is None:
        arg = f"{base.arg},plateau,{PLATEAU_EVAL_ARG},{PLATEAU_INPUT}"
        label = f"{base.label}, at the plateau"
        return dataclasses.replace(base, label=label, arg=arg, paper_arg=arg)
    arm = at_epochs(base, fashion_mnist.PLATEAU_EPOCHS, name=base.name)
    arg = f"{arm.arg},{PLATEAU_INPUT}"
    return dataclasses.replace(arm, arg=arg, paper_arg=arg)


# 5 seeds of the four main arms, then DINOv3 and ComRoPE-LD at 3 if the budget allows. Every
# arm draws its data order from its seed (no data_stream): seed k of every arm sees the same
# batches, and the arms are compared as pairs (paired t, sign-flip; steps_to on the held-out
# curves).
FASHION_PLATEAU_STUDY = Study(
    name="fashion_plateau",
    title="Fashion-MNIST trained to the plateau: accuracy, shuffled patches, 2x the pixels",
    arms=tuple(
        at_plateau(a) for a in (F_APE, F_LIERE_B8, F_MIXED_HEO, F_LIERE_B2, F_DINOV3, F_COMROPE)
    ),
    evals=PLATEAU_EVALS,
    # Table 1 (CIFAR-100, not Fashion-MNIST): the ordering is compared, not the numbers.
    paper={
        "ape": {"test": 0.639},
        "liere_b2": {"test": 0.688},
        "liere_b8": {"test": 0.703},
    },
    comparisons=(
        ("liere_b8", "ape"),
        ("liere_b2", "ape"),
        ("liere_b8", "liere_b2"),
        ("liere_b2", "rope_mixed_heo"),
        ("liere_b8", "rope_mixed_heo"),
        ("rope_mixed_heo", "ape"),
        ("comrope_ld", "liere_b8"),  # ComRoPE's claim: +1.6 over LieRE (ImageNet)
        ("dinov3", "rope_mixed_heo"),  # centred [-1, 1] positions vs integer ones
    ),
    default_seeds=5,
)
