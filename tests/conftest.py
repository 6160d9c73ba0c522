"""Shared test fixtures.

The repository root goes on sys.path so tests can import the recipes in configs/ (they import
``configs.common``), as ``python -m rope_lie.main`` does when run from the root.

Multi-device tests do not change XLA_FLAGS here: they start a subprocess with 8 simulated CPU
devices (see tests/test_sharding.py), so this session keeps one device.
"""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory):
    """A TFDS data_dir shared by the session; local builders are generated into it on first use."""
    return str(tmp_path_factory.mktemp("tensorflow_datasets"))
