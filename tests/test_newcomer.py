"""Issue 8's library-level items: seed pages optional, one error base, pixel limits, a fast offline hub.

The command-line side of the same items is in test_cli_errors.py; safe writes in test_output.py.
"""

from __future__ import annotations

import httpx2
import huggingface_hub
import pytest
import torch
from huggingface_hub.utils import _http as hf_http
from PIL import Image

import seeds
from kestrel.errors import KestrelError
from kestrel.kernels.settings import SettingError
from kestrel.pipelines.images import ImageError, ImagePreprocess, load_image

# ----------------------------------------------------------------------------------------- seed pages


def test_missing_seed_pages_skip_with_the_path(tmp_path, monkeypatch):
    monkeypatch.setattr(seeds, "SEEDS", tmp_path / "shared" / "seeds")
    monkeypatch.delenv("KESTREL_REQUIRE_SEEDS", raising=False)
    with pytest.raises(pytest.skip.Exception, match=f"seed pages not found: {tmp_path / 'shared' / 'seeds'} does"):
        seeds.read_seed("003")


def test_missing_seed_pages_fail_when_required(tmp_path, monkeypatch):
    monkeypatch.setattr(seeds, "SEEDS", tmp_path)  # the folder exists, the page does not
    monkeypatch.setenv("KESTREL_REQUIRE_SEEDS", "1")
    with pytest.raises(pytest.fail.Exception, match=r"003_\*\.txt does not exist.*KESTREL_REQUIRE_SEEDS is set"):
        seeds.read_seed("003")


def test_ci_requires_the_seeds_and_runs_the_readme_command():
    from pathlib import Path

    script = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text().splitlines()
    commands = [line.strip() for line in script if line.strip() and not line.lstrip().startswith("#")]
    assert "export KESTREL_REQUIRE_SEEDS=1" in commands and commands[-1] == "make test"


# ------------------------------------------------------------------------------------ one error base


def test_every_user_error_class_is_a_kestrel_error():
    from kestrel.blocks import BindError, DeclarationError, EntryError
    from kestrel.checker.symbolic import ShapeError
    from kestrel.export.onnx import ExportError
    from kestrel.inspect.diagram import DiagramError
    from kestrel.models.cards import CardError
    from kestrel.pipelines.tokenizer import TokenizerError
    from kestrel.runtime.checkpoint import CheckpointError
    from kestrel.runtime.hub import HubError
    from kestrel.shapes.parse import DimParseError

    for cls in (BindError, DeclarationError, EntryError, ShapeError, ExportError, DiagramError, CardError,
                TokenizerError, CheckpointError, HubError, DimParseError, ImageError):
        assert issubclass(cls, KestrelError), cls
    assert issubclass(CardError, ValueError) and issubclass(EntryError, TypeError)  # old bases kept


def test_an_unsupported_tensor_dtype_names_the_entry_and_input():
    from transformers import ViTConfig

    from kestrel import from_config
    from kestrel.blocks import EntryError

    vit = from_config(ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                image_size=16, patch_size=8).to_dict())
    with pytest.raises(EntryError) as info:
        vit.forward(torch.zeros(1, 3, 16, 16, dtype=torch.uint8))
    assert str(info.value).startswith("vit::Model.forward: input image has shape (1, 3, 16, 16) and dtype "
                                      "torch.uint8, which no declared type can have; declared Tensor[")
    assert "x.float()" in str(info.value)


# ------------------------------------------------------------------------------------------- pixels

DINO_LIKE = ImagePreprocess(resize=None, shortest_edge=256, crop=(224, 224), resample="bicubic", rescale=1 / 255,
                            mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))


def test_an_extreme_aspect_ratio_is_refused_before_resizing(tmp_path, monkeypatch):
    strip = tmp_path / "strip.png"
    Image.new("RGB", (100_000, 1)).save(strip)
    with pytest.raises(ImageError) as info:
        DINO_LIKE(strip)
    assert str(info.value) == (
        f"cannot read image {strip}: its 100000 x 1 pixels would resize (shorter side to 256) to 25600000 x 256 "
        "= 6,553,600,000 pixels (width x height), above the limit of 67,108,864; set KESTREL_MAX_PIXELS to "
        "allow more")
    tall = Image.new("RGB", (1, 300))  # the same for a PIL image, and for the other orientation
    monkeypatch.setenv("KESTREL_MAX_PIXELS", "1000000")
    with pytest.raises(ImageError, match=r"<PIL image>: its 1 x 300 pixels would resize .* to 256 x 76800 = "):
        DINO_LIKE.pixels(tall)


def test_decoded_pixels_are_bounded_from_the_header(tmp_path, monkeypatch):
    big = tmp_path / "big.png"
    Image.new("RGB", (300, 200)).save(big)
    monkeypatch.setenv("KESTREL_MAX_PIXELS", "50000")
    with pytest.raises(ImageError, match=r"big.png: the image has 300 x 200 = 60,000 pixels .* limit of 50,000"):
        load_image(big)
    monkeypatch.setenv("KESTREL_MAX_PIXELS", "60000")
    assert load_image(big).size == (300, 200)
    monkeypatch.setenv("KESTREL_MAX_PIXELS", "lots")
    with pytest.raises(SettingError, match="KESTREL_MAX_PIXELS must be a positive integer, got 'lots'"):
        load_image(big)


def test_ordinary_images_are_untouched_by_the_limits(tmp_path):
    photo = tmp_path / "photo.png"
    Image.new("RGB", (640, 480), (10, 20, 30)).save(photo)
    assert tuple(DINO_LIKE(photo).shape) == (1, 3, 224, 224)


# ---------------------------------------------------------------------------------------------- hub

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def transport(monkeypatch, tmp_path):
    """Online mode against an in-process transport that records requests; nothing leaves the process."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    calls: list[str] = []
    behaviour = {"fail": True}

    def handler(request: httpx2.Request) -> httpx2.Response:
        calls.append(f"{request.method} {request.url.path}")
        if behaviour["fail"]:
            raise httpx2.ConnectError("Network is unreachable", request=request)
        return httpx2.Response(404, text="no")

    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(handler)))
    yield calls, behaviour
    huggingface_hub.set_client_factory(hf_http.default_client_factory)


def test_an_unreachable_hub_costs_one_request_not_a_retry_loop(transport, tmp_path):
    from kestrel.runtime.hub import HubError, fetch

    calls, _ = transport
    with pytest.raises(HubError) as info:
        fetch("someone/model", COMMIT, ["config.json"], cache_dir=tmp_path / "cache")
    assert calls == ["HEAD /api/models"]
    assert "the Hub could not be reached" in str(info.value) and "(one try, 5 s timeout)" in str(info.value)


def test_a_cached_pinned_commit_needs_no_network(transport, tmp_path):
    from kestrel.runtime.hub import fetch
    from test_hub import make_cached_repo

    calls, _ = transport
    snapshot = make_cached_repo(tmp_path / "cache", "someone/model", COMMIT, {"config.json": b"{}"})
    assert fetch("someone/model", COMMIT, ["config.json"], cache_dir=tmp_path / "cache") == snapshot
    assert calls == []
