"""kestrel.pipelines.images against the transformers image processors it reproduces.

The references are built with ``AutoImageProcessor`` from the checkpoints' real ``preprocessor_config.json``
contents. Without torchvision transformers falls back to the PIL-backend classes (``*ImageProcessorPil``),
and those are what we match.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from kestrel.pipelines.images import (
    ImageError,
    ImagePreprocess,
    load_image,
    preprocess_batches,
    shortest_edge_size,
)

transformers = pytest.importorskip("transformers")

VIT = {  # google/vit-base-patch16-224
    "do_normalize": True,
    "do_resize": True,
    "feature_extractor_type": "ViTFeatureExtractor",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 2,
    "size": 224,
}
DINOV2 = {  # facebook/dinov2-base
    "crop_size": {"height": 224, "width": 224},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.485, 0.456, 0.406],
    "image_processor_type": "BitImageProcessor",
    "image_std": [0.229, 0.224, 0.225],
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 256},
}
SIGLIP = {  # google/siglip-base-patch16-224
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "SiglipImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "SiglipProcessor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"height": 224, "width": 224},
}
CONFIGS = {"vit": VIT, "dinov2": DINOV2, "siglip": SIGLIP}
REFERENCE_CLASS = {
    "vit": "ViTImageProcessorPil",
    "dinov2": "BitImageProcessorPil",
    "siglip": "SiglipImageProcessorPil",
}
TOL = 1e-5


def reference(cfg: dict, tmp_path: Path):
    """The transformers processor that ``AutoImageProcessor`` builds for ``cfg``."""
    folder = tmp_path / "reference"
    folder.mkdir(exist_ok=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(cfg))
    return transformers.AutoImageProcessor.from_pretrained(folder)


def run_reference(processor, images, **kwargs) -> torch.Tensor:
    return processor(images, return_tensors="pt", **kwargs)["pixel_values"]


def max_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape
    assert ours.dtype == torch.float32
    return (ours - ref.float()).abs().max().item()


def random_rgb(rng: np.random.Generator, height: int, width: int) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def rgb_images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    sizes = [(37, 53), (300, 200), (224, 224), (480, 640), (17, 400), (257, 256)]
    return [random_rgb(rng, h, w) for h, w in sizes]


def other_mode_images() -> list[Image.Image]:
    """RGBA with varied alpha, grayscale, grey+alpha, and a palette image with a transparent index."""
    rng = np.random.default_rng(1)
    rgba = Image.fromarray(rng.integers(0, 256, (60, 90, 4), dtype=np.uint8), "RGBA")
    gray = Image.fromarray(rng.integers(0, 256, (90, 61), dtype=np.uint8), "L")
    gray_alpha = Image.fromarray(rng.integers(0, 256, (45, 70, 2), dtype=np.uint8), "LA")
    palette = random_rgb(rng, 50, 40).quantize(16)
    palette.info["transparency"] = 3
    return [rgba, gray, gray_alpha, palette]


@pytest.mark.parametrize("name", CONFIGS)
def test_reference_falls_back_to_pil_backend(name, tmp_path):
    assert type(reference(CONFIGS[name], tmp_path)).__name__ == REFERENCE_CLASS[name]


def test_from_config_reads_the_checkpoints():
    assert ImagePreprocess.from_config(VIT) == ImagePreprocess(
        (224, 224), None, None, "bilinear", 1 / 255, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    )
    assert ImagePreprocess.from_config(DINOV2) == ImagePreprocess(
        None, 256, (224, 224), "bicubic", 1 / 255, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    )
    assert ImagePreprocess.from_config(SIGLIP) == ImagePreprocess(
        (224, 224), None, None, "bicubic", 1 / 255, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    )


@pytest.mark.parametrize("name", CONFIGS)
def test_rgb_images_match_reference(name, tmp_path):
    ref, ours = reference(CONFIGS[name], tmp_path), ImagePreprocess.from_config(CONFIGS[name])
    images = rgb_images()
    assert max_diff(ours(images), run_reference(ref, images)) <= TOL
    for image in images:
        assert max_diff(ours(image), run_reference(ref, image)) <= TOL


@pytest.mark.parametrize("name", CONFIGS)
def test_other_modes_match_reference_rgb_conversion(name, tmp_path):
    # ViT's processor does not convert to RGB and rejects these; with do_convert_rgb it does what BiT and
    # SigLIP do by default: composite transparency onto white.
    ref, ours = reference(CONFIGS[name], tmp_path), ImagePreprocess.from_config(CONFIGS[name])
    images = other_mode_images()
    assert max_diff(ours(images), run_reference(ref, images, do_convert_rgb=True)) <= TOL


@pytest.mark.parametrize("name", CONFIGS)
def test_paths_match_reference(name, tmp_path):
    rng = np.random.default_rng(2)
    rgba, gray, _, palette = other_mode_images()
    upright = random_rgb(rng, 64, 96)
    exif = upright.getexif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to display
    files = {"rgba.png": rgba, "gray.png": gray, "rgb.jpg": upright, "palette.png": palette}
    paths = []
    for filename, image in files.items():
        path = tmp_path / filename
        image.save(path, exif=exif) if filename.endswith(".jpg") else image.save(path)
        paths.append(path)
    if name == "vit":  # ViT keeps the loader's RGB as it is, ignoring a palette's transparent index
        paths.remove(tmp_path / "palette.png")

    ref, ours = reference(CONFIGS[name], tmp_path), ImagePreprocess.from_config(CONFIGS[name])
    assert load_image(tmp_path / "rgb.jpg").size == (64, 96)  # EXIF orientation applied
    assert max_diff(ours(paths), run_reference(ref, [str(p) for p in paths])) <= TOL
    assert max_diff(ours([load_image(p) for p in paths]), ours(paths)) == 0
    assert torch.equal(ours(iter(paths)), ours(tuple(paths)))  # any iterable is a batch


@pytest.mark.parametrize("code", range(6))
def test_every_pil_filter_matches_reference(code, tmp_path):
    cfg = {**VIT, "resample": code, "size": {"height": 40, "width": 72}}
    ref, ours = reference(cfg, tmp_path), ImagePreprocess.from_config(cfg)
    images = rgb_images()
    assert max_diff(ours(images), run_reference(ref, images)) <= TOL


def test_with_size_dinov2_at_518(tmp_path):
    ref = reference(DINOV2, tmp_path)
    ours = ImagePreprocess.from_config(DINOV2).with_size(518, 518)
    assert ours.output_size == (518, 518) and ours.shortest_edge == 518
    images = rgb_images()
    expected = run_reference(
        ref, images, size={"shortest_edge": 518}, crop_size={"height": 518, "width": 518}
    )
    assert max_diff(ours(images), expected) <= TOL


def test_with_size_non_square(tmp_path):
    images = rgb_images()
    dino = ImagePreprocess.from_config(DINOV2).with_size(224, 448)
    assert (dino.shortest_edge, dino.crop) == (448, (224, 448))
    expected = run_reference(
        reference(DINOV2, tmp_path),
        images,
        size={"shortest_edge": 448},
        crop_size={"height": 224, "width": 448},
    )
    assert max_diff(dino(images), expected) <= TOL
    for image in images:  # the resized image covers the crop, so nothing is zero-padded
        height, width = shortest_edge_size(image.height, image.width, dino.shortest_edge)
        assert height >= 224 and width >= 448

    siglip = ImagePreprocess.from_config(SIGLIP).with_size(160, 320)
    assert siglip.output_size == (160, 320)
    expected = run_reference(reference(SIGLIP, tmp_path), images, size={"height": 160, "width": 320})
    assert max_diff(siglip(images), expected) <= TOL


@pytest.mark.parametrize(
    "changes",
    [
        {"size": {"shortest_edge": 20}, "crop_size": {"height": 32, "width": 24}},  # crop larger: zero pad
        {"do_resize": False, "crop_size": {"height": 40, "width": 41}},  # pad one side, crop the other
        {"size": {"shortest_edge": 33}, "crop_size": {"height": 31, "width": 30}},  # odd sizes
    ],
)
def test_center_crop_and_padding_match_reference(changes, tmp_path):
    cfg = {**DINOV2, **changes}
    rng = np.random.default_rng(3)
    images = [random_rgb(rng, 40, 30), random_rgb(rng, 25, 50), random_rgb(rng, 31, 31)]
    ref, ours = reference(cfg, tmp_path), ImagePreprocess.from_config(cfg)
    for image in images:
        assert max_diff(ours(image), run_reference(ref, image)) <= TOL


def test_rescale_and_normalize_off_match_reference(tmp_path):
    images = rgb_images()
    for changes in (
        {"do_rescale": False},
        {"do_normalize": False},
        {"do_rescale": False, "do_normalize": False},
    ):
        cfg = {**SIGLIP, **changes}
        ours = ImagePreprocess.from_config(cfg)(images)
        assert max_diff(ours, run_reference(reference(cfg, tmp_path), images)) <= TOL


def test_int_sizes_follow_the_processor():
    siglip_int = ImagePreprocess.from_config({**SIGLIP, "size": 224})
    assert (siglip_int.resize, siglip_int.shortest_edge) == (None, 224)
    bit_int = ImagePreprocess.from_config({**DINOV2, "size": 256, "crop_size": 224})
    assert (bit_int.shortest_edge, bit_int.crop) == (256, (224, 224))
    vit_defaults = ImagePreprocess.from_config({"image_processor_type": "ViTImageProcessor"})
    assert vit_defaults == ImagePreprocess.from_config(VIT)


@pytest.mark.parametrize(
    "cfg",
    [
        {**SIGLIP, "size": 224},
        {**DINOV2, "size": 256, "crop_size": 224},
        {"image_processor_type": "ViTImageProcessor"},
        {"image_processor_type": "BitImageProcessorFast"},
    ],
)
def test_defaults_and_int_sizes_match_reference(cfg, tmp_path):
    ref, ours = reference(cfg, tmp_path), ImagePreprocess.from_config(cfg)
    for image in rgb_images():
        assert max_diff(ours(image), run_reference(ref, image)) <= TOL


def test_from_file(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(DINOV2))
    expected = ImagePreprocess.from_config(DINOV2)
    assert ImagePreprocess.from_file(tmp_path) == expected
    assert ImagePreprocess.from_file(tmp_path / "preprocessor_config.json") == expected


def test_unsupported_configs_are_rejected():
    with pytest.raises(ValueError, match="do_pad"):
        ImagePreprocess.from_config({**VIT, "do_pad": True})
    with pytest.raises(ValueError, match="size"):
        ImagePreprocess.from_config({**VIT, "size": {"longest_edge": 224}})
    with pytest.raises(ValueError, match="resample"):
        ImagePreprocess.from_config({**VIT, "resample": 9})
    with pytest.raises(ValueError, match="at most one"):
        ImagePreprocess((224, 224), 224, None, "bilinear", 1 / 255, (0.5,) * 3, (0.5,) * 3)


def test_output_size_and_mixed_sizes():
    pre = ImagePreprocess(None, 64, None, "bicubic", 1 / 255, (0.5,) * 3, (0.5,) * 3)
    with pytest.raises(ValueError, match="depends on the image"):
        _ = pre.output_size
    images = rgb_images()
    assert pre(images[0]).shape == (1, 3, 64, 91)  # 37x53: 64 * 53 / 37 = 91.68, truncated
    with pytest.raises(ValueError, match="different sizes"):
        pre(images)
    with pytest.raises(TypeError, match="path or a PIL image"):
        pre([np.zeros((4, 4, 3), dtype=np.uint8)])


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jpg"
    with pytest.raises(ImageError, match="no such image file") as info:
        load_image(path)
    assert str(path) in str(info.value) and info.value.path == str(path)
    pre = ImagePreprocess.from_config(VIT)
    with pytest.raises(ImageError, match=r"nope\.jpg"):
        pre(path)


def test_corrupt_files(tmp_path):
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"this is not an image")
    with pytest.raises(ImageError, match="not a recognised image format") as info:
        load_image(garbage)
    assert isinstance(info.value, ValueError) and str(garbage) in str(info.value)

    truncated = tmp_path / "truncated.png"
    rgb_images()[3].save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:2000])
    with pytest.raises(ImageError, match=r"truncated\.png"):
        load_image(truncated)

    with pytest.raises(ImageError, match="a folder, not an image file"):
        load_image(tmp_path)


def test_preprocess_batches(tmp_path):
    paths = []
    for i, image in enumerate(rgb_images()[:5]):
        paths.append(tmp_path / f"{i}.png")
        image.save(paths[-1])
    pre = ImagePreprocess.from_config(DINOV2)
    batches = list(preprocess_batches(paths, pre, batch_size=2))
    assert [len(batch_paths) for batch_paths, _ in batches] == [2, 2, 1]
    assert [p for batch_paths, _ in batches for p in batch_paths] == paths
    assert torch.equal(torch.cat([pixels for _, pixels in batches]), pre(paths))
    assert batches[0][1].shape == (2, 3, 224, 224)
    with pytest.raises(ValueError, match="batch_size"):
        next(preprocess_batches(paths, pre, batch_size=0))
