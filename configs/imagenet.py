r"""ImageNet-1k, the LieRE paper's recipe (arXiv:2406.10322, App. B.1-B.2, B.4; Fig. 7).

ViT-B/16 at 224x224 (14x14 tokens), CLS pooling, dropout 0.1; Adam (0.9, 0.999, eps 1e-8),
learning rate 1e-4 with cosine decay, batch 512, 200 epochs, inception crop + flip +
RandAugment (2, 9). Evaluated on the validation set at 224 and, as in Fig. 7, at other
resolutions: 192 (the paper's 196 is not a multiple of the patch size), 256, 320, 384, 448.
Paper Table 1: top-1 69.6 (LieRE8), 69.3 (LieRE64), 68.8 (RoPE-Mixed), 66.1 (APE).

    # once: put ILSVRC2012_img_{train,val}.tar in $TFDS/downloads/manual, then
    tfds build imagenet2012 --data_dir=$TFDS --manual_dir=$TFDS/downloads/manual
    python -m rope_lie.main --config=configs/imagenet.py:pe=liere,block=8 \
        --workdir=workdirs/imagenet_liere8 --config.dataset.data_dir=$TFDS \
        --config.mesh.data=-1 --config.mesh.fsdp=1

The paper's second recipe, `finetune`: from the 224 px run's parameters (`init_from`, the APE
table resized bicubically, rotary parameters as they are), 30 epochs at 256 px, learning rate
1e-5, then the same resolution sweep plus 224:

    python -m rope_lie.main \
        --config=configs/imagenet.py:pe=liere,finetune,init_from=workdirs/imagenet_liere8 \
        --workdir=workdirs/imagenet_liere8_ft256 --config.dataset.data_dir=$TFDS

Arguments: pe=<family or ape/sincos>, block=<LieRE block size>, variant=<ViT variant>,
ape_std=<APE init std; default 1.0, the LieRE reference's N(0, 1)>, finetune (the 256 px
recipe; needs init_from=<workdir or checkpoint of the 224 px run>),
smoke (tiny model, a few steps; used by the tests).

Expected runtime: not run here (needs ImageNet, downloaded by hand, and GPUs); the paper's
ImageNet runs took < 2 days 5 h each on 8x L40 GPUs, preemptions included (App. B.2).
Expected metric: not run here; the paper's Table 1 above (69.6 top-1 for LieRE8 at 224).
"""

from rope_lie import config_lib as common

EVAL_SIZES = (192, 256, 320, 384, 448)  # extra validation resolutions in px (Fig. 7)
FINETUNE_SIZE = 256  # the paper's fine-tuning resolution


def get_config(arg=None):
    args = common.parse_arg(
        arg,
        pe="liere",
        block=8,
        ape_std=common.LIERE_APE_INIT_STD,
        variant="B",
        finetune=False,
        init_from="",
        smoke=False,
    )
    if args.finetune and not args.init_from:
        raise ValueError("imagenet.py:finetune needs init_from=<workdir of the 224 px run>")
    c = common.base_config()
    c.dataset = common.dataset_config(
        "imagenet2012",  # TFDS catalogue dataset, prepared by the user (manual download)
        data_dir=None,  # TFDS root; None = ~/tensorflow_datasets
    )  # defaults: 224 px, inception crop + flip + RandAugment(2, 9), eval crop 0.875
    # Class token, encoder parameters per layer and head (the paper's defaults).
    c.model = common.model_config(
        variant=args.variant,  # ViT-B: width 768, depth 12, 12 heads (H = 64), MLP 3072
        patch_size=16,  # 16x16 px patches: 14x14 tokens at 224
        image_shape=(224, 224),  # training input (H, W) in px
        channels=3,  # RGB
        num_classes=1000,  # ImageNet-1k classes
        dropout=0.1,  # as in the paper
        **common.pe_fields(args.pe, args.block, ape_std=args.ape_std),  # pe, positions, ...
        dtype="bfloat16",  # activations in bfloat16 on accelerators; params stay float32
    )
    c.batch_size = 512  # effective batch size of the paper
    common.liere_paper_training(c)  # 200 epochs of Adam at 1e-4, cosine to 0
    c.log_every_steps = 200  # steps between metrics lines
    c.eval_every_epochs = 10.0  # epochs between evaluations
    c.eval_batch_size = 500  # 50,000 validation images = 100 batches
    c.checkpoint.every_steps = 2500  # steps between checkpoints (~1 epoch)
    c.checkpoint.keep = 3  # most recent checkpoints kept
    c.evals = dict(
        val224=common.eval_entry(),  # the training resolution
        val224_shuffled=common.eval_entry(shuffle_patches=True),  # shuffled patches
        **{f"val{s}": common.eval_entry(image_size=s) for s in EVAL_SIZES},  # Fig. 7
    )
    if args.finetune:
        side = FINETUNE_SIZE
        c.init_from = args.init_from  # parameters only; optimiser and step start afresh
        c.dataset.image_size = side
        c.model.image_shape = (side, side)  # 16x16 tokens
        c.num_epochs = 30.0  # paper
        c.optim.lr = 1e-5  # paper
        c.eval_every_epochs = 5.0
        c.evals = dict(
            **{
                f"val{side}": common.eval_entry(),
                f"val{side}_shuffled": common.eval_entry(shuffle_patches=True),
            },
            **{
                f"val{s}": common.eval_entry(image_size=s)
                for s in (*EVAL_SIZES[:1], 224, *EVAL_SIZES[2:])
            },
        )
    if args.smoke:
        common.make_smoke(c, variant="pico")
        c.model.dtype = "float32"
        c.dataset.image_size = 64  # 4x4 patches of 16 px: the same path, a fraction of the work
        c.model.image_shape = (64, 64)
        c.evals = dict(
            val64=common.eval_entry(),  # the (smoke) training resolution
            val64_shuffled=common.eval_entry(shuffle_patches=True),
            val96=common.eval_entry(image_size=96),  # one other resolution checks the path
        )
    return c
