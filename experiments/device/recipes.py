"""The encoders' recipes: what each timed step is.

``ENCODERS`` names the encoders (each by its ``configs/imagenet.py`` argument) in the order the
stages take them. Their models and optimisers are read from ``experiments/device_recipes.json``
(``read_recipes``), which ``--write-recipes`` writes from ``configs/imagenet.py``
(``recipes_from_configs``, which needs ml_collections), so that the device image needs no
ml_collections; ``run_config`` is the config of one timed step, a ``Config`` with the attribute
access that rope_lie's training functions use.
"""

from __future__ import annotations

import json
import os
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = os.path.join(ROOT, "experiments", "device_recipes.json")

# label: the configs/imagenet.py argument; in this order (most wanted first) the stages compile,
# time and search when their time is short.
ENCODERS = {
    "rope_mixed": "pe=rope_mixed",
    "liere": "pe=liere,block=8",  # LieRE 8x8
    "nope": "pe=nope",
    "alibi": "pe=alibi",
    "liere_dense": "pe=liere",  # block_size None: one H x H generator (64 x 64 at ViT-B)
    "rope_axial": "pe=rope_axial",
    "visionllama": "pe=visionllama",
    "cayley_string": "pe=cayley_string",
    "circulant_string": "pe=circulant_string",
    "comrope": "pe=comrope",
    "dinov3": "pe=dinov3",
    "ape": "pe=ape",
}


class Config(dict):
    """A recipe read from JSON, with the attribute access and ``to_dict`` that
    ``train.create_setup_and_state`` and ``train.build_model`` use (no ml_collections)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(name) from e

    def to_dict(self) -> dict:
        return {k: v.to_dict() if isinstance(v, Config) else v for k, v in self.items()}


def _from_json(value: Any) -> Any:
    """JSON to what the recipes hold: dicts as ``Config``, lists as tuples."""
    if isinstance(value, dict):
        return Config({k: _from_json(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_from_json(v) for v in value)
    return value


def recipes_from_configs() -> dict:
    """Every encoder's model and optimiser from configs/imagenet.py (needs ml_collections)."""
    from configs import imagenet

    encoders = {}
    for label, arg in ENCODERS.items():
        config = imagenet.get_config(arg)
        model = config.model.to_dict()
        if label == "liere_dense":
            model["pe_hparams"] = dict(model["pe_hparams"], block_size=None)
        encoders[label] = {"arg": arg, "model": model, "optim": config.optim.to_dict()}
    return {
        "source": "configs/imagenet.py; regenerate with python -m experiments.device "
        "--write-recipes",
        "fsdp_min_size": imagenet.get_config().fsdp_min_size,
        "encoders": json.loads(json.dumps(encoders)),  # tuples as lists, as read back
    }


def read_recipes(path: str = RECIPES) -> dict:
    with open(path) as f:
        return json.load(f)


def run_config(recipes: dict, encoder: str, attention: str, overrides: dict) -> Config:
    """The config of one timed step: the recipe's model with this backend, dropout 0 (the
    timing is of the model, not of dropout's random bits) and ``overrides``, on one device."""
    recipe = recipes["encoders"][encoder]
    model = dict(recipe["model"], attention=attention, dropout=0.0, **overrides)
    return _from_json(
        {
            "model": model,
            "optim": recipe["optim"],
            "fsdp_min_size": recipes["fsdp_min_size"],
            "mesh": {"data": 1, "fsdp": 1},
        }
    )
