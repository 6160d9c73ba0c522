"""Shared defaults and argument parsing for the recipes in configs/ (``config_lib``).

In the package, not beside the recipes, so a recipe loads from any directory
(``--config=/any/path/configs/quickstart.py``) and user recipes outside the repository can use
it: ``from rope_lie import config_lib``.

A recipe is chosen as ``--config=configs/<recipe>.py:<arg>`` where ``arg`` is a comma-separated
list of ``key=value`` pairs and bare flags, e.g. ``pe=liere,variant=S/16,smoke``. Each recipe
declares its arguments and their defaults; unknown arguments fail with the list of known ones,
an argument given twice or one that would do nothing beside the others (``block=`` with
``pe=ape``, ``epochs=`` with ``smoke``: ``NEEDS``) fails with what it needs.
"""

from __future__ import annotations

import copy
from typing import Any

import ml_collections as mc

from rope_lie import encodings


def parse_arg(arg: str | None, **defaults: Any) -> mc.ConfigDict:
    """Parse "a=1,b=x,flag" against `defaults` (values cast to each default's type).

    A bare word sets a boolean argument to True. An argument given twice, or given where it
    would do nothing (``NEEDS``, for the arguments this recipe has), is an error.
    """
    args = mc.ConfigDict(defaults)
    given = set()
    for item in filter(None, (s.strip() for s in (arg or "").split(","))):
        key, has_value, value = item.partition("=")
        if key not in defaults:
            raise ValueError(f"Unknown config argument {key!r}; known: {sorted(defaults)}")
        if key in given:
            raise ValueError(f"Config argument {key!r} is given twice in {arg!r}")
        given.add(key)
        default = defaults[key]
        if not has_value:
            if not isinstance(default, bool):
                raise ValueError(f"Config argument {key!r} needs a value ({key}=...)")
            args[key] = True
        elif isinstance(default, bool):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"Config argument {key}={value!r} is not a boolean")
            args[key] = value.lower() in ("true", "1")
        else:
            try:
                args[key] = type(default)(value)
            except ValueError:
                raise ValueError(
                    f"Config argument {key}={value!r} is not a {type(default).__name__} "
                    f"(its default is {default!r})"
                ) from None
    for key in sorted(given):
        if key in NEEDS:
            applies, needs = NEEDS[key]
            if not applies(args):
                needs = needs(args) if callable(needs) else needs
                raise ValueError(
                    f"Config argument {key}={args[key]!r} does nothing here: it needs {needs}"
                )
    return args


def _family(pe: str) -> str:
    """The rotary or bias family a ``pe=`` value runs on q and k ("nope" for a table)."""
    if pe in ADDITIVE_PES:
        return "nope"
    return PE_VARIANTS.get(pe, (pe,))[0]


# Recipe arguments that act only beside others: {argument: (does it act, given the parsed
# arguments?, what it needs: a string, or one made from them)}. Checked for the arguments a
# recipe has and a user gave.
NEEDS = {
    "block": (
        lambda a: a.pe == "liere" or _family(a.pe) == "comrope",
        "pe=liere or a comrope pe (the block size of LieRE and ComRoPE)",
    ),
    "ape_std": (lambda a: a.pe == "ape", "pe=ape (the APE table's init std)"),
    "generator": (lambda a: a.pe == "cayley_string", "pe=cayley_string"),
    "bw": (
        lambda a: a.pe == "cayley_string" and a.generator == "banded",
        "pe=cayley_string,generator=banded",
    ),
    "k": (
        lambda a: a.pe == "cayley_string" and a.generator == "topk",
        "pe=cayley_string,generator=topk",
    ),
    "rotary_fraction": (
        lambda a: _family(a.pe) in p_rope_families(),
        lambda a: f"a pe in {p_rope_families()} (p-RoPE), not pe={a.pe!r}",
    ),
    "rescale": (
        lambda a: _family(a.pe) != "nope",
        "a pe that encodes positions in attention (not ape, sincos or nope: their tables and "
        "NoPE read no augmented positions)",
    ),
    "rpe": (
        lambda a: _family(a.pe) != "nope",
        "a pe that encodes positions in attention (not ape, sincos or nope)",
    ),
    "min_side": (lambda a: a.naflex, "naflex"),
    "max_side": (lambda a: a.naflex, "naflex"),
    "naflex_evals": (lambda a: a.naflex, "naflex"),
    "init_from": (lambda a: a.finetune, "finetune"),
    "epochs": (
        lambda a: not a.get("smoke") and not a.get("plateau"),
        "smoke and plateau off (smoke trains a few steps of its own, plateau PLATEAU_EPOCHS)",
    ),
    "steps": (lambda a: not a.get("smoke"), "smoke off (smoke trains a few steps of its own)"),
}


