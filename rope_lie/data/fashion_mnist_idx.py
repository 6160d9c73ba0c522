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

import numpy as np
import tensorflow_datasets as tfds

# The files and their reading need no TensorFlow (the in-memory input path reads them too).
from rope_lie.fashion_mnist_files import (  # noqa: F401  (re-exported)
    CLASS_NAMES,
    DEFAULT_DIR,
    DIR_ENV,
    FILES,
    SIDE,
    _find,
    idx_dir,
    load_split,
    on_canvas,
    read_idx,
)


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
