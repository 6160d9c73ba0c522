"""Command line: convert PyTorch weights into a rope_lie workdir (``rope_lie/interop``).

    python -m rope_lie.convert --from=timm --model=vit_small_patch16_rope_mixed_224 \
        --checkpoint=model.safetensors --workdir=DIR
    python -m rope_lie.convert --from=timm --model=vit_base_patch16_dinov3 \
        --checkpoint=model.safetensors --overrides=global_pool=token --workdir=DIR
    python -m rope_lie.convert --from=liere --model=channels=3 --checkpoint=last.ckpt \
        --workdir=DIR

``--from=timm``: ``--model`` is a supported timm name (``interop.timm_eva.SUPPORTED``),
``--checkpoint`` a timm-layout ``state_dict`` file (``.safetensors``/``.pth``, e.g. the
``naver_in1k`` weights from the Hugging Face hub) or ``none`` for timm's random
initialisation; ``--overrides`` passes keyword arguments to ``timm.create_model``
(``embed_dim=64,depth=2``: small models for tests; ``global_pool=token`` for a DINOv3 that
pools its class token as upstream DINOv3 does, timm's default being ``"avg"``, which converts
too); the class count is read from the checkpoint's head (a fine-tuned
model's; none: a headless model, converted with an identity head), and a tensor of another
shape than the model's is named in the error. ``--from=liere``: ``--checkpoint`` is a
LieRE reference Lightning checkpoint (or its ``state_dict``), its architecture read from the
tensor shapes (``--model`` may set ``channels=`` and any other ``ReferenceSpec`` field, which
must then agree); with ``--checkpoint=none`` ``--model`` gives the whole ``ReferenceSpec``
(``image_size=32,patch_size=8,num_classes=10,dim=128,depth=2,heads=2,mlp_dim=256,
generator_dim=8,per_layer=1,per_head=1``) and the reference ViT is built in PyTorch with
random weights (``--seed``).

The workdir holds an Orbax checkpoint (``config.init_from=DIR``) and ``config.json`` /
``config.py`` (``rope_lie.main``); ``rope_lie.interop.load(DIR)`` returns the model. Needs the
``interop`` extra (``pip install -e ".[interop]"``: torch, torchvision, timm).

Exit status: 0 when the model was converted; 2 for an error in what was asked (a bad flag, a
missing or unreadable checkpoint, an unsupported model or architecture, a workdir that is not
empty, a missing extra), printed as one line ``error: <message>`` on stderr with no traceback.
Any other error is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import os
import sys
from typing import Any

try:
    from rope_lie import _extras, errors
    from rope_lie.interop import _torch_first, liere_reference, liere_torch, timm_eva, workdir
except ModuleNotFoundError as _error:  # the core install: one line naming the extra to install
    from rope_lie import _extras

    if __name__ != "__main__":
        _extras.raise_missing(_error, "rope_lie.convert", "interop")
    _extras.exit_missing(_error, "python -m rope_lie.convert", "interop")

SOURCES = ("timm", "liere")
DEFAULT_DATASETS = {"timm": "imagenet2012", "liere": "cifar100"}
CHECKPOINTS = {  # what --checkpoint takes, per source
    "timm": "a timm state_dict file (.safetensors or .pth) or 'none'",
    "liere": "a LieRE reference Lightning checkpoint or its state_dict (.ckpt/.pth) or 'none'",
}
EXIT_USER_ERROR = 2


def parse_overrides(text: str) -> dict[str, Any]:
    """``"embed_dim=64,img_size=32"`` -> ``{"embed_dim": 64, "img_size": 32}`` (Python literals,
    anything else kept as a string)."""
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        key, has_value, value = item.partition("=")
        if not has_value or not key:
            raise ValueError(
                f"--overrides={text!r}: {item!r} is not key=value; expected timm.create_model "
                "keyword arguments as k=v,k=v"
            )
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def _normalisation(mean, std, source_mean, source_std, channels: int, where: str):
    mean = tuple(source_mean) if mean is None else tuple(mean)
    std = tuple(source_std) if std is None else tuple(std)
    if len(mean) != channels or len(std) != channels:
        raise ValueError(
            f"the converted model has {channels} input channels but the normalisation has "
            f"mean={mean}, std={std} ({where}); pass --mean and --std with {channels} values"
        )
    if not all(s > 0 for s in std):
        raise ValueError(f"--std={','.join(map(str, std))}: expected positive values")
    return mean, std


def _from_timm(args) -> tuple[dict, dict, dict]:
    _torch_first.check()
    import timm
    import torch

    torch.manual_seed(args.seed)  # timm's random initialisation, when there is no checkpoint
    with errors.user_errors():  # the checkpoint, the overrides and the architecture are the user's
        model = timm_eva.create(args.model, args.checkpoint, **parse_overrides(args.overrides))
        cfg = timm_eva.model_config(model)
    params = timm_eva.convert_params(model)  # every check passed: an error here is a bug
    data = model.pretrained_cfg or {}
    with errors.user_errors():
        mean, std = _normalisation(
            args.mean,
            args.std,
            data.get("mean", timm_eva.IMAGENET_MEAN),
            data.get("std", timm_eva.IMAGENET_STD),
            cfg["channels"],
            f"timm {args.model}",
        )
    info = dict(
        versions=f"timm {timm.__version__}, torch {torch.__version__}",
        mean=mean,
        std=std,
        notes=timm_eva.notes(model),
    )
    return cfg, params, info


def _from_liere(args) -> tuple[dict, dict, dict]:
    _torch_first.check()
    import torch

    with errors.user_errors():  # --model's fields and the checkpoint's contents are the user's
        given = liere_reference.parse_spec(args.model) if args.checkpoint is None else None
        if args.checkpoint is None:
            model = liere_torch.reference_model(given, seed=args.seed)
            state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
            spec = given
        else:
            state = liere_reference.load_state_dict(args.checkpoint)
            fields = liere_reference.parse_fields(args.model)
            spec = liere_reference.infer_spec(state, channels=fields.pop("channels", 3))
            differ = {k: (v, getattr(spec, k)) for k, v in fields.items() if getattr(spec, k) != v}
            if differ:
                raise ValueError(
                    f"--model={args.model!r}: fields differ from the checkpoint's (given, read): "
                    f"{differ}"
                )
        params, notes = liere_reference.convert_state_dict(state, spec, args.liere_layers)
        cfg = liere_reference.model_config(spec, args.liere_layers)
        mean, std = _normalisation(
            args.mean,
            args.std,
            liere_reference.MEAN,
            liere_reference.STD,
            spec.channels,
            "the LieRE reference's",
        )
    info = dict(
        versions=f"torch {torch.__version__}",
        mean=mean,
        std=std,
        notes=notes,
        spec=dataclasses.asdict(spec),
        layers=args.liere_layers,
    )
    return cfg, params, info


def convert(args: argparse.Namespace) -> str:
    """Convert as the command line says; returns the workdir."""
    with errors.user_errors():  # what is cheap to check comes before PyTorch is imported
        if args.source not in SOURCES:
            raise ValueError(f"--from={args.source!r}; expected one of {SOURCES}")
        _check_workdir(args.workdir)
        _check_checkpoint(args.checkpoint, args.source)
        if args.source == "timm":
            timm_eva.check_name(args.model)
            parse_overrides(args.overrides)
        elif args.checkpoint is None:  # --model is the whole spec
            liere_reference.parse_spec(args.model)
        else:
            liere_reference.parse_fields(args.model)
    cfg, params, info = (_from_timm if args.source == "timm" else _from_liere)(args)
    mean, std = info.pop("mean"), info.pop("std")
    interop = dict(
        source=args.source,
        name=args.model,
        checkpoint=args.checkpoint or "none (random initialisation)",
        overrides=args.overrides,
        input="NHWC float32, (x / 255 - dataset.mean) / dataset.std per channel",
        **info,
    )
    config = workdir.converted_config(
        cfg,
        dataset=args.dataset or DEFAULT_DATASETS[args.source],
        mean=mean,
        std=std,
        interop=interop,
    )
    with errors.user_errors():  # a ViT the overrides make impossible (image size vs patch)
        workdir.abstract_model(config.model.to_dict())
    return workdir.save(args.workdir, config, params)


def _check_workdir(directory: str) -> None:
    """``--workdir`` must be a new or empty directory (checked before anything is converted)."""
    path = os.path.abspath(os.path.expanduser(directory))
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(
            f"--workdir={directory!r} is a file; expected a new or empty directory"
        )
    if os.path.isdir(path) and os.listdir(path):
        raise FileExistsError(
            f"--workdir={directory!r} is not empty; expected a new or empty directory (convert "
            "into a new one)"
        )


def _check_checkpoint(path: str | None, source: str) -> None:
    """``--checkpoint`` must be a readable file (or None: a random initialisation)."""
    if path is None:
        return
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"--checkpoint={path!r}: no such file; expected {CHECKPOINTS[source]}"
        )
    if not os.path.isfile(path):
        raise IsADirectoryError(
            f"--checkpoint={path!r} is not a file; expected {CHECKPOINTS[source]}"
        )
    if not os.access(path, os.R_OK):
        raise PermissionError(
            f"--checkpoint={path!r} cannot be read (permission denied); expected "
            f"{CHECKPOINTS[source]}"
        )


def _floats(text: str) -> tuple[float, ...]:
    """``"0.5,0.5,0.5"`` -> (0.5, 0.5, 0.5): finite numbers (``--mean``, ``--std``)."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of finite numbers; expected one per channel, e.g. 0.5,0.5,0.5"
        )
    return values


