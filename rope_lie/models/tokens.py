"""Token batches of mixed sizes: patches padded to a common length, with a mask (NaFlex-style).

A ``Tokens`` batch holds, per example, the patches of an image of its own grid (any size and
aspect ratio), flattened in token order and padded to a common length T:

  patches_BTC  float (B, T, C): patch t of example b (C = prod(patch) x channels, ``patchify``'s
               layout); padded slots hold anything (the model zeroes them)
  index_BTA    int32 (B, T, A): the token's integer coordinates in its example's grid
  grid_BA      int32 (B, A): tokens per axis of each example's grid
  mask_BT      bool or 0/1 (B, T): 1 for a real token, 0 for padding

The model computes every token's position from ``(index, grid)`` under its position
convention (``positions.index_positions``), so a token keeps its position whatever slot it
sits in: tokens may come in any order, and patch dropout (``patch_dropout``) keeps a subset.
Prefix (class) tokens are not in the batch; the model prepends them.

A ``Packed`` batch (NaViT, Dehghani et al., arXiv:2307.06304) holds several images per row,
each in its own segment, instead of one padded image per row:

  patches_BTC  float (B, T, C): the patches of the row's images one after the other, then
               padding (B rows)
  index_BTA    int32 (B, T, A): each token's coordinates in its own image's grid
  segment_BT   int32 (B, T): the token's image slot in its row, 1 to U; 0 for padding
  grid_BUA     int32 (B, U, A): the grid of each slot's image; 0 for an empty slot

The model gives every image its own prefix tokens and positions as if it were alone, keeps
attention within each segment and pools each image on its own (``ViT.classify_tokens``):
logits (B, U, V), one per slot. ``pack_rows`` packs images greedily (first-fit decreasing)
under a token budget per row and says where each image went.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rope_lie.encodings import _sharding, positions


class Tokens(NamedTuple):
    """A padded batch of token sequences (module docstring); a pytree of arrays."""

    patches_BTC: jax.Array
    index_BTA: jax.Array
    grid_BA: jax.Array
    mask_BT: jax.Array


class Packed(NamedTuple):
    """A packed batch: several images per row, each in its own segment (module docstring)."""

    patches_BTC: jax.Array
    index_BTA: jax.Array
    segment_BT: jax.Array
    grid_BUA: jax.Array


def token_grid(spatial: Sequence[int], patch: Sequence[int], what: str) -> tuple[int, ...]:
    """Tokens per axis, ``spatial // patch``, with an error naming both when not divisible."""
    spatial, patch = tuple(spatial), tuple(patch)
    if len(spatial) != len(patch) or any(s % p for s, p in zip(spatial, patch, strict=True)):
        raise ValueError(f"{what}={spatial} is not divisible by patch_size={patch}")
    return tuple(s // p for s, p in zip(spatial, patch, strict=True))


def patch_blocks(images_BXC, patch: Sequence[int]):
    """Split images into non-overlapping patches (tubelets in 3D), one block per grid cell.

    Works on numpy and jax arrays alike (only ``reshape`` and ``transpose``).

    Args:
      images_BXC: (B, *spatial, C), spatial divisible by ``patch``.
      patch: patch size per spatial axis.

    Returns:
      (B, *grid, *patch, C) with grid = spatial // patch: a patch's pixels on the trailing axes.
    """
    batch, *spatial, channels = images_BXC.shape
    grid = [s // p for s, p in zip(spatial, patch, strict=True)]
    split = [batch] + [d for g, p in zip(grid, patch, strict=True) for d in (g, p)] + [channels]
    rank = len(grid)
    order = [0, *range(1, 2 * rank, 2), *range(2, 2 * rank + 1, 2), 2 * rank + 1]
    return _sharding.reshape(images_BXC, tuple(split)).transpose(order)


def unpatch_blocks(blocks, patch: Sequence[int]):
    """The inverse of ``patch_blocks``: (B, *grid, *patch, C) -> (B, *spatial, C)."""
    rank = len(patch)
    batch, *grid = blocks.shape[: 1 + rank]
    order = [0] + [i for a in range(rank) for i in (1 + a, 1 + rank + a)] + [2 * rank + 1]
    spatial = [g * p for g, p in zip(grid, patch, strict=True)]
    return blocks.transpose(order).reshape(batch, *spatial, blocks.shape[-1])


def patchify(images_BXC: jax.Array, patch: Sequence[int]) -> jax.Array:
    """Non-overlapping patches (tubelets in 3D) flattened in token order.

    Args:
      images_BXC: (B, *spatial, C), spatial divisible by ``patch``.
      patch: patch size per spatial axis.

    Returns:
      (B, T, C') with T = prod(spatial // patch) row-major and C' = prod(patch) * C ordered
      (*patch, C), the layout of a flattened convolution kernel.
    """
    blocks = patch_blocks(images_BXC, patch)
    batch, num_tokens = blocks.shape[0], math.prod(blocks.shape[1 : 1 + len(patch)])
    return _sharding.reshape(blocks, (batch, num_tokens, math.prod(blocks.shape[1 + len(patch) :])))


def patchified(
    images: Sequence[np.ndarray], patch: Sequence[int]
) -> list[tuple[np.ndarray, np.ndarray, tuple[int, ...]]]:
    """Each image (*spatial, C) as (patches (T, C'), grid indices (T, A), grid), numpy; the
    patches in ``patchify``'s layout."""
    patch = tuple(patch)
    examples = []
    for image in images:
        image = np.asarray(image)
        grid = token_grid(image.shape[:-1], patch, "image spatial shape")
        patches = patch_blocks(image[None], patch).reshape(math.prod(grid), -1)
        examples.append((patches, positions.grid_indices(grid), grid))
    return examples


def pack(images: Sequence[np.ndarray], patch: Sequence[int], max_tokens: int) -> Tokens:
    """Images of different sizes as one padded ``Tokens`` batch (numpy).

    Args:
      images: arrays (*spatial, C), each spatial shape divisible by ``patch``.
      patch: patch size per spatial axis.
      max_tokens: the common length T; every image must have at most T patches.

    Returns:
      ``Tokens`` of numpy arrays; the mask is float32 0/1.
    """
    rows = patchified(images, patch)
    if any(len(r[0]) > max_tokens for r in rows):
        raise ValueError(
            f"max_tokens={max_tokens} < the {max(len(r[0]) for r in rows)} patches of an image"
        )
    return Tokens(
        *[np.stack(a) for a in zip(*[pad_one(*r, max_tokens) for r in rows], strict=True)]
    )


def pad_one(
    patches_TC: np.ndarray, index_TA: np.ndarray, grid: Sequence[int], max_tokens: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One example's (patches, index, grid, mask) padded with zeros to ``max_tokens`` tokens."""
    count = patches_TC.shape[0]
    if count > max_tokens:
        raise ValueError(f"{count} tokens exceed max_tokens={max_tokens}")
    pad = max_tokens - count
    return (
        np.pad(patches_TC, ((0, pad), (0, 0))).astype(np.float32),
        np.pad(index_TA, ((0, pad), (0, 0))).astype(np.int32),
        np.asarray(grid, np.int32),
        np.pad(np.ones(count, np.float32), (0, pad)),
    )


def from_patches(patches_BTC: jax.Array, grid: Sequence[int]) -> Tokens:
    """An unpadded ``Tokens`` batch of equally sized images' patches (``patchify``)."""
    batch = patches_BTC.shape[0]
    index_TA = jnp.asarray(positions.grid_indices(grid))
    return Tokens(
        patches_BTC,
        jnp.broadcast_to(index_TA, (batch, *index_TA.shape)),
        jnp.broadcast_to(jnp.asarray(grid, jnp.int32), (batch, len(grid))),
        jnp.ones(patches_BTC.shape[:2], jnp.float32),
    )


def patch_dropout(key: jax.Array, tokens: Tokens, num_keep: int) -> Tokens:
    """Keep ``num_keep`` slots per example: a uniformly random subset of its real tokens.

    Each kept token keeps its own patch, grid coordinates (so its position) and grid. An
    example with fewer real tokens than ``num_keep`` keeps all of them and fills the rest with
    padding (mask 0). Kept tokens stay in their original order.

    Args:
      key: PRNG key (one random subset per example).
      tokens: a ``Tokens`` batch of length T.
      num_keep: slots kept, in [1, T].

    Returns:
      ``Tokens`` of length ``num_keep``.
    """
    length = tokens.mask_BT.shape[1]
    if not 1 <= num_keep <= length:
        raise ValueError(f"num_keep={num_keep} must be in [1, {length}] (the token count)")
    real_BT = tokens.mask_BT > 0
    # Real tokens in random order first, then padding: keep the first num_keep.
    score_BT = jax.random.uniform(key, real_BT.shape) + jnp.where(real_BT, 0.0, 2.0)
    keep_BT = jnp.sort(jnp.argsort(score_BT, axis=1)[:, :num_keep], axis=1)
    take = lambda x: jnp.take_along_axis(x, keep_BT.reshape(*keep_BT.shape, *[1] * (x.ndim - 2)), 1)
    return Tokens(
        take(tokens.patches_BTC), take(tokens.index_BTA), tokens.grid_BA, take(tokens.mask_BT)
    )


def keep_count(length: int, rate: float) -> int:
    """Slots kept by patch dropout at ``rate`` (the fraction dropped) of ``length`` tokens."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"patch_dropout={rate} must be in [0, 1)")
    return max(1, int(round(length * (1.0 - rate))))


def assign_rows(counts: Sequence[int], max_tokens: int, max_images: int) -> tuple[np.ndarray, int]:
    """Greedy first-fit decreasing: each image to the first row with room for it.

    Images are taken from the most tokens to the fewest (ties in their order), each placed in
    the first row whose tokens would stay within ``max_tokens`` and that holds fewer than
    ``max_images`` images, else in a new row. Deterministic.

    Args:
      counts: tokens of each image, each in [1, max_tokens].
      max_tokens: the token budget of a row (its length T).
      max_images: U, the most images a row holds.

    Returns:
      (place_N2, rows): each image's (row, slot), slots in the order images were placed, and
      the number of rows used.
    """
    counts = [int(c) for c in counts]
    if max_images < 1:
        raise ValueError(f"max_images={max_images} must be >= 1")
    if any(not 1 <= c <= max_tokens for c in counts):
        raise ValueError(
            f"every image must have 1 to max_tokens={max_tokens} tokens; got {sorted(counts)[-1]}"
            f" (largest) and {sorted(counts)[0]} (smallest)"
        )
    used, images = [], []  # per row: tokens used, images placed
    place_N2 = np.zeros((len(counts), 2), np.int32)
    for n in sorted(range(len(counts)), key=lambda i: -counts[i]):
        row = next(
            (
                r
                for r in range(len(used))
                if used[r] + counts[n] <= max_tokens and images[r] < max_images
            ),
            len(used),
        )
        if row == len(used):
            used.append(0)
            images.append(0)
        place_N2[n] = (row, images[row])
        used[row] += counts[n]
        images[row] += 1
    return place_N2, len(used)


def pack_rows(
    examples: Sequence[tuple[np.ndarray, np.ndarray, Sequence[int]]],
    max_tokens: int,
    max_images: int,
    *,
    row_multiple: int = 1,
) -> tuple[Packed, np.ndarray]:
    """Images' tokens packed greedily into rows of ``max_tokens`` slots (numpy).

    Args:
      examples: per image (patches_TC, index_TA, grid): its tokens in ``patchify``'s order (any
        subset and order will do: each token carries its coordinates).
      max_tokens: T, the token budget of a row.
      max_images: U, the most images per row (the model gives each slot its prefix tokens).
      row_multiple: the row count is rounded up to a multiple of this (empty rows: padding),
        so that batches of similar size share a compiled step, and rows divide over devices.

    Returns:
      (``Packed`` of numpy arrays, place_N2): image n is slot ``place_N2[n, 1]`` of row
      ``place_N2[n, 0]``, so ``logits_BUV[place[:, 0], place[:, 1]]`` are the images' logits
      in the order given.
    """
    if row_multiple < 1:
        raise ValueError(f"row_multiple={row_multiple} must be >= 1")
    place_N2, rows = assign_rows([len(e[0]) for e in examples], max_tokens, max_images)
    rows = -(-rows // row_multiple) * row_multiple
    width, axes = examples[0][0].shape[-1], len(examples[0][2])
    patches = np.zeros((rows, max_tokens, width), np.float32)
    index = np.zeros((rows, max_tokens, axes), np.int32)
    segment = np.zeros((rows, max_tokens), np.int32)
    grid = np.zeros((rows, max_images, axes), np.int32)
    fill = np.zeros(rows, np.int64)
    # Slots were numbered in placement order; tokens go into each row in slot order.
    for n in np.lexsort((place_N2[:, 1], place_N2[:, 0])):
        (patches_TC, index_TA, image_grid), (row, slot) = examples[n], place_N2[n]
        start, count = fill[row], len(patches_TC)
        patches[row, start : start + count] = patches_TC
        index[row, start : start + count] = index_TA
        segment[row, start : start + count] = slot + 1
        grid[row, slot] = image_grid
        fill[row] += count
    return Packed(patches, index, segment, grid), place_N2


def pack_images(
    images: Sequence[np.ndarray],
    patch: Sequence[int],
    max_tokens: int,
    max_images: int,
    *,
    row_multiple: int = 1,
) -> tuple[Packed, np.ndarray]:
    """Images of different sizes (*spatial, C) patchified and packed (``pack_rows``)."""
    return pack_rows(patchified(images, patch), max_tokens, max_images, row_multiple=row_multiple)


def _concrete(*arrays) -> list[np.ndarray] | None:
    """The arrays as numpy, or None inside a trace (``jit``), where values are not known, and
    for arrays split over other processes, whose values this one does not hold."""
    for a in arrays:
        if isinstance(a, jax.core.Tracer) or (
            isinstance(a, jax.Array) and not a.is_fully_addressable
        ):
            return None
    return [np.asarray(a) for a in arrays]


def check_shapes(batch: Tokens | Packed, *, patch: Sequence[int], channels: int) -> None:
    """Raise, naming the field, where a token batch's arrays disagree with each other or with
    the model: patches of prod(patch) * channels values, A = len(patch) index axes, and one
    (B, T) shared by every per-token field. Shapes only: checked inside ``jit`` too."""
    batch_size, num_tokens, _ = batch.patches_BTC.shape
    rank = len(patch)
    expected = {
        "patches_BTC": (batch_size, num_tokens, math.prod(patch) * channels),
        "index_BTA": (batch_size, num_tokens, rank),
    }
    if isinstance(batch, Tokens):
        expected |= {"grid_BA": (batch_size, rank), "mask_BT": (batch_size, num_tokens)}
    else:
        slots = batch.grid_BUA.shape[1] if batch.grid_BUA.ndim > 1 else 0
        expected |= {"segment_BT": (batch_size, num_tokens), "grid_BUA": (batch_size, slots, rank)}
    for name, shape in expected.items():
        if tuple(getattr(batch, name).shape) != shape:
            raise ValueError(
                f"{type(batch).__name__}.{name} has shape {tuple(getattr(batch, name).shape)}; "
                f"expected {shape} (patches {tuple(patch)} of {channels} channels, B and T of "
                f"patches_BTC {(batch_size, num_tokens)})"
            )


def check_tokens(batch: Tokens) -> None:
    """Raise, naming the example, where a real token's index lies outside its example's grid
    or a real example's grid has a side below 1 (either moves tokens silently). Checked where
    the values are known: eager calls, not inside ``jit`` (the data pipeline builds valid ones).
    """
    arrays = _concrete(batch.index_BTA, batch.grid_BA, batch.mask_BT)
    if arrays is None:
        return
    index_BTA, grid_BA, mask_BT = arrays
    real_BT = mask_BT > 0
    for b in np.flatnonzero(real_BT.any(axis=1)):
        _check_in_grid(f"example {b}: grid_BA", grid_BA[b], index_BTA[b][real_BT[b]])


def check_packed(batch: Packed) -> None:
    """Raise, naming the row, where a segment id lies outside [0, U], a used slot's grid has a
    side below 1, or a token's index lies outside its slot's grid (each gives another image's
    logits silently). Checked where the values are known, as ``check_tokens``."""
    arrays = _concrete(batch.index_BTA, batch.segment_BT, batch.grid_BUA)
    if arrays is None:
        return
    index_BTA, segment_BT, grid_BUA = arrays
    slots = grid_BUA.shape[1]
    for b in range(segment_BT.shape[0]):
        used = np.unique(segment_BT[b])
        if used.min() < 0 or used.max() > slots:
            raise ValueError(
                f"row {b}: segment_BT holds {used.tolist()}; expected 0 (padding) to "
                f"U={slots} (grid_BUA's slots)"
            )
        for u in used[used > 0]:
            where = f"row {b}, segment {u}: grid_BUA"
            _check_in_grid(where, grid_BUA[b, u - 1], index_BTA[b][segment_BT[b] == u])


def _check_in_grid(where: str, grid_A: np.ndarray, index_TA: np.ndarray) -> None:
    """One image's grid has sides >= 1 and holds every index of its tokens."""
    if (grid_A < 1).any() or (index_TA < 0).any() or (index_TA >= grid_A).any():
        raise ValueError(
            f"{where}={grid_A.tolist()} and its tokens' index_BTA span "
            f"{index_TA.min(0).tolist()}..{index_TA.max(0).tolist()}; expected a grid of sides "
            ">= 1 and every index in [0, grid)"
        )


def slot_grids(batch: Packed) -> jax.Array:
    """Each token's image grid (B, T, A): its slot's, and 1 on every axis for padding (a
    finite grid for its unused position)."""
    slot_BT = jnp.maximum(batch.segment_BT - 1, 0)
    grid_BTA = jnp.take_along_axis(batch.grid_BUA, slot_BT[..., None], axis=1)
    return jnp.where(batch.segment_BT[..., None] > 0, jnp.maximum(grid_BTA, 1), 1)
