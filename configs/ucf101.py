r"""UCF101 video classification, the LieRE paper's 3D recipe (arXiv:2406.10322, App. B.3).

A ViT-B over 8-frame clips at 224x224 cut into 2x16x16 tubelets (4x14x14 = 784 tokens), CLS
pooling, dropout 0.1; Adam (0.9, 0.999, eps 1e-8), learning rate 1e-4 with cosine decay,
batch 64, 200 epochs; inception crop + flip per clip. LieRE rotates with 3D positions
(time, row, col). Paper Table 1: top-1 47.0 (LieRE8), 46.3 (RoPE-Mixed), 44.7 (LieRE64),
40.9 (APE). The paper used RandAugment for every vision task; our pipeline has no video
RandAugment (rope_lie/data refuses it for clips), so this recipe runs without it.

    tfds build ucf101 --config=ucf101_1_256 --data_dir=$TFDS    # once
    python -m rope_lie.main --config=configs/ucf101.py:pe=liere,block=8 \
        --workdir=workdirs/ucf101_liere8 --config.dataset.data_dir=$TFDS

Arguments: pe=<family or ape/sincos>, block=<LieRE block size>, variant=<ViT variant>,
ape_std=<APE init std; default 1.0, the LieRE reference's N(0, 1)>,
smoke (tiny model and clips, a few steps; used by the tests).

Expected runtime: not run here (needs UCF101 prepared with `tfds build` and GPUs); the paper
ran it on 8x A100 40 GB or 4x A100 80 GB GPUs and gives no runtime (App. B.3).
Expected metric: not run here; the paper's Table 1 above (47.0 top-1 for LieRE8), with
RandAugment, which this recipe lacks.
"""

from rope_lie import config_lib as common


def get_config(arg=None):
    args = common.parse_arg(
        arg, pe="liere", block=8, ape_std=common.LIERE_APE_INIT_STD, variant="B", smoke=False
    )
    c = common.base_config()
    c.dataset = common.dataset_config(
        "ucf101/ucf101_1_256",  # TFDS catalogue dataset (split 1, 256 px), prepared by the user
        data_dir=None,  # TFDS root; None = ~/tensorflow_datasets
        image_size=224,  # frame side in px after the crop
        num_frames=8,  # frames per clip
        frame_stride=2,  # stored frames between clip frames
    )  # defaults: ImageNet mean/std, inception crop + flip
    # Class token, encoder parameters per layer and head (the paper's defaults).
    c.model = common.model_config(
        variant=args.variant,  # ViT-B: width 768, depth 12, 12 heads (H = 64), MLP 3072
        patch_size=(2, 16, 16),  # tubelets: 2 frames x 16 x 16 px
        image_shape=(8, 224, 224),  # clip (T, H, W)
        channels=3,  # RGB
        num_classes=101,  # UCF101 actions
        dropout=0.1,  # as in the paper
        **common.pe_fields(args.pe, args.block, ape_std=args.ape_std),  # pe, positions, ...
        dtype="bfloat16",  # activations in bfloat16 on accelerators; params stay float32
    )
    c.batch_size = 64  # total batch size of the paper
    common.liere_paper_training(c)  # 200 epochs of Adam at 1e-4, cosine to 0
    c.log_every_steps = 100  # steps between metrics lines
    c.eval_every_epochs = 10.0  # epochs between evaluations
    c.eval_batch_size = 64  # clips per eval step
    c.checkpoint.every_steps = 1000  # steps between checkpoints
    c.evals = dict(
        test=common.eval_entry(),  # split-1 test clips
        test_shuffled=common.eval_entry(shuffle_patches=True),  # shuffled tubelets
    )
    if args.smoke:
        common.make_smoke(c, variant="pico")
        c.dataset.image_size = 32  # 4 x 2 x 2 tubelets per clip
        c.model.image_shape = (8, 32, 32)
        c.model.dtype = "float32"
    return c
