"""Fashion-MNIST's four IDX files: where they are and how they are read (numpy, no TensorFlow).

Debian's ``dataset-fashion-mnist`` installs them (``train-images-idx3-ubyte.gz`` and the three
others, the very files TFDS's catalogue builder ``fashion_mnist`` downloads) under
``/usr/share/datasets/fashion-mnist/``; ``$ROPE_LIE_FASHION_MNIST_DIR`` points elsewhere. Both
input paths read them here: the TFDS builder ``rope_lie/data/fashion_mnist_idx.py`` and the
in-memory path ``rope_lie/in_memory.py`` (for machines without TensorFlow).
"""

import gzip
import os

import numpy as np

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
DIR_ENV = "ROPE_LIE_FASHION_MNIST_DIR"
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SIDE = 28
CLASS_NAMES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
_IDX_DTYPES = {0x08: np.uint8}  # the only element type Fashion-MNIST uses


def idx_dir() -> str:
    """Where the IDX files are read from: $ROPE_LIE_FASHION_MNIST_DIR, else Debian's path."""
    return os.environ.get(DIR_ENV) or DEFAULT_DIR


def _find(directory: str, stem: str) -> str:
    for name in (stem + ".gz", stem):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(
        f"Fashion-MNIST file {stem}(.gz) not found in {directory!r}. Install Debian's package "
        "with `apt-get update && apt-get install -y dataset-fashion-mnist` (it puts the four "
        f"IDX files under {DEFAULT_DIR}), or set {DIR_ENV} to a directory holding them."
    )


def read_idx(path: str) -> np.ndarray:
    """An IDX array (LeCun's MNIST format: magic 0 0 type ndim, big-endian int32 dims).

    Args:
      path: file, gzipped when it ends in ``.gz``.

    Returns:
      The array, shaped by the header's dimensions.

    Raises:
      ValueError: naming the file when the header or the size is not IDX uint8.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file of uint8 (header {data[:4].hex()})")
    ndim = data[3]
    dims = tuple(int(d) for d in np.frombuffer(data, ">i4", count=ndim, offset=4))
    body = np.frombuffer(data, _IDX_DTYPES[data[2]], offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise ValueError(
            f"{path}: header says {dims} ({int(np.prod(dims))} values), file has {body.size}"
        )
    return body.reshape(dims)


def load_split(split: str, directory: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels of one split.

    Returns:
      (uint8 (N, 28, 28), uint8 (N,)); raises ValueError if they disagree in N, shape or range.
    """
    directory = directory or idx_dir()
    images_path, labels_path = (_find(directory, stem) for stem in FILES[split])
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or images.shape[1:] != (SIDE, SIDE):
        raise ValueError(f"{images_path}: images shaped {images.shape}; expected (N, 28, 28)")
    if labels.shape != images.shape[:1]:
        raise ValueError(f"{labels_path}: {labels.shape[0]} labels for {images.shape[0]} images")
    if labels.size and labels.max() >= len(CLASS_NAMES):
        raise ValueError(f"{labels_path}: label {labels.max()} outside 0..9")
    return images, labels


def on_canvas(images_BHW: np.ndarray, canvas: int) -> np.ndarray:
    """Centres (N, 28, 28) images on a black canvas x canvas; returns uint8 (N, c, c)."""
    margin = (canvas - images_BHW.shape[1]) // 2
    return np.pad(images_BHW, ((0, 0), (margin, margin), (margin, margin)))
