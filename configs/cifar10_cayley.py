r"""CIFAR-10 with the sparse Cayley-STRING study's small ViT (papers/001, Sec. 3.7, Table 1).

A ViT with width 48, 4 layers, 4 heads of 12 dims, MLP 192 (variant "string", 0.116-0.118 M
parameters) on 32x32x3 images with 4x4 patches (8x8 tokens), CLS pooling; Cayley-STRING with a
dense, block-diagonal 2x2, banded or top-k generator. AdamW, learning rate 4e-3, weight decay
1e-4, 25 epochs; the study reports the best test accuracy over epochs, so we evaluate every
epoch and final.json holds `best_accuracy` (and `best_step`).
Not stated in the study, our choices: batch 128, cosine decay with 1 epoch of linear warmup,
gradient clipping at norm 1, no dropout, pad-crop + flip augmentation (no RandAugment).
Study Table 1 (best acc.): dense 0.7369, block2x2 0.7299, banded bw=2 0.7345, bw=4 0.7324,
top-k k=24 0.7374, k=48 0.7316.

    tfds build cifar10 --data_dir=$TFDS    # once
    python -m rope_lie.main --config=configs/cifar10_cayley.py:generator=block2x2 \
        --workdir=workdirs/cifar10_cayley_block2x2 --config.dataset.data_dir=$TFDS

Arguments: generator=dense|block2x2|banded|topk, bw=<bandwidth>, k=<top-k entries>,
pe=<family> (default cayley_string; e.g. rope_mixed for the plain-RoPE baseline), smoke.

Expected runtime: to be measured (the study: 1,142 s total for the dense baseline on its GPU).
Expected metric: to be measured (study: best test accuracy ~0.73).
"""

from rope_lie import config_lib as common


def get_config(arg=None):
    args = common.parse_arg(
        arg, pe="cayley_string", generator="dense", bw=2, k=24, block=4, smoke=False
    )
    c = common.base_config()
    c.dataset = common.dataset_config(
        "cifar10",  # TFDS catalogue dataset, prepared by the user (tfds build cifar10)
        data_dir=None,  # TFDS root; None = ~/tensorflow_datasets
    )  # defaults: 32x32, CIFAR mean/std
    c.dataset.augment.randaugment.num_layers = 0  # pad-crop + flip only
    fields = common.pe_fields(args.pe, args.block)
    if args.pe == "cayley_string":
        fields["pe_hparams"] = common.cayley_hparams(args.generator, args.bw, args.k)
    # Class token, no dropout, one generator per head and per layer (the study).
    c.model = common.model_config(
        variant="string",  # width 48, depth 4, 4 heads (H = 12), MLP 192
        patch_size=4,  # 4x4 px patches: 8x8 tokens
        image_shape=(32, 32),  # input (H, W) in px
        channels=3,  # RGB
        num_classes=10,  # CIFAR-10 classes
        **fields,  # pe, pe_hparams, additive, positions
    )
    c.batch_size = 128  # examples per step (not stated in the study)
    c.num_epochs = 25.0  # epochs of the study
    c.optim.name = "adamw"  # AdamW (study)
    c.optim.lr = 4e-3  # learning rate (study)
    c.optim.weight_decay = 1e-4  # weight decay (study), weight matrices only
    c.optim.warmup_steps = 390  # 1 epoch of linear warmup (50,000 / 128 steps)
    c.log_every_steps = 100  # steps between metrics lines
    c.eval_every_epochs = 1.0  # every epoch: the study reports the best epoch
    c.eval_batch_size = 500  # 10,000 test images = 20 batches
    c.checkpoint.every_steps = 390  # about every epoch
    c.evals = dict(test=common.eval_entry())  # 10,000 test images
    if args.smoke:
        common.make_smoke(c, variant="string")
    return c
