r"""CIFAR-100, the LieRE paper's recipe (Ostmeier et al., arXiv:2406.10322, App. B.1-B.2).

ViT-B (12 layers, width 768, 12 heads, MLP 3072) with 4x4 patches on 32x32 images (8x8
tokens), CLS pooling, dropout 0.1; Adam (b1 0.9, b2 0.999, eps 1e-8), learning rate 1e-4 with
cosine decay, batch 512, 200 epochs, RandAugment (2 ops, magnitude 9) with pad-crop and flip.
Encoder parameters per layer and head. The paper's Table 1 reports top-1 70.3 (LieRE8), 70.0
(LieRE64), 68.8 (RoPE-Mixed), 65.5 (VisionLlama), 63.9 (APE).

    tfds build cifar100 --data_dir=$TFDS    # once
    python -m rope_lie.main --config=configs/cifar100.py:pe=liere,block=8 \
        --workdir=workdirs/cifar100_liere8 --config.dataset.data_dir=$TFDS

Arguments: pe=<family or ape/sincos>, block=<LieRE block size (64 = dense, H = 64)>,
ape_std=<APE init std; default 1.0, the LieRE reference's N(0, 1)>,
init_scale=<LieRE generator init U[0, init_scale); 0 = the default 2 pi> (Table 7 compares 1),
variant=<ViT variant> (default B), smoke (tiny model, a few steps; used by the tests).

Expected runtime: not run here (needs CIFAR-100 prepared with `tfds build`, no downloads on the
project's machine, and an accelerator for ViT-B); the paper's CIFAR runs took < 30 min each on
8x L4 GPUs (App. B.2).
Expected metric: not run here; the paper's Table 1 above (70.3 top-1 for LieRE8).
"""

from rope_lie import config_lib as common


def get_config(arg=None):
    args = common.parse_arg(
        arg,
        pe="liere",
        block=8,
        ape_std=common.LIERE_APE_INIT_STD,
        init_scale=0.0,
        variant="B",
        smoke=False,
    )
    c = common.base_config()
    c.dataset = common.dataset_config(
        "cifar100",  # TFDS catalogue dataset, prepared by the user (tfds build)
        data_dir=None,  # TFDS root; None = ~/tensorflow_datasets
    )  # defaults: 32x32, CIFAR mean/std, pad-crop 4 + flip + RandAugment(2, 9)
    # Class token, encoder parameters per layer and head (the paper's defaults); activations in
    # float32 (bfloat16 on accelerators is fine: --config.model.dtype=bfloat16).
    c.model = common.model_config(
        variant=args.variant,  # ViT-B: width 768, depth 12, 12 heads (H = 64), MLP 3072
        patch_size=4,  # 4x4 px patches: 8x8 tokens
        image_shape=(32, 32),  # input (H, W) in px
        channels=3,  # RGB
        num_classes=100,  # CIFAR-100 fine labels
        dropout=0.1,  # as in the paper
        **common.pe_fields(args.pe, args.block, ape_std=args.ape_std),  # pe, positions, ...
    )
    if args.init_scale:
        if args.pe != "liere":
            raise ValueError(f"init_scale={args.init_scale} is for pe=liere, not pe={args.pe}")
        c.model.pe_hparams.init_scale = args.init_scale  # LieRE Table 7: 2 pi (default) vs 1
    c.batch_size = 512  # effective batch size of the paper
    common.liere_paper_training(c)  # 200 epochs of Adam at 1e-4, cosine to 0
    c.log_every_steps = 100  # steps between metrics lines
    c.eval_every_epochs = 10.0  # epochs between evaluations
    c.eval_batch_size = 500  # 10,000 test images = 20 batches
    c.checkpoint.every_steps = 1000  # steps between checkpoints (~10 epochs)
    c.evals = dict(
        test=common.eval_entry(),  # 32x32 test set
        test_shuffled=common.eval_entry(shuffle_patches=True),  # shuffled patches (Sec. 5.5)
    )
    if args.smoke:
        common.make_smoke(c, variant="pico")
    return c
