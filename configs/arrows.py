r"""The LieRE spatial-reasoning task (arXiv:2406.10322, Sec. 5.2, Table 3), any encoder.

Train on a grid of arrows and letters; the label is the direction of the arrow next to the Y's
stem. Evaluate on larger grids of the same cell size (resolution extrapolation) and with
shuffled patches. Two scales:

- `res=paper`: 12 px cells, 9x9 grid (108 px) for training on 800,000 layouts, evaluated at
  14x14 (168 px) and 23x23 (276 px); ViT-B/12 (patch = cell), Adam 1e-4 cosine, batch 512,
  dropout 0.1 (the paper's 2D recipe). Paper Table 3 (108 / 168 / 276 px): LieRE64
  100 / 100 / 100, LieRE8 99.5 / 99.7 / 99.7, RoPE-Mixed 100 / 98.6 / 88.6,
  VisionLlama 46.4 / 48.6 / 48.6, APE 45.1 / 41.0 / 40.1.
- `res=cpu`: 8 px cells, 8x8 grid (64 px) on 20,000 layouts, evaluated at 12x12, 16x16 and
  20x20 (2.5x, the paper's 276/108), and on the training grid's test scenes resized to 80, 96
  and 128 px (`px080`, `px096`, `px128`: the same scenes at more pixels, as Heo et al. change
  resolution); the quickstart's ViT-mu/8.

    python -m rope_lie.main --config=configs/arrows.py:pe=rope_mixed,res=cpu \
        --workdir=workdirs/arrows_cpu_rope_mixed
    python -m rope_lie.main --config=configs/arrows.py:pe=liere,block=64,res=paper \
        --workdir=workdirs/arrows_paper_liere64

Arguments: pe=<family, a variant such as visionllama_liere (the LieRE paper's VisionLlama),
or ape/sincos>, block=<LieRE block size; 2 = the LieRE paper's RoPE-Mixed>, res=cpu|paper,
ape_std=<APE init std; default 1.0, the LieRE reference's N(0, 1)>,
init_scale=<LieRE generator init U[0, s); 0 = the family default 2 pi (LieRE Table 7 uses 1)>,
steps=<training steps, 0 = the scale's default>, smoke (a few steps; used by the tests),
naflex (mixed-size batches: every training image resized under a random budget of side**2
tokens, side uniform in [min_side, max_side], default 6-10, padded to max_side**2 tokens;
rope_lie/data/naflex.py; adds NaFlex evaluations of the training grid's test scenes at sides
min_side, 8, max_side and 12, `naflex_sNN`, beside the fixed-size ones), mixed_grids
(train on scenes of 6 to 10 cells a side, `spatial_arrows/c8_g6to10`; res=paper: 7 to 11,
`c12_g7to11`; each read at its own size and padded, nothing resized: the same cells on more or
fewer of them; the evaluations stay those of the fixed-grid training).

Runtime on 2 CPU cores (AMD EPYC, no accelerator, jax 0.10.2): res=cpu, 6-7 min a run, 500
steps at ~330 examples/s when nothing else runs, plus the evaluations; longer on a shared
machine (the arrows study's runs logged 96-616 examples/s). res=paper: not run
here (ViT-B on 800,000 layouts needs an accelerator; the paper gives no runtime for it).
mixed_grids: about 11 minutes a run (RoPE-Mixed, 149 examples/s beside other work): its padded
batches hold 100 token slots, 66 of them real on average, against the fixed grid's 64.
Expected metric, res=cpu: the arrows study (`python -m experiments.studies.run arrows`, which
evaluates once, at the end; experiments/studies/arrows/README.md, and summary.md for the
current seed means): accuracy in % on 2,000 test layouts, the range over seeds 0-2:
  pe=                 seeds  g08        g12        g16        g20        g08_shuffled
  liere (block=8)     0-2    100.0      100.0      99.9-100.0 86.8-99.5  32.0-34.2
  liere,block=16      0-2    100.0      99.5-100.0 89.7-100.0 77.3-99.9  32.2-33.9
  liere,block=2       0-2    100.0      94.2-99.6  75.3-91.5  56.9-76.2  30.9-32.4
  rope_mixed          0-2    100.0      99.5-100.0 90.1-99.2  39.3-96.2  27.3-33.8
  visionllama         0-2    100.0      99.7-99.9  96.9-98.4  93.8-96.3  32.1-34.5
  visionllama_liere   0-2    42.4-43.2  44.6-45.9  44.5-44.6  43.0-45.6  42.3-43.0
  ape                 0-2    43.2-43.5  44.1-46.2  42.6-44.6  43.9-44.4  42.4-43.5
Chance is 25 %; a model blind to positions reaches at most 44.2 %. res=paper: not run here;
the paper's Table 3 is above.
"""

from rope_lie import config_lib as common

