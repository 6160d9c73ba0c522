"""The PyTorch half of tests/test_interop.py, run as ``python tests/interop_torch_side.py OUT``.

A separate process because PyTorch's triton crashes a process that has already loaded
TensorFlow (``rope_lie/interop/_torch_first.py``), which the test session has. It builds the
small PyTorch models (timm's own ``Eva``, naver RoPE ViTs and DINOv3, and the LieRE reference
re-implementation), saves their weights as checkpoint files, converts them with
``python -m rope_lie.convert``'s ``main`` into ``OUT/<case>``, and writes what PyTorch computes
(``OUT/<case>.npz``: images NCHW and logits at each side) and the conversion errors it meets
(``OUT/errors.json``).
torch is imported inside the functions: the test extra alone must import every test file
(tests/test_dependencies.py).
"""

import json
import os
import sys

import numpy as np

from rope_lie import convert  # no TensorFlow: torch can still be imported after it
from rope_lie.interop import checks, liere_reference, liere_torch, timm_eva

TINY_TIMM = dict(embed_dim=64, depth=2, num_heads=2, img_size=32, patch_size=8, num_classes=10)
TIMM_CASES = {  # case: timm name
    "rope_axial": "vit_small_patch16_rope_224",
    "rope_mixed": "vit_small_patch16_rope_mixed_224",
    "rope_mixed_ape": "vit_small_patch16_rope_mixed_ape_224",
}
# DINOv3 (4 registers, centred coordinates, half-split pairs), with q/k/v biases or without,
# pooling the class token as upstream DINOv3 (timm's default for them is "avg"); attention
# sharpened (checks.scale_weights) so that a wrong position moves the logits by ~1.
DINOV3_CASES = {
    "dinov3": "vit_small_patch16_dinov3",
    "dinov3_qkvb": "vit_small_patch16_dinov3_qkvb",
}
DINOV3_KW = dict(TINY_TIMM, global_pool="token")
# timm's "avg" pooling (the patch tokens' mean beside the class token): DINOv3's timm default
# (its final norm before pooling, no fc_norm), the same with timm's fc_norm instead of the final
# norm, and a naver RoPE-Mixed ViT with global_pool="avg" (timm then turns fc_norm on): case:
# (timm name, create_model keyword arguments)
AVG_CASES = {
    "dinov3_avg": ("vit_small_patch16_dinov3", TINY_TIMM),
    "dinov3_avg_fc_norm": ("vit_small_patch16_dinov3_qkvb", dict(TINY_TIMM, use_fc_norm=True)),
    "rope_mixed_avg": (
        "vit_small_patch16_rope_mixed_224",
        dict(TINY_TIMM, global_pool="avg", dynamic_img_size=True),
    ),
    "rope_axial_avg_no_class_token": (
        "vit_small_patch16_rope_224",
        dict(TINY_TIMM, global_pool="avg", class_token=False, dynamic_img_size=True),
    ),
}
GAINS = dict(attention_gain=8.0, embed_gain=4.0)
LIERE_CASES = {  # case: (block size b, per_layer, per_head)
    "liere_dense_per_layer_head": (64, True, True),
    "liere_8x8_per_layer_head": (8, True, True),
    "liere_dense_shared": (64, False, False),
    "liere_8x8_shared": (8, False, False),
}
LIERE_SPEC = dict(
    image_size=16, patch_size=4, num_classes=10, dim=128, depth=2, heads=2, mlp_dim=256
)


def _overrides(kw: dict) -> str:
    return "--overrides=" + ",".join(f"{k}={v}" for k, v in kw.items())


def _logits(model, sides, channels=3, seed=0, head=None) -> dict[str, np.ndarray]:
    """Images and the model's logits at each side; with ``head`` (the classifier module), also
    what enters it (``features_<side>``: a randomly initialised head's logits are ~1e-3)."""
    import torch

    out, features = {}, []
    if head is not None:
        head.register_forward_hook(lambda module, args, output: features.append(args[0]))
    for side in sides:
        images = np.random.RandomState(seed + side).randn(2, channels, side, side)
        out[f"images_{side}"] = images.astype(np.float32)
        with torch.no_grad():
            out[f"logits_{side}"] = model(torch.from_numpy(out[f"images_{side}"])).numpy()
        if head is not None:
            out[f"features_{side}"] = features.pop().numpy()
    return out


def _intermediates(model, images: dict[str, np.ndarray], sides) -> dict[str, np.ndarray]:
    """timm's ``forward_intermediates`` of every block on the images of ``_logits``, normed
    and not: ``patch_<norm>_<side>`` (L, B, T, D) and ``prefix_<norm>_<side>`` (L, B, P, D)."""
    import torch

    out = {}
    for side in sides:
        for norm in (0, 1):
            with torch.no_grad():
                pairs = model.forward_intermediates(
                    torch.from_numpy(images[f"images_{side}"]),
                    indices=None,
                    norm=bool(norm),
                    output_fmt="NLC",
                    return_prefix_tokens=True,
                    intermediates_only=True,
                )
            out[f"patch_{norm}_{side}"] = np.stack([p.numpy() for p, _ in pairs])
            out[f"prefix_{norm}_{side}"] = np.stack([q.numpy() for _, q in pairs])
    return out


