r"""Fashion-MNIST: the papers' comparisons on real images, any encoder.

A ViT-mu/4 (width 64, 4 layers, 4 heads of 16 dims, patch 4: 7x7 tokens and a class token) on
the 60,000 28x28 training images of Fashion-MNIST (`fashion_mnist_idx`, built from the IDX
files of Debian's `dataset-fashion-mnist`: rope_lie/data/fashion_mnist_idx.py), with the usual
augmentation for this data (random crop after 2 px of zero padding, horizontal flip), AdamW
and a cosine schedule. Evaluated once, at the end, on the 10,000 test images:

- `test`: at the training size; `test_shuffled`: with the patches permuted (LieRE Table 5);
- `px36`, `px44`, `px56`: the same images resized to more pixels (objects larger in pixels,
  more tokens: seed 004's regime, 1.29x / 1.57x / 2x per side);
- `canvas36`, `canvas44`, `canvas56`: the 28 px image centred on a larger black canvas
  (objects the same size, more tokens: LieRE's larger grids). 44 px rather than 42: the side
  must be a multiple of the 4 px patch.

    apt-get update && apt-get install -y dataset-fashion-mnist
    python -m rope_lie.main --config=configs/fashion_mnist.py:pe=liere,block=8 \
        --workdir=workdirs/fashion_liere8
    python -m rope_lie.main --config=configs/fashion_mnist.py:smoke --workdir=/tmp/fashion_smoke

Arguments: pe=<family, a variant such as visionllama_liere, or ape/sincos>, block=<LieRE block
size; 2 = the LieRE paper's RoPE-Mixed>, ape_std=<APE init std; default 1.0, the LieRE
reference's N(0, 1)>, generator=dense|block2x2|banded|topk, bw=<bandwidth>, k=<top-k entries>
(pe=cayley_string), epochs=<passes over the training set>, scale_aug (random-resized crops
of 35-100 % of the area in training, for the resolution study), resolution_evals=false (only
`test` and `test_shuffled`: a short run's evaluation then costs about a minute, not four),
rotary_fraction=<p-RoPE's fraction of frequency pairs rotated per axis, e.g. 0.75; 1 =
all; for the families config_lib.p_rope_families() lists>, rescale=<DINOv3's coordinate
rescaling bound in training, e.g. 2; 0 = off>, rpe=<RPE-2D's randomized positions in
training, drawn from a grid that many times larger per axis, e.g. 2; 0 = off>,
extrapolation_evals (beside every px and canvas evaluation, one per resolution extrapolation
tool the encoder supports, `px56@yarn` ...: the same model, evaluated with the tool;
rope_lie/encodings/extrapolation.py), px56 (the test images at 2x the pixels, with and
without shuffled patches: `px56`, `px56_shuffled`), curve_every=<epochs between evaluations
of `test` along the way, the held-out curve that steps to an accuracy are read from; the
other evaluations run at the end only; 0 = none>, plateau (epochs=PLATEAU_EPOCHS, the length
at which test accuracy stops rising: the `fashion_plateau_length` study), smoke (a few steps;
used by the tests), input=memory (the data held in memory as numpy arrays and augmented in
JAX, no TensorFlow: for a machine without it; rope_lie/in_memory.py; other batches than
input=tfds's, the default, from the same distribution), naflex (mixed-size batches: every
training image, after its crop and flip, resized under a random budget of side**2 tokens,
side uniform in [min_side, max_side], default 5-9, i.e. 20-36 px; NaFlex evaluations of the
test images at sides 5, 7, 9, 11 and 14, the px evaluations' token grids, beside the
fixed-size ones; rope_lie/data/naflex.py),
naflex_evals=false (with naflex: the fixed-size evaluations only; the NaFlex ones repeat the
test and px evaluations' grids through the token path, about 6 minutes a run).

Runtime and metric: see experiments/studies/fashion/README.md (the `fashion` study runs this
recipe for every arm; its summary.md has the current seed means).
"""

from rope_lie import config_lib as common

EPOCHS = 3.0  # passes over the 60,000 training images
CANVASES = (36, 44, 56)  # px: the 28 px image centred on a larger canvas
UPSAMPLED = (36, 44, 56)  # px: the 28 px image resized
WARMUP_STEPS = 200  # linear warmup steps: 14 % of the 1,404-step run (kept at any length)
# >>> PLATEAU: the epoch count beyond which doubling the run adds < 0.3 points of test accuracy
# (APE and LieRE 8x8, `fashion_plateau_length`, experiments/studies/fashion_plateau_length/).
# None until those runs finish; the lead sets it from their results.
PLATEAU_EPOCHS: float | None = None


def plateau_epochs() -> float:
    """PLATEAU_EPOCHS, or an error saying that it is not measured yet."""
    if PLATEAU_EPOCHS is None:
        raise ValueError(
            "plateau: PLATEAU_EPOCHS in configs/fashion_mnist.py is None (not measured yet); "
            "run the fashion_plateau_length study and set it, or give epochs=<N>"
        )
    return PLATEAU_EPOCHS