def dataset_config(name: str, **overrides: Any) -> mc.ConfigDict:
    """The data pipeline's defaults for `name` (rope_lie/data/pipeline.py) plus `overrides`.

    Fields that default to None become typed placeholders so the command line can set them
    (`--config.dataset.data_dir=/data/tfds`).
    """
    from rope_lie.data import defaults  # a config needs no TensorFlow (data/__init__.py)

    ds = defaults.default_config(name)
    typed_none = {"data_dir": str, "image_size": int}
    for key, kind in typed_none.items():
        value = overrides.pop(key, ds[key])
        ds[key] = mc.config_dict.placeholder(kind)
        ds[key] = value
    for key, value in overrides.items():
        if key not in ds:
            raise ValueError(f"Unknown dataset field {key!r}; known: {sorted(ds)}")
        ds[key] = value
    return ds


DIM_KEYS = ("width", "depth", "num_heads", "mlp_dim")  # model.dims (models/variants.py)
# Read from the families' own declarations (``encodings/family.py``: ``FAMILY``):
ADDITIVE_PES = tuple(encodings.ADDITIVE)  # `pe=` values that are tables added to the tokens
# Each family's reference positions.
CONVENTIONS = {name: f.convention for name, f in encodings.families().items()}
# `pe=` values that name a variant of a family: (family, its init arguments, positions).
PE_VARIANTS = {
    pe: (name, dict(settings), convention)
    for name, f in encodings.families().items()
    for pe, (settings, convention) in f.variants.items()
}
APE_INIT_STD = 0.02  # ViT/timm's APE init std (quickstart, digits, Cayley recipes)
LIERE_APE_INIT_STD = 1.0  # the LieRE reference: torch.randn (its models/vit.py); LieRE recipes


def pe_choices() -> list[str]:
    """Every value a recipe's ``pe=`` accepts: the rotary and bias families
    (``rope_lie.encodings``), their named variants (``PE_VARIANTS``) and the additive tables."""
    return (
        sorted(encodings.ROTARY) + sorted(encodings.BIAS) + sorted(PE_VARIANTS) + list(ADDITIVE_PES)
    )


def p_rope_families() -> list[str]:
    """The rotary families whose ``init`` takes p-RoPE's ``rotary_fraction``."""
    return sorted(
        name
        for name, f in encodings.families().items()
        if "rotary_fraction" in f.settings_of_init()
    )


def pe_fields(
    pe: str, block: int = 8, *, ape_std: float = APE_INIT_STD, convention: str | None = None
) -> dict[str, Any]:
    """The model fields for a recipe's `pe=` argument.

    `pe` is a rotary/bias family (liere, rope_mixed, ...), a named variant (`PE_VARIANTS`,
    e.g. visionllama_liere), or an additive table (ape, sincos, with no rotary family).
    Positions follow each family's reference: LieRE "sequential", VisionLlama "autoscale", the
    LieRE paper's VisionLlama "sequential", ComRoPE "unit_centred", DINOv3 "centred", the rest
    "integer" (patch indices); `convention` overrides that. `block` is LieRE's and ComRoPE's
    block size (2 = the LieRE paper's "RoPE-Mixed"), `ape_std` the APE table's init std.
    """
    if pe not in pe_choices():
        raise ValueError(f"unknown pe={pe!r}; expected one of {', '.join(pe_choices())}")
    additive = pe if pe in ADDITIVE_PES else "none"
    family, hparams, default_convention = PE_VARIANTS.get(
        pe,
        (pe, {}, CONVENTIONS.get(pe, "integer")),  # additive tables: integer positions
    )
    if pe == "liere":
        hparams = dict(block_size=block)
    if family == "comrope":
        hparams = dict(hparams, block_size=block)
    return dict(
        pe="nope" if additive != "none" else family,  # rotary/bias family on q and k
        pe_hparams=dict(hparams),  # family init arguments
        additive=additive,  # absolute table added to the tokens ("none", "ape", "sincos")
        additive_hparams=dict(init_std=ape_std) if additive == "ape" else {},  # table init
        position_convention=convention or default_convention,  # token positions (positions.py)
    )