def _timm(out: str) -> None:
    import torch

    for case, name in TIMM_CASES.items():
        torch.manual_seed(0)
        model = timm_eva.create(name, dynamic_img_size=True, **TINY_TIMM)
        checks.scale_weights(model, seed=0)
        path = os.path.join(out, f"{case}.pth")
        torch.save(model.state_dict(), path)
        convert.main(
            [
                "--from=timm",
                f"--model={name}",
                f"--checkpoint={path}",
                f"--workdir={out}/{case}",
                _overrides(TINY_TIMM),
            ]
        )
        np.savez(os.path.join(out, f"{case}.npz"), **_logits(model, (32, 48)))
    # A fine-tuned checkpoint (10 classes) converted without saying its class count: timm's
    # default head has 1000, the converter reads 10 from the checkpoint.
    no_head = {k: v for k, v in TINY_TIMM.items() if k != "num_classes"}
    convert.main(
        [
            "--from=timm",
            f"--model={TIMM_CASES['rope_mixed']}",
            f"--checkpoint={out}/rope_mixed.pth",
            f"--workdir={out}/rope_mixed_head_read",
            _overrides(no_head),
        ]
    )
    # --checkpoint=none (timm's random initialisation under --seed), for the fine-tuning test:
    # 1 channel, 4 classes (spatial_arrows), 32 px
    kw = {**TINY_TIMM, "in_chans": 1, "num_classes": 4}
    convert.main(
        [
            "--from=timm",
            "--model=vit_small_patch16_rope_mixed_224",
            "--checkpoint=none",
            f"--workdir={out}/arrows_source",
            "--mean=0.5",
            "--std=0.5",
            "--seed=3",
            _overrides(kw),
        ]
    )
    torch.manual_seed(3)
    model = timm_eva.create("vit_small_patch16_rope_mixed_224", **kw)
    np.savez(
        os.path.join(out, "arrows_source.npz"), **_logits(model, (32,), channels=1, head=model.head)
    )


def _dinov3(out: str) -> None:
    import torch

    for case, name in DINOV3_CASES.items():
        torch.manual_seed(0)
        model = timm_eva.create(name, **DINOV3_KW)
        checks.scale_weights(model, seed=0, **GAINS)
        path = os.path.join(out, f"{case}.pth")
        torch.save(model.state_dict(), path)
        convert.main(
            [
                "--from=timm",
                f"--model={name}",
                f"--checkpoint={path}",
                f"--workdir={out}/{case}",
                _overrides(DINOV3_KW),
            ]
        )
        computed = _logits(model, (32, 48))
        computed.update(_intermediates(model, computed, (32, 48)))
        np.savez(os.path.join(out, f"{case}.npz"), **computed)
    for case, (name, kw) in AVG_CASES.items():
        torch.manual_seed(2)
        model = timm_eva.create(name, **kw)
        checks.scale_weights(model, seed=2, **GAINS)
        path = os.path.join(out, f"{case}.pth")
        torch.save(model.state_dict(), path)
        convert.main(
            [
                "--from=timm",
                f"--model={name}",
                f"--checkpoint={path}",
                f"--workdir={out}/{case}",
                _overrides(kw),
            ]
        )
        np.savez(os.path.join(out, f"{case}.npz"), **_logits(model, (32, 48), seed=2))
    # DINOv3's pretrained weights have no classifier (num_classes=0): converted without a class
    # count, the head is the identity and the logits are the pooled features.
    headless = {k: v for k, v in DINOV3_KW.items() if k != "num_classes"}
    torch.manual_seed(1)
    model = timm_eva.create(DINOV3_CASES["dinov3"], **headless, num_classes=0)
    checks.scale_weights(model, seed=1, **GAINS)
    path = os.path.join(out, "dinov3_headless.pth")
    torch.save(model.state_dict(), path)
    convert.main(
        [
            "--from=timm",
            f"--model={DINOV3_CASES['dinov3']}",
            f"--checkpoint={path}",
            f"--workdir={out}/dinov3_headless",
            _overrides(headless),
        ]
    )
    np.savez(os.path.join(out, "dinov3_headless.npz"), **_logits(model, (32, 48), seed=1))
    # A pretrained tag selects its own input normalisation (the satellite weights' statistics).
    convert.main(
        [
            "--from=timm",
            "--model=vit_large_patch16_dinov3.sat493m",
            "--checkpoint=none",
            f"--workdir={out}/dinov3_sat493m",
            _overrides(DINOV3_KW),
        ]
    )


