"""The ViT's encoder block: pre-LN attention and MLP, with the options pretrained models need.

    x <- x + drop(ls1 * attn(LN1(x)))
    x <- x + ls2 * MLP(LN2(x)),    MLP(x) = drop(fc2(drop(GELU(fc1(x)))))

The defaults are this project's own ViT (no LayerScale, tanh-approximated GELU, LayerNorm
epsilon 1e-6). The options hold other codes' models exactly (``rope_lie/interop``):

- ``layer_scale``: DeiT-III's LayerScale (Touvron et al., arXiv:2204.07118, "LS"): learned
  per-channel gains ``ls1_D``, ``ls2_D`` on both residual branches, initialised to this value
  (timm's ``EvaBlock`` ``gamma_1``/``gamma_2``, ``init_values=1e-5`` in the naver RoPE ViTs);
- ``gelu_approximate=False``: the exact GELU x Phi(x) with erf (PyTorch's ``nn.GELU()``);
- ``norm_eps``: the LayerNorm epsilon (timm's ``LayerNorm`` 1e-6, PyTorch's ``nn.LayerNorm``
  1e-5 in the LieRE reference).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rope_lie.encodings.state import State
from rope_lie.models import attention
from rope_lie.models.variables import NoDecay


class MlpBlock(nnx.Module):
    """Dense(mlp_dim) -> GELU -> dropout -> Dense(width) -> dropout (the ViT MLP)."""

    def __init__(
        self,
        width: int,
        mlp_dim: int,
        *,
        dropout: float,
        dtype: Any,
        rngs: nnx.Rngs,
        gelu_approximate: bool = True,
    ):
        init = dict(
            kernel_init=attention.xavier_uniform(0, 1),
            bias_init=jax.nn.initializers.normal(1e-6),
            dtype=dtype,
            rngs=rngs,
        )
        self.fc1 = nnx.Linear(width, mlp_dim, **init)
        self.fc2 = nnx.Linear(mlp_dim, width, **init)
        self.dropout = nnx.Dropout(dropout, rngs=rngs if dropout > 0 else None)
        self.gelu_approximate = gelu_approximate

    def __call__(self, x_BTD: jax.Array, *, train: bool) -> jax.Array:
        h_BTE = jax.nn.gelu(self.fc1(x_BTD), approximate=self.gelu_approximate)
        h_BTE = self.dropout(h_BTE, deterministic=not train)
        return self.dropout(self.fc2(h_BTE), deterministic=not train)


def check_layer_scale(layer_scale: float | None) -> None:
    """``layer_scale`` must be None (off) or a finite number."""
    if layer_scale is None:
        return
    if isinstance(layer_scale, bool) or not isinstance(layer_scale, (int, float)):
        raise ValueError(f"layer_scale={layer_scale!r} must be None (off) or a number")
    if not math.isfinite(layer_scale):
        raise ValueError(f"layer_scale={layer_scale!r} must be finite")


class Block(nnx.Module):
    """Pre-LN encoder block (see the module docstring)."""

    def __init__(
        self,
        width: int,
        num_heads: int,
        mlp_dim: int,
        *,
        dropout: float,
        dtype: Any,
        rngs: nnx.Rngs,
        norm_eps: float = 1e-6,
        gelu_approximate: bool = True,
        layer_scale: float | None = None,
        **attention_kwargs: Any,
    ):
        check_layer_scale(layer_scale)
        self.ln1 = nnx.LayerNorm(width, epsilon=norm_eps, dtype=dtype, rngs=rngs)
        self.attn = attention.Attention(
            width, num_heads, dtype=dtype, rngs=rngs, **attention_kwargs
        )
        # Attention creates its (N, H) q/k/v biases as plain Params: two dims, so only their type
        # can say that they are biases (weight decay is decided by type, models/variables.py).
        for name in ("bq_NH", "bk_NH", "bv_NH"):
            bias = getattr(self.attn, name)
            if isinstance(bias, nnx.Param) and not isinstance(bias, NoDecay):
                setattr(self.attn, name, NoDecay(bias.get_value()))
        self.dropout = nnx.Dropout(dropout, rngs=rngs if dropout > 0 else None)
        self.ln2 = nnx.LayerNorm(width, epsilon=norm_eps, dtype=dtype, rngs=rngs)
        self.mlp = MlpBlock(
            width,
            mlp_dim,
            dropout=dropout,
            dtype=dtype,
            rngs=rngs,
            gelu_approximate=gelu_approximate,
        )
        self.ls1_D, self.ls2_D = nnx.data(None), nnx.data(None)  # data: Params with LayerScale
        if layer_scale is not None:
            self.ls1_D = NoDecay(jnp.full((width,), layer_scale, jnp.float32))
            self.ls2_D = NoDecay(jnp.full((width,), layer_scale, jnp.float32))

    def _scaled(self, y_BTD: jax.Array, ls_D: nnx.Param | None) -> jax.Array:
        return y_BTD if ls_D is None else y_BTD * ls_D[...].astype(y_BTD.dtype)[None, None]

    def __call__(
        self,
        x_BTD: jax.Array,
        pe_state: State,
        *,
        train: bool,
        key_mask_BS: jax.Array | None = None,
        segment_BS: jax.Array | None = None,
    ) -> jax.Array:
        y_BTD = self.attn(
            self.ln1(x_BTD), None, pe_state=pe_state, key_mask_BS=key_mask_BS, segment_BS=segment_BS
        )
        y_BTD = self._scaled(y_BTD, self.ls1_D)
        x_BTD = x_BTD + self.dropout(y_BTD, deterministic=not train)
        return x_BTD + self._scaled(self.mlp(self.ln2(x_BTD), train=train), self.ls2_D)
