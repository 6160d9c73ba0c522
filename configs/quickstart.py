r"""Quickstart: the LieRE spatial-reasoning task at CPU scale, with resolution extrapolation.

Train a small ViT (variant mu: width 64, 4 layers, 4 heads of 16 dims) with LieRE (block size
8) on spatial_arrows/c8_g8 (64x64 px, 8x8 grid of 8 px cells, patch = cell), then evaluate on
the same cell size with larger grids, c8_g12 (96 px) and c8_g16 (128 px), and with shuffled
patches (a model that uses positions should drop to chance, 25%).

    python -m rope_lie.main --config=configs/quickstart.py --workdir=workdirs/quickstart
    python -m rope_lie.main --config=configs/quickstart.py:smoke --workdir=/tmp/qs_smoke

Arguments: pe=<family> (any name `python -m rope_lie.main --list` prints: liere, rope_mixed,
rope_axial, cayley_string, comrope, dinov3, alibi, nope, the additive tables ape and sincos,
...), block=<LieRE block size>,
ape_std=<APE init std, default 0.02>, smoke (8 steps: checks the whole path, not accuracy).
Compare encoders with e.g. `:pe=ape` and `:pe=rope_mixed` in other workdirs.

Runtime on 2 CPU cores (AMD EPYC with AVX-512, no accelerator, datasets already generated):
2 min 29 s (500 steps at ~700 examples/s, then two evaluation rounds of 21 s and 12 s). Smoke:
about 40 s, 60 s when it first generates its two datasets.
Expected metric (one seed; the table in README.md): accuracy 1.000 at c8_g8 (64 px), c8_g12
(96 px) and c8_g16 (128 px), 0.3195 with shuffled patches (chance 0.25).
Other encoders (one seed, 2-core Intel Xeon; accuracy at c8_g8 / c8_g12 / c8_g16 / shuffled):
pe=rope_mixed 1.000 / 1.000 / 0.944 / 0.324; pe=ape 0.436 / 0.454 / 0.439 / 0.430 (APE learns
no usable positions here, as in the LieRE paper's Table 3).
"""

from rope_lie import config_lib as common

TRAIN = "spatial_arrows/c8_g8"


def get_config(arg=None):
    args = common.parse_arg(arg, pe="liere", block=8, ape_std=common.APE_INIT_STD, smoke=False)
    c = common.base_config()
    # Fields documented in rope_lie/data/pipeline.py; the dataset is generated on first use.
    c.dataset = common.dataset_config(
        TRAIN,
        data_dir=None,  # TFDS root; None = ~/tensorflow_datasets
        mean=(0.5,),  # grayscale glyphs (255 on 0) mapped to [-1, 1]
        std=(0.5,),
    )

    # Class token (as in the LieRE paper), no dropout (a short run over 20,000 layouts).
    c.model = common.model_config(
        variant="mu/8",  # width 64, depth 4, 4 heads (H = 16); patch 8 px = one grid cell
        image_shape=(64, 64),  # training input (H, W) in px = 8x8 cells
        channels=1,  # grayscale
        num_classes=4,  # direction of the target arrow: up, right, down, left
        **common.pe_fields(args.pe, args.block, ape_std=args.ape_std),  # pe, positions, ...
    )

    c.batch_size = 128  # examples per step
    c.total_steps = 500  # 64,000 examples = 3.2 passes over the 20,000 training layouts
    c.optim.name = "adamw"
    c.optim.lr = 2e-3  # peak learning rate
    c.optim.weight_decay = 0.05  # on weight matrices only
    c.optim.warmup_steps = 100  # linear warmup steps
    c.log_every_steps = 50  # steps between metrics lines
    # evaluate half-way and at the end; a reference, so that --config.total_steps moves it too
    c.eval_every_steps = c.get_ref("total_steps") // 2
    c.eval_batch_size = 250  # eval examples per step (2,000 test examples = 8 batches)
    c.checkpoint.every_steps = 100  # steps between checkpoints

    c.evals = dict(
        g08=common.eval_entry(),  # the training grid, held-out layouts
        g12=common.eval_entry(name="spatial_arrows/c8_g12"),  # 96 px: 1.5x the grid
        g16=common.eval_entry(name="spatial_arrows/c8_g16"),  # 128 px: 2x the grid
        g08_shuffled=common.eval_entry(shuffle_patches=True),  # positions destroyed
    )

    if args.smoke:  # a few steps of the same model: checks the whole path, not the accuracy
        common.make_smoke(
            c,
            variant=None,
            total_steps=8,
            batch_size=16,
            eval_batch_size=32,
            warmup_steps=2,
            log_every_steps=4,
            checkpoint_every_steps=4,
        )
        c.dataset.eval_split = "test[:64]"  # a slice: faster evaluation
        c.evals.g12.split = "test[:64]"
        del c.evals["g16"]  # one extrapolation grid is enough to check the path
    return c