def model_config(
    *,
    variant: str,
    image_shape: tuple[int, ...],
    channels: int,
    num_classes: int,
    pe: str,
    pe_hparams: dict[str, Any],
    additive: str,
    additive_hparams: dict[str, Any],
    position_convention: str,
    patch_size: int | tuple[int, ...] | None = None,
    pool: str = "cls",
    dropout: float = 0.0,
    dtype: str = "float32",
) -> mc.ConfigDict:
    """`config.model`: the keyword arguments of `rope_lie.models.vit.ViT`.

    The position-encoding arguments come from `pe_fields` (`**common.pe_fields(args.pe, ...)`);
    a recipe states the rest only where it differs from these defaults. `patch_size=None` leaves
    the key out: the patch is the variant's (e.g. "mu/8"). Every recipe keeps encoder
    parameters per head and per layer (the LieRE default; studies override
    `model.share_pe_heads` / `model.share_pe_layers`) and a zero-initialised classifier.
    """
    m = mc.ConfigDict()
    m.variant = variant  # `VARIANTS` key with optional "/patch", e.g. "B/16", "mu/8"
    if patch_size is not None:
        m.patch_size = patch_size  # px per patch side, or (t, h, w) tubelet; overrides variant's
    m.image_shape = image_shape  # training input (H, W) in px, or (T or D, H, W)
    m.channels = channels  # input channels C
    m.num_classes = num_classes  # classifier outputs K
    m.pool = pool  # "cls" (class token), "mean" (the patch tokens'), "mean_with_cls" (timm's avg)
    m.dropout = dropout  # rate after the embedding, the attention output and in the MLP
    m.pe = pe  # rotary/bias family on q and k ("nope" with an additive table)
    m.pe_hparams = pe_hparams  # family init arguments
    m.additive = additive  # absolute table added to the tokens ("none", "ape", "sincos")
    m.additive_hparams = additive_hparams  # table init arguments
    m.position_convention = position_convention  # token positions (encodings/positions.py)
    # the convention's arguments, e.g. dict(temporal_spacing=2.0) for "diagonal" (VideoRoPE)
    m.position_hparams = {}
    # None, or dict(shift=, jitter=, rescale=): DINOv3's coordinate augmentation in training;
    # randomize=: RPE-2D's randomized positions from a grid that many times larger
    m.position_augment = None
    m.share_pe_heads = False  # encoder parameters per head ...
    m.share_pe_layers = False  # ... and per layer
    m.head_zero_init = True  # zero-initialised classifier
    m.dtype = dtype  # activation dtype; parameters stay float32
    m.patch_dropout = 0.0  # fraction of the tokens dropped in training (0 = off; vit.ViT)
    # width / depth / num_heads / mlp_dim overriding the variant's (None = the variant's), e.g.
    # --config.model.dims.width=96
    m.dims = {
        k: mc.config_dict.placeholder(int) for k in ("width", "depth", "num_heads", "mlp_dim")
    }
    # Attention backend (models/backends.py): "xla" (plain formula), "cudnn" (GPU, bf16/fp16),
    # "pallas" (TPU flash kernel) or "chunked" (exact, O(T x block) memory, any platform).
    m.attention = "xla"
    # Cayley-STRING's P folded into the q/k projections once per step (False: applied to every
    # token, the reference's way; the same logits, slower: experiments/benchmarks/cayley_speed.py)
    m.fold_mix = True
    # Options for converted PyTorch models (rope_lie/interop), off here (models/blocks.py):
    m.layer_scale = mc.config_dict.placeholder(float)  # LayerScale init value; None = off
    m.gelu_approximate = True  # tanh GELU; False = exact (erf)
    m.norm_eps = 1e-6  # LayerNorm epsilon
    m.qkv_bias = True  # biases on the q, k, v projections
    m.additive_prefix = True  # the class token has its own row of the additive table
    m.num_registers = 0  # learned register tokens after the class token (DINOv3: 4)
    m.final_norm = True  # LayerNorm on every token before pooling (timm's norm)
    m.fc_norm = False  # LayerNorm on the pooled feature before the head (timm's fc_norm)
    return m


