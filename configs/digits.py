r"""sklearn digits: small real images that need no download, for fast end-to-end checks.

A ViT-mu (width 64, 4 layers, 4 heads) with patch 2 on the native 8x8 digits (4x4 tokens),
trained on the fixed 1,437-image split and evaluated on the 360 test images, at the training
size, upsampled to 16x16 (8x8 tokens, positions "normalized" so both sizes span the same
range) and with shuffled patches.

    python -m rope_lie.main --config=configs/digits.py:pe=liere --workdir=workdirs/digits
    python -m rope_lie.main --config=configs/digits.py:smoke --workdir=/tmp/digits_smoke

Arguments: pe=<family, variant or ape/sincos (common.pe_fields)>, block=<LieRE block size>,
generator=dense|block2x2|banded|topk, bw=<bandwidth>, k=<top-k entries> (pe=cayley_string),
variant=<ViT variant, default mu; string = the sparse Cayley-STRING study's H = 12 ViT>,
smoke (a few steps; used by the tests), naflex (mixed-size batches: every training digit resized
under a random budget of side**2 tokens, side uniform in [min_side, max_side], default 3-6;
NaFlex evaluations at sides 3, 4 and 6 beside the fixed-size ones; rope_lie/data/naflex.py).

Runtime on 2 CPU cores (Intel Xeon, shared with other jobs, no accelerator): 126 s in all
(673 steps, pe=liere block 4). Smoke: under 30 s.
Expected metric (one seed, pe=liere block 4): test accuracy 0.953 at 8x8 (best 0.953), 0.250 at
16x16 (upsampled digits put a quarter of a stroke in each 2x2 patch: the patch embedding, not
the positions, fails to transfer), 0.211 with shuffled patches.
"""

from rope_lie import config_lib as common


def get_config(arg=None):
    args = common.parse_arg(
        arg,
        pe="liere",
        block=4,
        generator="dense",
        bw=2,
        k=24,
        variant="mu",
        smoke=False,
        naflex=False,
        min_side=3,
        max_side=6,
    )
    c = common.base_config()
    c.dataset = common.dataset_config(
        "sklearn_digits/size8",  # 8x8 pixels, 10 classes (rope_lie/data/sklearn_digits.py)
        data_dir=None,  # TFDS root; None = ~/tensorflow_datasets (generated on first use)
        mean=(0.5,),  # pixels mapped to [-1, 1]
        std=(0.5,),
    )
    fields = common.pe_fields(args.pe, args.block, convention="normalized")
    if args.pe == "cayley_string":
        fields["pe_hparams"] = common.cayley_hparams(args.generator, args.bw, args.k)
    c.model = common.model_config(
        variant=args.variant,  # mu: width 64, depth 4, 4 heads of 16 dims; string: H = 12
        patch_size=2,  # px per patch side: 4x4 tokens at 8x8
        image_shape=(8, 8),  # training input (H, W) in px
        channels=1,  # grayscale
        num_classes=10,  # digits 0-9
        pool="mean",  # mean of the patch tokens
        dropout=0.1,  # after the embedding, attention and MLP
        # pe, pe_hparams, additive, positions: [-1, 1] at every size, so 16x16 interpolates
        **fields,
    )
    c.batch_size = 64  # examples per step
    c.num_epochs = 30.0  # passes over the 1,437 training digits
    c.optim.lr = 2e-3  # peak learning rate (AdamW)
    c.optim.weight_decay = 0.05  # on weight matrices only
    c.optim.warmup_steps = 50  # linear warmup steps
    c.log_every_steps = 20  # steps between metrics lines
    c.eval_every_epochs = 5.0  # evaluate every 5 epochs (best accuracy is tracked)
    c.eval_batch_size = 120  # 360 test digits = 3 batches
    c.checkpoint.every_steps = 200  # steps between checkpoints
    c.evals = dict(
        size8=common.eval_entry(),  # the training size
        size16=common.eval_entry(name="sklearn_digits/size16"),  # 2x upsampled, 8x8 tokens
        size8_shuffled=common.eval_entry(shuffle_patches=True),  # positions destroyed
    )
    if args.naflex:  # the fixed-size evaluations above stay
        sides = sorted({args.min_side, 4, args.max_side})
        common.add_naflex(c, args.min_side, args.max_side, eval_sides=sides)
    if args.smoke:  # a few steps of the same model: checks the whole path, not the accuracy
        common.make_smoke(
            c,
            variant=None,
            total_steps=6,
            batch_size=16,
            eval_batch_size=40,
            warmup_steps=1,
            log_every_steps=2,
            checkpoint_every_steps=3,
        )
    return c
