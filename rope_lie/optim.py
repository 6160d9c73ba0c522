"""Optimizer: Adam/AdamW with global-norm clipping, linear warmup + cosine decay.

Weight decay (AdamW, decoupled) applies to weights only, decided by each parameter's type
(models/variables.py), never by its name:

- a plain ``nnx.Param`` with two or more dims is a weight: decayed;
- a ``NoDecay`` is not: biases, class tokens, layer scales and the position-encoding
  parameters (``PositionParam``: rotary frequencies, LieRE generators, Cayley/circulant STRING
  parameters, ALiBi slopes, APE tables), whose decay pulls the rotations towards the identity,
  i.e. towards NoPE (RoPE-Mixed, arXiv:2403.13298, Sec. 3);
- nor is any parameter with fewer than 2 dims (flax's biases and norm scales; DeiT/timm).

The mask is derived from the nnx ``State`` (variable types and shapes) and returned as a pure
dict with the layout of ``nnx.to_pure_dict(state)``, the layout of the train state's params.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax
from flax import nnx
from flax.nnx import traversals

from rope_lie.models.variables import NoDecay

OPTIMIZERS = ("adam", "adamw")


def should_decay(variable: nnx.Variable) -> bool:
    """Whether one parameter gets weight decay: a plain ``nnx.Param`` (not ``NoDecay``) with two
    or more dims (see module docstring)."""
    if not isinstance(variable, nnx.Param) or isinstance(variable, NoDecay):
        return False
    return getattr(variable.get_value(), "ndim", 0) >= 2


def decay_mask(params: nnx.State) -> dict:
    """Pure dict of bools, True where weight decay applies, same layout as the params."""
    flat = {path: should_decay(var) for path, var in nnx.to_flat_state(params)}
    return traversals.unflatten_mapping(flat)


def learning_rate_schedule(optim_cfg: Mapping[str, Any], total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then cosine decay to `lr*end_lr_ratio`."""
    lr = float(optim_cfg["lr"])
    warmup = int(optim_cfg.get("warmup_steps", 0))
    end_value = lr * float(optim_cfg.get("end_lr_ratio", 0.0))
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1")
    if not 0 <= warmup < total_steps:
        raise ValueError(f"warmup_steps={warmup} must lie in [0, total_steps={total_steps})")
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else lr,
        peak_value=lr,
        warmup_steps=warmup,
        decay_steps=total_steps,
        end_value=end_value,
    )


def make_optimizer(
    optim_cfg: Mapping[str, Any], params: nnx.State, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer for `params` (an nnx State of Params) and its learning-rate schedule.

    Args:
      optim_cfg: name ('adam' | 'adamw'), lr, b1, b2, eps, weight_decay, grad_clip (global
        norm, 0 = off), warmup_steps, end_lr_ratio.
      params: the model's parameters as an nnx State (for the weight-decay mask).
      total_steps: length of the schedule.

    Returns:
      (optax transformation over the pure-dict params, schedule step -> learning rate).
    """
    name = optim_cfg["name"]
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name={name!r} is not one of {OPTIMIZERS}")
    weight_decay = float(optim_cfg.get("weight_decay", 0.0))
    if name == "adam" and weight_decay:
        raise ValueError(
            f"optim.name='adam' with weight_decay={weight_decay}: use 'adamw' for weight decay"
        )
    schedule = learning_rate_schedule(optim_cfg, total_steps)
    moments = dict(
        b1=float(optim_cfg["b1"]), b2=float(optim_cfg["b2"]), eps=float(optim_cfg["eps"])
    )
    if name == "adamw":
        core = optax.adamw(schedule, weight_decay=weight_decay, mask=decay_mask(params), **moments)
    else:
        core = optax.adam(schedule, **moments)
    grad_clip = float(optim_cfg.get("grad_clip", 0.0))
    chain = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
    return optax.chain(*chain, core), schedule