TOPK_INIT_STD = 0.02  # Cayley-STRING top-k: S ~ N(0, 0.02) at init (see cayley_hparams)


def cayley_hparams(generator: str, bandwidth: int, k: int) -> dict[str, Any]:
    """Cayley-STRING init arguments for the sparse-generator study (cayley_string.py)."""
    hparams: dict[str, Any] = dict(generator=generator)  # dense | block2x2 | banded | topk
    if generator == "banded":
        hparams["bandwidth"] = bandwidth  # |i - j| <= bandwidth kept in S
    if generator == "topk":
        hparams["k"] = k  # largest |S_ij| kept (mask symmetrised)
        # From S = 0 top_k would keep the first k entries forever (no gradient reaches the
        # rest); small random entries let the selection follow the learned magnitudes. The
        # study gives no init; 0.02 is the usual small-parameter scale (ViT's APE, timm).
        hparams["init_std"] = TOPK_INIT_STD
    return hparams


def data_seed(config: mc.ConfigDict) -> int:
    """The seed of the training data's order and augmentation: ``config.data_seed``, or
    ``config.seed`` where it is None or absent (every run before data_seed existed)."""
    value = config.get("data_seed")
    return config.seed if value is None else value


def base_config() -> mc.ConfigDict:
    """Defaults shared by every recipe; recipes fill `dataset`, `model`, `evals`."""
    c = mc.ConfigDict()
    c.seed = 0  # seeds parameter init, dropout keys and (without data_seed) the data order
    # the training data's order and augmentation alone; None = `seed` (the same batches as
    # before data_seed existed): runs with different seeds and one data_seed see one stream
    c.data_seed = mc.config_dict.placeholder(int)
    c.batch_size = 128  # global examples per step (split over all devices and processes)
    c.eval_batch_size = 256  # global examples per eval step; last batch padded and masked
    c.total_steps = 0  # training steps; 0 = num_epochs * (train examples // batch_size)
    c.num_epochs = 1.0  # epochs, used when total_steps == 0
    c.log_every_steps = 50  # steps between metrics.jsonl / TensorBoard lines
    c.eval_every_steps = 0  # steps between evaluations (0 = see eval_every_epochs)
    c.eval_every_epochs = 0.0  # epochs between evaluations (0 = only at the end)
    c.optim = mc.ConfigDict()
    c.optim.name = "adamw"  # 'adam' or 'adamw' (decoupled weight decay)
    c.optim.lr = 1e-3  # peak learning rate, reached after warmup
    c.optim.b1 = 0.9  # Adam first-moment decay
    c.optim.b2 = 0.999  # Adam second-moment decay
    c.optim.eps = 1e-8  # Adam denominator epsilon
    c.optim.weight_decay = 0.0  # decoupled decay coefficient (adamw; never on PE/norms/biases)
    c.optim.grad_clip = 1.0  # max global gradient norm (0 = no clipping)
    c.optim.warmup_steps = 0  # linear warmup steps from 0 to lr
    c.optim.end_lr_ratio = 0.0  # cosine decays to lr * end_lr_ratio at total_steps
    c.checkpoint = mc.ConfigDict()
    c.checkpoint.every_steps = 500  # steps between checkpoints (plus one at the end)
    c.checkpoint.keep = 2  # most recent checkpoints kept on disk
    c.checkpoint.async_save = True  # write checkpoints in a background thread
    c.mesh = mc.ConfigDict()
    c.mesh.data = -1  # data-parallel axis size (-1 = the remaining devices)
    c.mesh.fsdp = 1  # parameter-sharding axis size (1 = params replicated)
    c.fsdp_min_size = 2**14  # arrays with fewer elements stay replicated under FSDP
    c.init_from = ""  # workdir or checkpoint step to take parameters from (rope_lie/finetune.py)
    c.init_head = "keep"  # with init_from: "keep" the source's head, or "new" (another class count)
    c.multihost = False  # call jax.distributed.initialize() (also if JAX_COORDINATOR_ADDRESS set)
    c.data_shards = 0  # independently shuffled shards of each batch (0 = one per process)
    c.distributed = mc.ConfigDict()  # multi-process job; unset fields: JAX detects the cluster
    c.distributed.coordinator_address = ""  # "host:port" of process 0 ("" = detect / not used)
    c.distributed.num_processes = 0  # processes in the job (0 = detect)
    c.distributed.process_id = -1  # this process (-1 = detect)
    c.progress = True  # tqdm progress bar with throughput and ETA
    c.tensorboard = True  # also write TensorBoard event files to workdir/tensorboard
    # where the data is read: "tfds" (tf.data over TFDS, rope_lie/data) or "memory" (numpy
    # arrays augmented in JAX, no TensorFlow: rope_lie/in_memory.py, Fashion-MNIST only)
    c.input = "tfds"
    return c