def get_config(arg=None):
    args = common.parse_arg(
        arg,
        pe="liere",
        block=8,
        ape_std=common.LIERE_APE_INIT_STD,
        generator="dense",
        bw=2,
        k=24,
        epochs=EPOCHS,
        scale_aug=False,
        rescale=0.0,
        smoke=False,
        naflex=False,
        min_side=5,
        max_side=9,
        resolution_evals=True,
        rotary_fraction=1.0,
        naflex_evals=True,
        rpe=0.0,
        extrapolation_evals=False,
        px56=False,
        curve_every=0.0,
        plateau=False,
        input="tfds",
    )
    epochs = plateau_epochs() if args.plateau else args.epochs
    c = common.base_config()
    c.dataset = common.dataset_config(
        "fashion_mnist_idx/plain",  # built from the IDX files on first use
        data_dir=None,  # TFDS root; None = ~/tensorflow_datasets
        mean=(0.2860,),  # of the training images, in units of 255
        std=(0.3530,),
        image_size=28,  # model input side in px
    )
    c.dataset.augment.crop = "inception" if args.scale_aug else "pad"
    c.dataset.augment.crop_padding = 2  # px of zero padding for crop="pad"
    c.dataset.augment.crop_area_min = 0.35 if args.scale_aug else 0.08  # inception crop only
    c.dataset.augment.flip = True  # left-right: clothing is mirror-symmetric in class
    c.model = common.model_config(
        variant="mu/4",  # width 64, depth 4, 4 heads of 16; patch 4 px
        image_shape=(28, 28),  # training input (H, W) in px
        channels=1,  # grayscale
        num_classes=10,  # clothing classes
        **common.pe_fields(args.pe, args.block, ape_std=args.ape_std),  # pe, positions, ...
    )
    if args.pe == "cayley_string":
        c.model.pe_hparams = common.cayley_hparams(args.generator, args.bw, args.k)
    if args.rotary_fraction != 1.0:  # parse_arg refused it beside a pe without p-RoPE
        # p-RoPE (Barbero et al., 2025): the lowest frequencies of every axis left unrotated
        c.model.pe_hparams.rotary_fraction = float(args.rotary_fraction)
    augment = {}
    if args.rescale:
        # DINOv3's coordinate rescaling in training (positions.augment): every axis times one
        # log-uniform factor in [1 / rescale, rescale] per batch
        augment["rescale"] = float(args.rescale)
    if args.rpe:
        # RPE-2D (positions.randomize): per axis, a sorted random subset of the positions of a
        # grid rpe times larger, one draw per batch
        augment["randomize"] = float(args.rpe)
    if augment:
        c.model.position_augment = augment
    c.input = args.input  # "tfds" (tf.data) or "memory" (numpy + JAX: rope_lie/in_memory.py)
    if args.input == "memory":
        c.tensorboard = False  # TensorBoard's events are written through TensorFlow
    c.batch_size = 128  # examples per step
    c.num_epochs = float(epochs)  # total steps = epochs * 60,000 // 128
    c.optim.lr = 1e-3  # peak learning rate (AdamW), cosine decay to 0
    c.optim.weight_decay = 0.05  # weight matrices only
    c.optim.warmup_steps = WARMUP_STEPS
    c.log_every_steps = 50  # steps between metrics lines (the training curve)
    # evaluate at the end (no model is picked on test); with curve_every, `test` along the way too
    c.eval_every_epochs = float(args.curve_every)
    c.eval_batch_size = 500  # 10,000 test images = 20 batches
    c.checkpoint.every_steps = 200  # steps between checkpoints
    c.evals = dict(
        test=common.eval_entry(),  # the training size
        test_shuffled=common.eval_entry(shuffle_patches=True),  # positions destroyed
    )
    if args.resolution_evals:
        c.evals.update(
            {f"px{s}": common.eval_entry(image_size=s) for s in UPSAMPLED},
            **{
                f"canvas{s}": common.eval_entry(name=f"fashion_mnist_idx/canvas{s}", image_size=s)
                for s in CANVASES
            },
        )
    if args.px56:  # 2x the pixels, and with the patches shuffled
        c.evals.px56 = common.eval_entry(image_size=56)
        c.evals.px56_shuffled = common.eval_entry(image_size=56, shuffle_patches=True)
    if args.extrapolation_evals:
        if not args.resolution_evals:
            raise ValueError("extrapolation_evals needs the resolution evaluations")
        sized = [f"px{s}" for s in UPSAMPLED] + [f"canvas{s}" for s in CANVASES]
        common.add_extrapolation_evals(c, sized)
    if args.naflex:  # the fixed-size evaluations above stay
        sides = sorted({args.min_side, 7, args.max_side, *(s // 4 for s in UPSAMPLED)})
        eval_sides = sides if args.naflex_evals else ()
        common.add_naflex(c, args.min_side, args.max_side, eval_sides=eval_sides)
    if args.curve_every:  # the held-out curve is `test`'s; the rest only at the end
        for name, entry in c.evals.items():
            entry.final_only = name != "test"
    if args.smoke:
        common.make_smoke(c, variant="mu/4")
        c.dataset.eval_split = "test[:16]"  # a slice: faster evaluation
        for name in c.evals:
            c.evals[name].split = "test[:16]"
    return c
