"""The mixed-size studies: arrows arms against the same arms trained on scenes of 6 to 10 cells
a side (each at its own size), and Fashion-MNIST arms against the same arms trained on NaFlex
batches (every image resized under a random token budget)."""

from __future__ import annotations

import dataclasses

from experiments.studies.definitions.arrows import (
    ALIBI,
    APE,
    ARROWS_EVALS,
    ARROWS_PAPER_EVALS,
    LIERE_B8,
    MIXED_HEO,
)
from experiments.studies.definitions.fashion import (
    F_ALIBI,
    F_APE,
    F_LIERE_B8,
    F_MIXED_HEO,
    FASHION_RESOLUTION_EVALS,
)
from experiments.studies.lib import Arm, Study


def _trained_with(base: Arm, flag: str, suffix: str, label: str) -> Arm:
    """The same arm with the recipe argument ``flag`` added at every scale."""
    paper_arg = None if base.paper_arg is None else f"{base.paper_arg},{flag}"
    return dataclasses.replace(
        base,
        name=f"{base.name}_{suffix}",
        label=f"{base.label}, {label}",
        arg=f"{base.arg},{flag}",
        paper_arg=paper_arg,
    )


def _mixed_grids(base: Arm) -> Arm:
    """Trained on scenes of 6 to 10 cells a side, each at its own size (arrows'
    ``mixed_grids``: unresized, so the cells stay the patches)."""
    return _trained_with(base, "mixed_grids", "mixed", "mixed grids 6-10")


def _naflex(base: Arm) -> Arm:
    """Trained on NaFlex batches (the recipe's ``naflex``: resized under random budgets).
    Evaluated at fixed sizes only, as the fixed arm is: the recipe's NaFlex evaluations repeat
    those grids through the token path (``naflex_evals=false`` saves ~6 minutes a run)."""
    return _trained_with(base, "naflex,naflex_evals=false", "naflex", "mixed sizes (NaFlex)")


_NAFLEX_ARROWS = (LIERE_B8, MIXED_HEO, APE, ALIBI)
NAFLEX_STUDY = Study(
    name="naflex",
    title="Spatial arrows trained on mixed grid sizes (6-10 cells a side, unresized) vs fixed 8x8",
    arms=tuple(arm for base in _NAFLEX_ARROWS for arm in (base, _mixed_grids(base))),
    # Evaluations both kinds of run make: larger grids of the same cells, and the training
    # grid's scenes at more pixels.
    evals=(*ARROWS_EVALS, "px080", "px096", "px128"),
    comparisons=tuple((f"{base.name}_mixed", base.name) for base in _NAFLEX_ARROWS),
    paper_scale=dict(evals=ARROWS_PAPER_EVALS),  # res=paper: larger grids only
)
_NAFLEX_FASHION = (F_LIERE_B8, F_MIXED_HEO, F_APE, F_ALIBI)
FASHION_NAFLEX_STUDY = Study(
    name="fashion_naflex",
    title="Fashion-MNIST trained on mixed sizes (5-9 patches a side, NaFlex) vs fixed 28 px",
    arms=tuple(arm for base in _NAFLEX_FASHION for arm in (base, _naflex(base))),
    evals=FASHION_RESOLUTION_EVALS,
    comparisons=tuple((f"{base.name}_naflex", base.name) for base in _NAFLEX_FASHION),
)