def eval_entry(
    name: str | None = None,
    image_size: int | None = None,
    split: str | None = None,
    shuffle_patches: bool = False,
    extrapolation: str | None = None,
    final_only: bool = False,
) -> mc.ConfigDict:
    """One entry of `config.evals`: which data to evaluate on, relative to `config.dataset`.

    `extrapolation`: a resolution extrapolation tool for the encoder states at this entry's
    grid (rope_lie/encodings/extrapolation.py: "pi", "ntk", "yarn", "logit", "pi+logit",
    "ntk+logit"), chosen from the training grid with no retraining; None (the key is then left
    out): the model as trained. `final_only`: evaluated at the end of the run only, not at the
    evaluations along the way (`eval_every_epochs`), so a held-out curve of one entry does not
    pay for all of them.
    """
    e = mc.ConfigDict()
    e.name = mc.config_dict.placeholder(str)  # TFDS name; None = config.dataset.name
    e.image_size = mc.config_dict.placeholder(int)  # input side in px; None = dataset's
    e.split = mc.config_dict.placeholder(str)  # split; None = config.dataset.eval_split
    e.shuffle_patches = shuffle_patches  # permute the patches of every example at random
    e.final_only = final_only  # skipped by the evaluations before the last step
    e.name, e.image_size, e.split = name, image_size, split
    if extrapolation is not None:
        e.extrapolation = extrapolation  # checked against the model before training
    return e


def add_extrapolation_evals(c: mc.ConfigDict, names: list[str]) -> list[str]:
    """Beside each evaluation in `names`, one per extrapolation tool the model supports.

    The tools are `encodings.extrapolation.tools_for(pe, position_convention)`, each alone;
    entry `<name>@<tool>` is `<name>`'s data with `extrapolation=<tool>`: the same trained
    model evaluated with the tool (experiments/studies read `@` as another arm of the run).

    Returns:
      the tools added.
    """
    from rope_lie.encodings import extrapolation

    tools = list(extrapolation.tools_for(c.model.pe, c.model.position_convention))
    for name in names:
        for tool in tools:
            entry = copy.deepcopy(c.evals[name])
            entry.extrapolation = tool
            c.evals[f"{name}@{tool}"] = entry
    return tools


