r"""The sparse Cayley-STRING study (Cicekdag et al., 2025) on MNIST or CIFAR-10.

The study's Sec. 3.7 and Table 1 (cited in docs/encoders.md, section 9): a ViT with width 48, 4
layers, 4 heads of 12 dims, MLP 192 (variant "string", 0.115-0.118 M parameters) on 32x32 images
(MNIST resized from 28) with 4x4 patches (8x8 tokens), CLS pooling; Cayley-STRING with a dense,
block-diagonal 2x2, banded or top-k generator. AdamW, weight decay 1e-4; MNIST 10 epochs at learning
rate 2e-3, CIFAR-10 25 epochs at 4e-3. The study reports the best test accuracy over epochs, so we
evaluate every epoch and final.json holds `best_accuracy` (and `best_step`).
Not stated in the study, our choices: batch 128, cosine decay with 1 epoch of linear warmup,
gradient clipping at norm 1, no dropout; no augmentation on MNIST, pad-crop + flip on CIFAR-10
(no RandAugment).

    tfds build mnist --data_dir=$TFDS    # once (cifar10 likewise)
    python -m rope_lie.main --config=configs/cayley.py:dataset=mnist,generator=banded,bw=2 \
        --workdir=workdirs/cayley_mnist_banded2 --config.dataset.data_dir=$TFDS
    python -m rope_lie.main --config=configs/cayley.py:dataset=cifar10,generator=block2x2 \
        --workdir=workdirs/cayley_cifar10_block2x2 --config.dataset.data_dir=$TFDS
    python -m rope_lie.main --config=configs/cayley.py:dataset=fashion_mnist,generator=dense \
        --workdir=workdirs/cayley_fashion_dense

Arguments: dataset=mnist|cifar10|fashion_mnist (default mnist; fashion_mnist: the MNIST recipe
on Debian's Fashion-MNIST files, no download), generator=dense|block2x2|banded|topk,
bw=<bandwidth>, k=<top-k entries>, pe=<family> (default cayley_string; e.g. rope_mixed for the
plain-RoPE baseline), block=<LieRE block size, for pe=liere>, smoke (a few steps of the same
model; used by the tests).

Expected runtime: not run here (needs `tfds build mnist` / `cifar10`, no download on the
project's machine; the CPU study `cayley` runs this ViT on sklearn digits instead, see
configs/digits.py). The study (hardware not stated) trained the dense baseline in 343 s in all
on MNIST and 1,142 s on CIFAR-10; the sparse generators in 163-247 s and 452-584 s.
Expected metric: not run here. Study Table 1 (best test accuracy):
  generator  dense   block2x2  banded bw=2  bw=4    top-k k=24  k=48
  MNIST      0.9680  0.9595    0.9681       0.9657  0.9650      0.9615
  CIFAR-10   0.7369  0.7299    0.7345       0.7324  0.7374      0.7316
"""

from rope_lie import config_lib as common

DATASETS = {
    # channels, epochs and learning rate (the study); train_size: the training split's images,
    # which make warmup and checkpoint interval one epoch at any batch size
    "mnist": dict(channels=1, epochs=10.0, lr=2e-3, train_size=60_000),
    "cifar10": dict(channels=3, epochs=25.0, lr=4e-3, train_size=50_000),
    # The MNIST recipe on Fashion-MNIST (Debian's files, rope_lie/data/fashion_mnist_idx.py):
    # the study's MNIST analogue on real images that need no download here.
    "fashion_mnist": dict(channels=1, epochs=10.0, lr=2e-3, train_size=60_000),
}
TFDS_NAMES = {"fashion_mnist": "fashion_mnist_idx/plain"}  # others: the catalogue's name


def get_config(arg=None):
    args = common.parse_arg(
        arg,
        dataset="mnist",
        pe="cayley_string",
        generator="dense",
        bw=2,
        k=24,
        block=4,
        smoke=False,
    )
    if args.dataset not in DATASETS:
        raise ValueError(f"dataset={args.dataset!r}; expected one of {sorted(DATASETS)}")
    d = DATASETS[args.dataset]
    c = common.base_config()
    c.dataset = common.dataset_config(
        TFDS_NAMES.get(args.dataset, args.dataset),  # catalogue: prepared by the user
        data_dir=None,  # TFDS root; None = ~/tensorflow_datasets
    )  # defaults: 32x32 (MNIST resized), the dataset's mean/std
    if args.dataset == "fashion_mnist":
        c.dataset.image_size = 32  # resized from 28, as the study's MNIST
    if args.dataset == "cifar10":
        c.dataset.augment.randaugment.num_layers = 0  # pad-crop + flip only
    fields = common.pe_fields(args.pe, args.block)
    if args.pe == "cayley_string":
        fields["pe_hparams"] = common.cayley_hparams(args.generator, args.bw, args.k)
    # Class token, no dropout, one generator per head and per layer (the study).
    c.model = common.model_config(
        variant="string",  # width 48, depth 4, 4 heads (H = 12), MLP 192
        patch_size=4,  # 4x4 px patches: 8x8 tokens
        image_shape=(32, 32),  # input (H, W) in px
        channels=d["channels"],  # MNIST grayscale, CIFAR-10 RGB
        num_classes=10,  # digits / CIFAR-10 classes
        **fields,  # pe, pe_hparams, additive, positions
    )
    c.batch_size = 128  # examples per step (not stated in the study)
    c.num_epochs = d["epochs"]  # epochs of the study
    c.optim.name = "adamw"  # AdamW (study)
    c.optim.lr = d["lr"]  # learning rate (study)
    c.optim.weight_decay = 1e-4  # weight decay (study), weight matrices only
    # One epoch (468 and 390 steps at batch 128) as a reference to the batch size, so that
    # --config.batch_size keeps warmup and checkpoints at one epoch; a reference per field, so
    # that overriding one leaves the other.
    c.optim.warmup_steps = d["train_size"] // c.get_ref("batch_size")  # 1 epoch of warmup
    c.log_every_steps = 100  # steps between metrics lines
    c.eval_every_epochs = 1.0  # every epoch: the study reports the best epoch
    c.eval_batch_size = 500  # 10,000 test images = 20 batches
    c.checkpoint.every_steps = d["train_size"] // c.get_ref("batch_size")  # every epoch
    c.evals = dict(test=common.eval_entry())  # 10,000 test images
    if args.smoke:
        common.make_smoke(c, variant="string")
    return c
