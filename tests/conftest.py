"""Session-wide test settings and the fixtures several test modules share."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_kestrel_cache(tmp_path_factory: pytest.TempPathFactory):
    """Calibrations and downloads measured by the tests go to a temporary folder, never the user's cache
    (and the user's cached choices never steer a test). A folder given in KESTREL_CACHE_DIR is kept."""
    if "KESTREL_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["KESTREL_CACHE_DIR"] = str(tmp_path_factory.mktemp("kestrel-cache"))
    try:
        yield
    finally:
        os.environ.pop("KESTREL_CACHE_DIR", None)


@pytest.fixture(scope="session")
def sam2_small(tmp_path_factory: pytest.TempPathFactory):
    """A small SAM 2.1 checkpoint (Hiera-tiny's layout at small widths, seeded random weights) saved by
    transformers: ``(reference Sam2Model, directory)``."""
    from reference import seeded_sam2, small_config

    ref = seeded_sam2(small_config(1024))
    path = tmp_path_factory.mktemp("sam2-small")
    ref.save_pretrained(path)
    return ref, path