def make_smoke(
    c: mc.ConfigDict,
    variant: str | None = "pico",
    *,
    total_steps: int = 4,
    batch_size: int = 8,
    eval_batch_size: int = 8,
    warmup_steps: int = 0,
    log_every_steps: int = 2,
    checkpoint_every_steps: int = 2,
) -> None:
    """Shrink a recipe to a few steps (checks the whole path, not accuracy).

    Args:
      c: the recipe's config, changed in place.
      variant: a tiny ViT to train instead (pico: 2 layers of width 32, H = 16; LieRE blocks are
        capped at 16), or None to keep the recipe's model.
      total_steps: training steps.
      batch_size: global examples per training step.
      eval_batch_size: global examples per evaluation step.
      warmup_steps: learning-rate warmup steps.
      log_every_steps: steps between metrics lines.
      checkpoint_every_steps: steps between checkpoints.
    """
    if variant is not None:
        c.model.variant = variant
        if "block_size" in c.model.pe_hparams:
            c.model.pe_hparams.block_size = min(c.model.pe_hparams.block_size, 16)
    c.total_steps = total_steps
    c.batch_size = batch_size
    c.eval_batch_size = eval_batch_size
    c.optim.warmup_steps = warmup_steps
    c.log_every_steps = log_every_steps
    c.eval_every_steps = 0  # evaluate only at the end
    c.eval_every_epochs = 0.0
    c.checkpoint.every_steps = checkpoint_every_steps
    c.progress = False


def naflex_config(
    min_side: int, max_side: int, max_tokens: int = 0, native: bool = False
) -> mc.ConfigDict:
    """`config.naflex`: train on mixed-size token batches (rope_lie/data/naflex.py).

    Present only in runs that turn it on (a recipe's `naflex` or `mixed_grids` argument);
    without it every batch is one fixed image size. ``native``: no budgets; every training
    image is read at its own size (its ``extent``: min_side to max_side patches a side).
    """
    n = mc.ConfigDict()
    n.min_side = min_side  # each training image gets a budget of side**2 tokens, side uniform
    n.max_side = max_side  # ... in [min_side, max_side] (a square image: side x side patches)
    n.max_tokens = max_tokens or max_side**2  # padded length of every training batch
    n.native = native  # True: images at their own extent, unresized (no budgets)
    # Packing (NaViT): each training batch's images packed greedily into rows of max_tokens
    # slots, several images a row (run_inputs.pack_batch); off: one padded image per row.
    n.pack = False
    n.pack_images = 0  # most images a row; 0: max(1, max_tokens // min_side**2)
    # rows rounded up to a multiple of this (a compiled step per distinct row count: few of
    # them); 0: batch_size // 32, at least 1
    n.pack_row_multiple = 0
    return n


def naflex_eval_entry(side: int, name: str | None = None, split: str | None = None):
    """An eval entry of images resized under side**2 tokens and padded (needs `config.naflex`)."""
    e = eval_entry(name=name, split=split)
    e.naflex_side = side  # budget side**2 tokens (a square image: side x side patches)
    return e


def add_naflex(c: mc.ConfigDict, min_side: int, max_side: int, eval_sides=()) -> None:
    """Turn NaFlex training on in a recipe, with NaFlex evaluations at `eval_sides`.

    The recipe's fixed-size evaluations stay (they run the same model on whole images).
    """
    c.naflex = naflex_config(min_side, max_side)
    for side in eval_sides:
        c.evals[f"naflex_s{side:02d}"] = naflex_eval_entry(side)


def liere_paper_training(c: mc.ConfigDict) -> None:
    """The LieRE paper's schedule and optimiser (arXiv:2406.10322, Sec. 5): 200 epochs of Adam
    without weight decay, learning rate 1e-4 decayed by a cosine to 0, no clipping, no warmup
    (the paper mentions neither). The batch size is the recipe's."""
    c.num_epochs = 200.0  # epochs of the paper
    c.optim.name = "adam"  # Adam, no weight decay (paper)
    c.optim.lr = 1e-4  # initial learning rate, cosine decay to 0
    c.optim.grad_clip = 0.0  # no clipping mentioned in the paper
    c.optim.warmup_steps = 0  # no warmup mentioned in the paper