def _liere(out: str) -> None:
    import torch

    for case, (b, per_layer, per_head) in LIERE_CASES.items():
        spec = liere_reference.ReferenceSpec(
            **LIERE_SPEC, generator_dim=b, per_layer=per_layer, per_head=per_head
        )
        model = liere_torch.reference_model(spec, seed=1)
        checks.scale_weights(model, seed=1)
        path = os.path.join(out, f"{case}.ckpt")  # the Lightning layout: state_dict + the rest
        torch.save({"epoch": 3, "global_step": 100, "state_dict": model.state_dict()}, path)
        convert.main(
            [
                "--from=liere",
                "--model=channels=3",
                f"--checkpoint={path}",
                f"--workdir={out}/{case}",
            ]
        )
        if per_layer and b == 8:  # the stored per-layer generators, not what the reference runs
            stored = f"--workdir={out}/{case}_as_stored"
            convert.main(
                [
                    "--from=liere",
                    f"--checkpoint={path}",
                    "--model=",
                    "--liere_layers=as_stored",
                    stored,
                ]
            )
        np.savez(os.path.join(out, f"{case}.npz"), **_logits(model, (16, 24)))
    # --checkpoint=none: the re-implementation's random initialisation, spec given in --model
    fields = ",".join(f"{k}={v}" for k, v in LIERE_SPEC.items())
    convert.main(
        [
            "--from=liere",
            f"--model={fields},generator_dim=8,per_head=1",
            "--checkpoint=none",
            "--seed=5",
            f"--workdir={out}/liere_random",
        ]
    )
    spec = liere_reference.ReferenceSpec(**LIERE_SPEC, generator_dim=8, per_head=True)
    model = liere_torch.reference_model(spec, seed=5)
    head = model.model.mlp_head[1]
    np.savez(os.path.join(out, "liere_random.npz"), **_logits(model, (16,), head=head))


def _errors(out: str) -> dict[str, str]:
    import torch

    errors = {}

    def record(case, fn):
        try:
            fn()
        except (ValueError, FileExistsError) as e:
            errors[case] = f"{type(e).__name__}: {e}"

    state = torch.load(os.path.join(out, "rope_axial.pth"))
    state["blocks.0.attn.extra"] = torch.zeros(1)
    del state["norm.bias"]
    torch.save(state, os.path.join(out, "bad.pth"))
    bad = os.path.join(out, "bad.pth")
    record("bad_keys", lambda: timm_eva.create("vit_small_patch16_rope_224", bad, **TINY_TIMM))
    record("name", lambda: timm_eva.check_name("vit_small_patch16_224"))
    mixed = os.path.join(out, "rope_mixed.pth")
    record(
        "head_differs",
        lambda: timm_eva.create(TIMM_CASES["rope_mixed"], mixed, **{**TINY_TIMM, "num_classes": 7}),
    )
    record(
        "width_differs",
        lambda: timm_eva.create(TIMM_CASES["rope_mixed"], mixed, **{**TINY_TIMM, "embed_dim": 32}),
    )
    max_pool = timm_eva.create("vit_small_patch16_rope_224", global_pool="max", **TINY_TIMM)
    record("max_pool", lambda: timm_eva.model_config(max_pool))
    no_token = dict(TINY_TIMM, global_pool="max", class_token=False)
    max_without_one = timm_eva.create("vit_small_patch16_rope_224", **no_token)
    record("max_pool_without_a_class_token", lambda: timm_eva.model_config(max_without_one))
    both_eps = timm_eva.create(DINOV3_CASES["dinov3"], use_fc_norm=True, **TINY_TIMM)
    both_eps.fc_norm.eps = 1e-6  # the blocks' 1e-5: rope_lie's ViT has one epsilon
    record("fc_norm_eps", lambda: timm_eva.model_config(both_eps))
    record("dinov3_swiglu", lambda: timm_eva.check_name("vit_small_plus_patch16_dinov3"))
    record(
        "not_empty",
        lambda: convert.main(
            [
                "--from=timm",
                "--model=vit_small_patch16_rope_224",
                "--checkpoint=none",
                f"--workdir={out}/rope_axial",
                _overrides(TINY_TIMM),
            ]
        ),
    )
    record(
        "spec_differs",
        lambda: convert.main(
            [
                "--from=liere",
                "--model=depth=3",
                f"--checkpoint={out}/liere_8x8_shared.ckpt",
                f"--workdir={out}/never",
            ]
        ),
    )
    return errors


if __name__ == "__main__":
    out = sys.argv[1]
    _timm(out)
    _dinov3(out)
    _liere(out)
    with open(os.path.join(out, "errors.json"), "w") as f:
        json.dump(_errors(out), f, indent=1)
