"""The Cayley-STRING generators study on sklearn digits (MNIST at ``--scale paper``).

Its Fashion-MNIST counterpart, on the paper's MNIST recipe, is `fashion.CAYLEY_FASHION_STUDY`.
"""

from __future__ import annotations

from experiments.studies.lib import Arm, Study


def _cayley(name: str, label: str, arg: str) -> Arm:
    # CPU: sklearn digits with the study's ViT; paper scale: the study's recipe on MNIST.
    paper_arg = "dataset=mnist," + arg.replace("pe=cayley_string,", "")
    return Arm(
        name,
        label,
        "digits",
        f"{arg},variant=string",
        paper_arg=paper_arg,
        paper_recipe="cayley",
    )


CAYLEY_STUDY = Study(
    name="cayley",
    title="Sparse Cayley-STRING generators on sklearn digits (the study's H = 12 ViT)",
    arms=(
        _cayley("dense", "Cayley-STRING dense", "pe=cayley_string,generator=dense"),
        _cayley(
            "block2x2", "Cayley-STRING 2x2 (closed form)", "pe=cayley_string,generator=block2x2"
        ),
        _cayley("banded", "Cayley-STRING banded (bw 2)", "pe=cayley_string,generator=banded,bw=2"),
        _cayley(
            "topk",
            "Cayley-STRING top-k (k 24, init N(0, 0.02))",
            "pe=cayley_string,generator=topk,k=24",
        ),
        _cayley("rope_mixed", "RoPE-Mixed (no P)", "pe=rope_mixed"),
    ),
    evals=("size8", "size16", "size8_shuffled"),
    # Study Table 1 (MNIST best accuracy 0.9595-0.9681 for all generators; CIFAR-10
    # 0.7299-0.7374): all about equal. Digits is our stand-in (no downloads here).
    comparisons=(("dense", "block2x2"), ("dense", "topk"), ("dense", "rope_mixed")),
    paper_scale=dict(evals=("test",)),  # configs/cayley.py: the 10,000 MNIST test images
)