class _Parser(argparse.ArgumentParser):
    """argparse prints its usage and exits on a bad flag; here the error is raised as a user
    error (``errors.user_errors``), which ``cli`` prints as one line."""

    def error(self, message: str):
        with errors.user_errors():
            raise ValueError(f"{message} (python -m rope_lie.convert --help shows the flags)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m rope_lie.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--from", dest="source", required=True, choices=SOURCES)
    p.add_argument("--model", required=True, help="timm name, or LieRE reference fields")
    p.add_argument("--checkpoint", required=True, help="weights file, or 'none' (random init)")
    p.add_argument("--workdir", required=True, help="new directory for the converted model")
    p.add_argument("--overrides", default="", help="timm.create_model kwargs: k=v,k=v")
    p.add_argument("--dataset", default=None, help="TFDS name for the written config")
    p.add_argument("--mean", type=_floats, default=None, help="input mean per channel")
    p.add_argument("--std", type=_floats, default=None, help="input std per channel")
    p.add_argument("--liere_layers", default="as_run", choices=liere_reference.LAYERS)
    p.add_argument("--seed", type=int, default=0, help="torch seed of a random initialisation")
    return p


def main(argv: list[str] | None = None) -> str:
    """Convert as the command line ``argv`` (``sys.argv[1:]`` when None) says, printing the
    notes; returns the workdir. Errors raise (``cli`` is the command line's exit status)."""
    args = parser().parse_args(argv)
    if args.checkpoint.lower() == "none":
        args.checkpoint = None
    if args.source == "liere" and args.overrides:
        with errors.user_errors():
            raise ValueError(
                f"--overrides={args.overrides!r} is for --from=timm; give LieRE fields in --model"
            )
    directory = convert(args)
    config = workdir.read_config(directory)
    for note in config.interop.get("notes", []):
        print(f"note: {note}")
    print(f"Converted {args.source} {args.model} into {directory}")
    return directory


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def cli(argv: list[str] | None = None) -> int:
    """The command line: ``main``, with the user's errors (``errors.user_errors``) and a missing
    ``interop`` extra printed as one line ``error: <message>`` and exit status 2; any other
    error is a bug and keeps its traceback. Returns the exit status."""
    try:
        main(argv)
    except ModuleNotFoundError as e:  # torch or timm (imported when a conversion runs)
        message = _extras.missing_extra(e, "python -m rope_lie.convert", "interop")
        if message is None:
            raise
        return _fail(message)
    except errors.USER_ERROR_TYPES as e:
        if not errors.is_user_error(e):
            raise
        text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        return _fail(" ".join(line.strip() for line in text.splitlines() if line.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