SCALES = {
    # cell px, training grid, larger eval grids, same scenes at more px (cell sizes), variant,
    # train steps, batch, lr, dropout
    "cpu": dict(
        cell=8,
        grid=8,
        evals=(12, 16, 20),
        rescaled=(10, 12, 16),
        variant="mu/8",
        steps=500,
        batch=128,
        lr=2e-3,
        dropout=0.0,
        mixed=(6, 10),
    ),
    "paper": dict(
        cell=12,
        grid=9,
        evals=(14, 23),
        rescaled=(),
        variant="B/12",
        steps=1563,
        batch=512,
        lr=1e-4,
        dropout=0.1,
        mixed=(7, 11),
    ),
}


def get_config(arg=None):
    args = common.parse_arg(
        arg,
        pe="liere",
        block=8,
        ape_std=common.LIERE_APE_INIT_STD,
        init_scale=0.0,
        res="cpu",
        steps=0,
        smoke=False,
        naflex=False,
        min_side=0,
        max_side=0,
        mixed_grids=False,
    )
    if args.res not in SCALES:
        raise ValueError(f"res={args.res!r}; expected one of {sorted(SCALES)}")
    s = SCALES[args.res]
    lo, hi = s["mixed"]
    if args.mixed_grids and args.naflex:
        raise ValueError("mixed_grids reads scenes unresized; naflex resizes them: pick one")
    if args.mixed_grids and (args.min_side or args.max_side):
        raise ValueError(
            f"min_side={args.min_side}, max_side={args.max_side} are naflex's; mixed_grids at "
            f"res={args.res} trains on its dataset's grids of {lo} to {hi} cells"
        )
    name = lambda grid: f"spatial_arrows/c{s['cell']}_g{grid}"
    c = common.base_config()
    c.dataset = common.dataset_config(
        # generated on first use (rope_lie/data/spatial_arrows.py)
        name(s["grid"]) if not args.mixed_grids else f"spatial_arrows/c{s['cell']}_g{lo}to{hi}",
        data_dir=None,  # TFDS root; None = ~/tensorflow_datasets
        mean=(0.5,),  # grayscale glyphs (255 on 0) mapped to [-1, 1]
        std=(0.5,),
    )
    side = s["cell"] * s["grid"]
    # Class token, encoder parameters per layer and head (the paper's defaults).
    c.model = common.model_config(
        variant=s["variant"],  # ViT with patch = one grid cell
        image_shape=(side, side),  # training input (H, W) in px
        channels=1,  # grayscale
        num_classes=4,  # direction of the target arrow: up, right, down, left
        dropout=s["dropout"],  # dropout rate
        **common.pe_fields(args.pe, args.block, ape_std=args.ape_std),  # pe, positions, ...
    )
    if args.init_scale:
        if args.pe != "liere":
            raise ValueError(f"init_scale={args.init_scale} is for pe=liere, not pe={args.pe}")
        c.model.pe_hparams.init_scale = args.init_scale  # LieRE Table 7: 2 pi (default) vs 1
    c.batch_size = s["batch"]  # examples per step
    c.total_steps = args.steps or s["steps"]  # paper: 800,000 examples / 512 = 1,563 steps
    c.optim.name = "adamw" if args.res == "cpu" else "adam"
    c.optim.lr = s["lr"]  # peak learning rate, cosine decay
    c.optim.weight_decay = 0.05 if args.res == "cpu" else 0.0  # weight matrices only
    c.optim.warmup_steps = 100 if args.res == "cpu" else 0  # linear warmup steps
    c.log_every_steps = 50  # steps between metrics lines
    # half-way and at the end; a reference, so that --config.total_steps moves it too
    c.eval_every_steps = c.get_ref("total_steps") // 2
    c.eval_batch_size = 250  # eval examples per step
    c.checkpoint.every_steps = 100  # steps between checkpoints
    own = name(s["grid"]) if args.mixed_grids else None  # the fixed training grid's scenes
    c.evals = dict(
        **{f"g{s['grid']:02d}": common.eval_entry(name=own)},  # training grid, held-out layouts
        **{f"g{g:02d}": common.eval_entry(name=name(g)) for g in s["evals"]},  # larger grids
        **{f"g{s['grid']:02d}_shuffled": common.eval_entry(name=own, shuffle_patches=True)},
        # the training grid's test scenes resized to more pixels (c8_g8's layouts)
        **{
            f"px{c * s['grid']:03d}": common.eval_entry(name=f"spatial_arrows/c{c}_g{s['grid']}")
            for c in s["rescaled"]
        },
    )
    if args.naflex:  # the fixed-size evaluations above stay
        low, high = args.min_side or 6, args.max_side or 10
        sides = sorted({low, s["grid"], high, 12})
        common.add_naflex(c, low, high, eval_sides=sides)
    if args.mixed_grids:  # one token per cell, up to hi x hi (rope_lie/data/naflex.py)
        c.naflex = common.naflex_config(lo, hi, native=True)
    if args.smoke:
        common.make_smoke(c, variant=s["variant"].replace("B", "mu"))
        c.model.dropout = 0.0
        c.dataset.eval_split = "test[:16]"  # a slice: faster evaluation
        for name in c.evals:
            if c.evals[name].name:
                c.evals[name].split = "test[:16]"
    return c
