"""`fashion_mnist_idx`: Fashion-MNIST built from its four IDX files on disk, as TFDS.

Fashion-MNIST (Xiao et al., arXiv:1708.07747): 60,000 training and 10,000 test grayscale
photos of clothing, 28x28 pixels, 10 balanced classes. Debian's ``dataset-fashion-mnist``
installs its IDX files (``train-images-idx3-ubyte.gz`` and the three others, the very files
TFDS's catalogue builder ``fashion_mnist`` downloads) under
``/usr/share/datasets/fashion-mnist/``:

    apt-get update && apt-get install -y dataset-fashion-mnist

The directory is ``$ROPE_LIE_FASHION_MNIST_DIR`` when set, else that path. The files may be
gzipped (``.gz``, as Debian ships them) or not.

Why a builder of ours rather than TFDS's ``fashion_mnist`` fed the local files: TFDS's builder
takes its files from the download manager by URL, and pointing it at files on disk means
pre-filling the download cache under the URL-derived names and checksums of one TFDS version.
This builder reads the same files directly and yields the same features (``image`` uint8
(28, 28, 1), ``label`` with the class names) and splits (``train``, ``test``), in file order.

Configs:
  ``plain``: the images as they are (both splits).
  ``canvas36``, ``canvas44``, ``canvas56``: the test images centred on a larger black
  canvas (the background of Fashion-MNIST is 0): the objects keep their size in pixels and
  the model sees more tokens, the regime of LieRE's larger grids. Test split only.
"""

import dataclasses
import gzip
import os

import numpy as np
import tensorflow_datasets as tfds

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
DIR_ENV = "ROPE_LIE_FASHION_MNIST_DIR"
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
SIDE = 28
CLASS_NAMES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
_IDX_DTYPES = {0x08: np.uint8}  # the only element type Fashion-MNIST uses


@dataclasses.dataclass(eq=False)
class FashionMnistIdxConfig(tfds.core.BuilderConfig):
    """A fashion_mnist_idx variant.

    Attributes:
      canvas: side of the black canvas the 28x28 image is centred on (28: none).
      splits: the splits this variant holds.
    """

    canvas: int = SIDE
    splits: tuple[str, ...] = ("train", "test")

    def __post_init__(self):
        if self.canvas < SIDE or (self.canvas - SIDE) % 2:
            raise ValueError(
                f"canvas={self.canvas}; expected an even margin around 28 px (28, 30, 32, ...)"
            )


CONFIGS = (
    FashionMnistIdxConfig(name="plain", description="28x28 images, train and test"),
    *(
        FashionMnistIdxConfig(
            name=f"canvas{c}",
            description=f"test images centred on a {c}x{c} black canvas",
            canvas=c,
            splits=("test",),
        )
        for c in (36, 44, 56)
    ),
)


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
        raise ValueError(f"{path}: header says {dims} ({int(np.prod(dims))} values), file has "
                         f"{body.size}")  # fmt: skip
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


def on_canvas(images_NHW: np.ndarray, canvas: int) -> np.ndarray:
    """Centres (N, 28, 28) images on a black canvas x canvas; returns uint8 (N, c, c)."""
    margin = (canvas - images_NHW.shape[1]) // 2
    return np.pad(images_NHW, ((0, 0), (margin, margin), (margin, margin)))


class FashionMnistIdx(tfds.core.GeneratorBasedBuilder):
    """Fashion-MNIST from its IDX files (Debian's dataset-fashion-mnist)."""

    name = "fashion_mnist_idx"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    code_path = None  # nothing is downloaded: no checksums file (see sklearn_digits)
    BUILDER_CONFIGS = list(CONFIGS)
    DEFAULT_CONFIG_NAME = "plain"

    def _info(self) -> tfds.core.DatasetInfo:
        c = self.builder_config.canvas
        return self.dataset_info_from_configs(
            description=__doc__,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(c, c, 1), encoding_format="png"),
                    "label": tfds.features.ClassLabel(names=CLASS_NAMES),
                    "index": tfds.features.Scalar(dtype=np.int64),
                }
            ),
            supervised_keys=("image", "label"),
            homepage="https://github.com/zalandoresearch/fashion-mnist",
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # the files are on disk
        directory = idx_dir()
        for split in self.builder_config.splits:  # fail before generating anything
            for stem in FILES[split]:
                _find(directory, stem)
        return {s: self._generate_examples(s, directory) for s in self.builder_config.splits}

    def _generate_examples(self, split: str, directory: str):
        images, labels = load_split(split, directory)
        images = on_canvas(images, self.builder_config.canvas)
        for i in range(len(labels)):
            yield i, {"image": images[i, :, :, None], "label": int(labels[i]), "index": i}
