r"""The spatial-reasoning task in volumes (spatial_arrows_3d), any encoder: the studies' 3D arm.

Train on a 6x6x6 grid of 4-voxel cells (24^3 voxels; a 4^3 tubelet per cell, 216 tokens); the
label is the direction (one of 6) of the arrow next to the Y's stem. Evaluate on held-out
layouts, on an 8x8x8 grid of the same cells (extrapolation, 512 tokens) and with shuffled
tubelets. ViT-mu (width 64, 4 layers, 4 heads of 16).

    python -m rope_lie.main --config=configs/arrows3d.py:pe=liere,block=8 \
        --workdir=workdirs/arrows3d_liere8

Arguments: pe=<family, variant or ape/sincos (common.pe_fields; VisionLLaMA's AS2D needs H
divisible by 6, use visionllama_liere)>, block=<LieRE block size>, ape_std=<APE init std,
default 1.0 as the LieRE reference>, steps=<training steps, default 600>, smoke.

Runtime on 2 CPU cores (AMD EPYC with AVX-512, no accelerator): 6.5-8.5 min a run (95-115
training examples/s; the first run also generates the data). Smoke (a few steps of the pico
ViT): about 51 s, generating the data included.
Expected metric (the `volumes` study, experiments/studies/volumes/): held-out accuracy at g6
after the default 600 steps, seeds 0-2: APE 25-31 %, LieRE 2x2 31-39 %, LieRE 8x8 30-46 %
(chance 16.7 %, position-blind ceiling 36.5 %): every arm still underfits at 600 steps, so
raise `steps` to compare encodings.
"""

from rope_lie import config_lib as common


def get_config(arg=None):
    args = common.parse_arg(
        arg, pe="liere", block=8, ape_std=common.LIERE_APE_INIT_STD, steps=600, smoke=False
    )
    c = common.base_config()
    c.dataset = common.dataset_config(
        "spatial_arrows_3d/c4_g6",  # generated on first use (rope_lie/data/spatial_arrows_3d.py)
        data_dir=None,  # TFDS root; None = ~/tensorflow_datasets
        mean=(0.5,),  # glyph voxels (255 on 0) mapped to [-1, 1]
        std=(0.5,),
    )
    # Class token (as in the LieRE paper), no dropout (a short run over 20,000 layouts).
    c.model = common.model_config(
        variant="mu",  # width 64, depth 4, 4 heads (H = 16)
        patch_size=(4, 4, 4),  # one tubelet per cell: the token grid is the cell grid
        image_shape=(24, 24, 24),  # training volume (D, H, W) in voxels = 6x6x6 cells
        channels=1,  # one value per voxel
        num_classes=6,  # direction of the target arrow: -/+ depth, row, col
        **common.pe_fields(args.pe, args.block, ape_std=args.ape_std),  # pe, positions, ...
    )
    c.batch_size = 64  # examples per step
    if args.steps < 1:  # total_steps 0 would mean num_epochs, silently one pass
        raise ValueError(f"steps={args.steps}: expected a positive number of training steps")
    c.total_steps = args.steps  # 600 x 64 = 38,400 examples, 1.9 passes over the layouts
    c.optim.name = "adamw"
    c.optim.lr = 2e-3  # peak learning rate, cosine decay
    c.optim.weight_decay = 0.05  # weight matrices only
    c.optim.warmup_steps = 100  # linear warmup steps
    c.log_every_steps = 50  # steps between metrics lines
    c.eval_every_steps = 0  # evaluate at the end
    c.eval_batch_size = 200  # eval examples per step (2,000 test layouts = 10 batches)
    c.checkpoint.every_steps = 100  # steps between checkpoints
    c.evals = dict(
        g6=common.eval_entry(),  # the training grid, held-out layouts
        g8=common.eval_entry(name="spatial_arrows_3d/c4_g8"),  # 8^3 cells: 1.33x per axis
        g6_shuffled=common.eval_entry(shuffle_patches=True),  # positions destroyed
    )
    if args.smoke:
        common.make_smoke(c, variant="pico")
        c.dataset.eval_split = "test[:16]"
        c.evals.g8.split = "test[:16]"
    return c
