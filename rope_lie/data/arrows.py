"""What the 2D and 3D spatial-arrows builders share: seeded chunks of layouts, TFDS splits.

Generation is deterministic: chunk k of split s (0 train, 1 test) is drawn from
``np.random.default_rng([seed, s, k])``, so the two splits use different streams and the same
config always gives the same bytes; example i of a split is example i % chunk_size of chunk
i // chunk_size.
"""

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from tqdm import tqdm

from rope_lie.data import glyphs

SPLIT_IDS = {"train": 0, "test": 1}


def check_split_sizes(config: Any) -> None:
    """Raise unless ``config.num_train`` and ``config.num_test`` are >= 1."""
    for field in ("num_train", "num_test"):
        if getattr(config, field) < 1:
            raise ValueError(f"{field}={getattr(config, field)} must be >= 1 ({config.name})")


def chunk_rng(config: Any, split: str, chunk: int, *stream: int | str) -> np.random.Generator:
    """The generator of chunk ``chunk`` of ``split``; ``stream`` names a sub-stream (a mixed-size
    config draws its grid sizes and each grid's layouts from separate ones)."""
    if split not in SPLIT_IDS:
        raise ValueError(f"split={split!r}; expected one of {sorted(SPLIT_IDS)}")
    words = [s if isinstance(s, int) else int.from_bytes(s.encode(), "little") for s in stream]
    return np.random.default_rng([config.seed, SPLIT_IDS[split], chunk, *words])


def sample_chunk(
    config: Any,
    split: str,
    chunk: int,
    *,
    chunk_size: int,
    grid_shape: tuple[int, ...],
    deltas: np.ndarray,
    letter_ids: np.ndarray,
    stream: tuple[int | str, ...] = (),
) -> dict[str, np.ndarray]:
    """The layouts of one chunk of a split (``glyphs.sample_layouts`` output).

    Args:
      config: the builder config (its ``seed``, ``num_distractor_arrows``, ``num_letters``).
      split: "train" or "test".
      chunk: chunk index; examples [chunk * chunk_size, (chunk + 1) * chunk_size).
      chunk_size: examples per chunk (part of the determinism contract of each dataset).
      grid_shape: cells per axis.
      deltas: (directions, axes) cell step of each direction.
      letter_ids: glyph ids of the distractor letters or shapes.
      stream: a sub-stream of the chunk's generator (``chunk_rng``); () is the chunk's own.

    Returns:
      ``glyphs.sample_layouts``'s dict for ``chunk_size`` examples.
    """
    return glyphs.sample_layouts(
        chunk_rng(config, split, chunk, *stream),
        chunk_size,
        grid_shape=grid_shape,
        deltas=deltas,
        num_distractor_arrows=config.num_distractor_arrows,
        letter_ids=letter_ids,
        num_letters=config.num_letters,
    )


class ChunkedSplits:
    """TFDS ``_split_generators``/``_generate_examples`` for a builder whose examples come in
    chunks: mix in before ``tfds.core.GeneratorBasedBuilder`` and set

    - ``chunk_size``: examples per chunk;
    - ``generate_chunk(config, split, chunk) -> {feature: (chunk_size, ...) array}``;
    - optionally ``encode_example(example) -> example`` (e.g. PNG bytes for an image).
    """

    chunk_size: int
    generate_chunk: Callable[[Any, str, int], dict[str, np.ndarray]]

    @staticmethod
    def encode_example(example: dict[str, Any]) -> dict[str, Any]:
        return example

    def _split_generators(self, dl_manager):
        del dl_manager  # generated locally, nothing to download
        cfg = self.builder_config
        return {
            "train": self._generate_examples("train", cfg.num_train),
            "test": self._generate_examples("test", cfg.num_test),
        }

    def _generate_examples(self, split: str, num_examples: int) -> Iterator[tuple[int, dict]]:
        size, desc = self.chunk_size, f"{self.name}/{self.builder_config.name} {split}"
        with tqdm(total=num_examples, desc=desc, unit="ex", leave=False, mininterval=1) as bar:
            for chunk in range(-(-num_examples // size)):
                data = type(self).generate_chunk(self.builder_config, split, chunk)
                for i in range(min(size, num_examples - chunk * size)):
                    yield chunk * size + i, self.encode_example({k: v[i] for k, v in data.items()})
                bar.update(min(size, num_examples - chunk * size))
