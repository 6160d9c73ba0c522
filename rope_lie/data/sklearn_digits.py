"""`sklearn_digits`: the 8x8 handwritten digits shipped inside scikit-learn, as TFDS.

``sklearn.datasets.load_digits`` (1,797 images of 8x8 pixels with values
0..16, 10 classes; the UCI optical-recognition test set) needs no download.
Pixels are mapped to uint8 by round(v * 255 / 16) and upsampled to
``image_size`` with PIL (``resize_method``: "bilinear" or "nearest").

Splits: a fixed, stratified 80/20 split by
``sklearn.model_selection.train_test_split(test_size=0.2, random_state=0,
stratify=labels)``: 1,437 train and 360 test examples. ``index`` is the
example's row in ``load_digits``, so the splits can be audited.

Configs: ``size8`` (native), ``size16`` and ``size32`` (bilinear).
"""

import dataclasses

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

SPLIT_SEED = 0  # random_state of the fixed train/test split
TEST_FRACTION = 0.2
RESIZE_METHODS = {"bilinear": Image.Resampling.BILINEAR, "nearest": Image.Resampling.NEAREST}


@dataclasses.dataclass(eq=False)
class SklearnDigitsConfig(tfds.core.BuilderConfig):
    """A sklearn_digits variant.

    Attributes:
      image_size: output side in pixels (>= 8).
      resize_method: "bilinear" or "nearest" (PIL), used when image_size != 8.
    """

    image_size: int = 8
    resize_method: str = "bilinear"

    def __post_init__(self):
        if self.image_size < 8:
            raise ValueError(f"image_size={self.image_size} must be >= 8 ({self.name})")
        if self.resize_method not in RESIZE_METHODS:
            raise ValueError(
                f"resize_method={self.resize_method!r}; expected one of {sorted(RESIZE_METHODS)}"
            )


CONFIGS = tuple(
    SklearnDigitsConfig(name=f"size{s}", description=f"{s}x{s} pixels", image_size=s)
    for s in (8, 16, 32)
)


def split_indices() -> dict[str, np.ndarray]:
    """Rows of ``load_digits`` in each split (sorted).

    Returns:
      {"train": int64 (1437,), "test": int64 (360,)}.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    labels = load_digits().target
    train, test = train_test_split(
        np.arange(len(labels)),
        test_size=TEST_FRACTION,
        random_state=SPLIT_SEED,
        stratify=labels,
    )
    return {"train": np.sort(train), "test": np.sort(test)}


def to_uint8(images_N88: np.ndarray, image_size: int, resize_method: str) -> np.ndarray:
    """Maps 0..16 digit images to uint8 and resizes them.

    Args:
      images_N88: float (N, 8, 8) values in [0, 16].
      image_size: output side S.
      resize_method: key of RESIZE_METHODS.

    Returns:
      uint8 (N, S, S, 1).
    """
    images = np.round(images_N88 * (255.0 / 16.0)).astype(np.uint8)
    if image_size != images.shape[1]:
        method = RESIZE_METHODS[resize_method]
        images = np.stack(
            [
                np.asarray(Image.fromarray(im).resize((image_size, image_size), method))
                for im in images
            ]
        )
    return images[..., None]


class SklearnDigits(tfds.core.GeneratorBasedBuilder):
    """scikit-learn's 8x8 handwritten digits with a fixed stratified 80/20 split."""

    name = "sklearn_digits"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    # Nothing is downloaded, so there is no checksums file beside the code for TFDS to find
    # (its lookup would also need the importlib_resources package).
    code_path = None
    BUILDER_CONFIGS = list(CONFIGS)
    DEFAULT_CONFIG_NAME = "size8"

    def _info(self) -> tfds.core.DatasetInfo:
        s = self.builder_config.image_size
        return self.dataset_info_from_configs(
            description=__doc__,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(s, s, 1), encoding_format="png"),
                    "label": tfds.features.ClassLabel(num_classes=10),
                    "index": tfds.features.Scalar(dtype=np.int64),
                }
            ),
            supervised_keys=("image", "label"),
            homepage="https://scikit-learn.org/stable/datasets/toy_dataset.html",
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # the data ships with scikit-learn
        return {name: self._generate_examples(idx) for name, idx in split_indices().items()}

    def _generate_examples(self, indices: np.ndarray):
        from sklearn.datasets import load_digits

        digits = load_digits()
        cfg = self.builder_config
        images = to_uint8(digits.images[indices], cfg.image_size, cfg.resize_method)
        for i, index in enumerate(indices):
            yield (
                int(index),
                {
                    "image": images[i],
                    "label": int(digits.target[index]),
                    "index": int(index),
                },
            )
