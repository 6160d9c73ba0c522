"""The studies: arms, reported evaluations and the papers' numbers (experiments/studies/README.md).

Arms name their variant plainly: "RoPE-Mixed (Heo et al.)" is rope-vit's RoPE-Mixed on patch
indices; "RoPE-Mixed = LieRE b2 (LieRE paper)" is what the LieRE paper's tables call RoPE-Mixed
(LieRE with 2x2 blocks, LieRE's init and [0, 1] positions); "VisionLlama (LieRE paper)" is the
LieRE reference code's fixed tiled rotation, "VisionLLaMA AS2D" the VisionLLaMA paper's.

CPU scale runs ``configs/arrows.py`` at ``res=cpu`` (ViT-mu/8, 500 steps of 128 on 20,000
layouts of an 8x8 grid of 8 px cells, 6-7 minutes a run on the 2-core AMD EPYC: arrows/README.md).
``--scale paper`` runs the paper's own experiment for each study: arrows at ``res=paper``
(ViT-B/12, 800,000 layouts, the paper's optimiser) for ``arrows`` and ``resolution``;
``configs/cifar100.py`` (ViT-B, the LieRE paper's CIFAR-100 recipe) for ``block_size``,
``sharing``, ``init`` and ``data_fraction``, whose tables are CIFAR-100's; ``configs/ucf101.py``
for ``volumes`` and ``configs/cayley.py`` (MNIST) for ``cayley``. Each study's ``paper_scale``
names the evaluations those recipes make.

One module per domain: `arrows` (the arrows studies, with their CIFAR-100 paper scale),
`cayley` (sklearn digits / MNIST), `volumes`, `fashion` (Fashion-MNIST) and `naflex` (mixed
sizes); `common` holds what several share. `STUDIES` lists them all, in this order.
"""

from __future__ import annotations

from experiments.studies.definitions import arrows, cayley, fashion, naflex, volumes
from experiments.studies.lib import Study

STUDIES: dict[str, Study] = {
    study.name: study
    for study in (
        arrows.ARROWS_STUDY,
        arrows.BLOCK_SIZE_STUDY,
        arrows.SHARING_STUDY,
        arrows.INIT_STUDY,
        arrows.DATA_FRACTION_STUDY,
        arrows.RESOLUTION_STUDY,
        cayley.CAYLEY_STUDY,
        volumes.VOLUMES_STUDY,
        volumes.VOLUMES_LONG_STUDY,
        fashion.FASHION_STUDY,
        fashion.FASHION_RESOLUTION_STUDY,
        fashion.FASHION_EXTRAPOLATION_STUDY,
        fashion.FASHION_DATA_FRACTION_STUDY,
        fashion.CAYLEY_FASHION_STUDY,
        naflex.NAFLEX_STUDY,
        naflex.FASHION_NAFLEX_STUDY,
    )
}
