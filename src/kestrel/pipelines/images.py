"""Image preprocessing that reproduces Hugging Face image processors pixel for pixel.

Without torchvision, transformers 5 builds the PIL-backend processors (``ViTImageProcessorPil``,
``BitImageProcessorPil``, ``SiglipImageProcessorPil``) from a ``preprocessor_config.json``. This module
re-implements their pipeline with the same arithmetic, step by step:

1. **RGB.** A path is opened, rotated by its EXIF orientation and converted with ``convert("RGB")``
   (alpha is dropped), as ``transformers.image_utils.load_image`` does. An image that still carries
   transparency (an ``A`` band or a ``transparency`` entry) is then composited onto white, as the
   processors' ``convert_to_rgb`` does.
2. **Resize** with PIL on the 8-bit image: to an exact ``(height, width)``, or the shorter side to
   ``shortest_edge`` and the longer side to ``int(shortest_edge * long / short)`` (truncated).
3. **Center crop** of the 8-bit pixels at offset ``(size - crop) // 2``; a side shorter than the crop is
   zero-padded, ``ceil(missing / 2)`` before it and the rest after.
4. **Rescale**: ``float64(pixel) * rescale``, rounded to float32.
5. **Normalize** in float32: ``(x - mean) / std``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import KestrelError
from ..kernels import settings

PathLike = str | os.PathLike[str]
ImageSource = PathLike | Image.Image

RESAMPLE: dict[str, Image.Resampling] = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
}
_RESAMPLE_BY_CODE = {int(code): name for name, code in RESAMPLE.items()}

_HALF = (0.5, 0.5, 0.5)
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# What a config key that is missing (or null) means: the base class defaults, overlaid with the class
# attributes of the reference processor named by ``image_processor_type``.
_BASE_DEFAULTS: dict[str, Any] = {"default_to_square": True, "rescale_factor": 1 / 255, "resample": 2}
_PROCESSOR_DEFAULTS: dict[str, dict[str, Any]] = {
    "ViTImageProcessor": {
        "do_resize": True,
        "size": {"height": 224, "width": 224},
        "resample": 2,
        "do_rescale": True,
        "do_normalize": True,
        "image_mean": _HALF,
        "image_std": _HALF,
    },
    "BitImageProcessor": {
        "do_resize": True,
        "size": {"shortest_edge": 224},
        "default_to_square": False,
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": 224, "width": 224},
        "do_rescale": True,
        "do_normalize": True,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
    },
    "SiglipImageProcessor": {
        "do_resize": True,
        "size": {"height": 224, "width": 224},
        "default_to_square": False,
        "resample": 3,
        "do_rescale": True,
        "do_normalize": True,
        "image_mean": _HALF,
        "image_std": _HALF,
    },
}


class ImageError(KestrelError, ValueError):
    """An image file that is missing or cannot be decoded."""

    def __init__(self, path: PathLike, reason: str) -> None:
        self.path, self.reason = os.fspath(path), reason
        super().__init__(f"cannot read image {self.path}: {reason}")


MAX_PIXELS = 1 << 26  # 67,108,864 pixels (8192 x 8192): about 200 MB as 8-bit RGB


def max_pixels() -> int:
    """The pixel limit of a decoded image and of every resize target: ``KESTREL_MAX_PIXELS`` or
    :data:`MAX_PIXELS`. It bounds memory and time whatever the file's size (a 475-byte PNG can be 1 x 100,000
    pixels, which a shortest-edge resize to 256 would turn into 256 x 25,600,000)."""
    return settings.max_pixels(MAX_PIXELS)


def check_pixels(source: PathLike | str, width: int, height: int, what: str = "the image has") -> None:
    """Raise :class:`ImageError` when ``width x height`` is above :func:`max_pixels`."""
    limit = max_pixels()
    if width * height > limit:
        raise ImageError(source, f"{what} {width} x {height} = {width * height:,} pixels (width x height), "
                                 f"above the limit of {limit:,}; set KESTREL_MAX_PIXELS to allow more")


def _open_checked(path: PathLike) -> Image.Image:
    """``Image.open`` after refusing what must not be opened (a folder, FIFO, device, dangling link)."""
    from .readers import ReadError, check_file

    try:
        check_file(path, "image file")
    except ReadError as e:
        raise ImageError(path, e.reason) from None
    return Image.open(path)


def _image_error(path: PathLike, exc: Exception) -> KestrelError:
    if isinstance(exc, KestrelError):  # the image's own (ImageError) or a bad KESTREL_MAX_PIXELS (SettingError)
        return exc
    if isinstance(exc, UnidentifiedImageError):
        return ImageError(path, "not a recognised image format")
    if isinstance(exc, OSError) and not isinstance(exc, Image.DecompressionBombError):
        return ImageError(path, exc.strerror or str(exc))
    return ImageError(path, str(exc) or type(exc).__name__)  # decoders raise many kinds of error


def check_image_header(path: PathLike) -> tuple[int, int]:
    """(width, height) from the file's header, or :class:`ImageError` (not an image, over the pixel limit)."""
    try:
        with _open_checked(path) as raw:
            check_pixels(path, raw.width, raw.height)
            if raw.width < 1 or raw.height < 1:
                raise ImageError(path, f"it has {raw.width} x {raw.height} pixels")
            return raw.width, raw.height
    except Exception as exc:
        raise _image_error(path, exc) from exc


def load_image(path: PathLike) -> Image.Image:
    """Open an image file as an upright RGB image, as ``transformers.image_utils.load_image`` does.

    The EXIF orientation is applied and the image is converted to RGB: 8-bit modes with ``convert("RGB")``
    (which drops an alpha band), 16-bit, 32-bit and float ones by scaling to 8 bits first (:func:`to_8bit`).
    A missing, special (FIFO, device) or undecodable file, or one with more than :func:`max_pixels` pixels
    (checked from the header, before decoding), raises :class:`ImageError` naming the path and the reason.
    """
    return load_image_mode(path, "RGB")


def load_image_mode(path: PathLike, mode: str) -> Image.Image:
    """:func:`load_image` converting to ``mode`` (``"RGB"`` or ``"L"``)."""
    try:
        with _open_checked(path) as raw:
            check_pixels(path, raw.width, raw.height)
            return to_8bit(ImageOps.exif_transpose(raw)).convert(mode)
    except Exception as exc:
        raise _image_error(path, exc) from exc


SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})


def to_8bit(image: Image.Image) -> Image.Image:
    """An image in an 8-bit mode, with its brightness kept.

    Pillow's ``convert`` clips wider integer modes at 255, so a 16-bit gray PNG (``I;16``) came out nearly
    white. Here a 16-bit or 32-bit integer image (``I;16*``, ``I``: PNG and TIFF store 16-bit gray so) is
    scaled from 0..65535 to 0..255 as ``round(v / 257)`` (an 8-bit image saved as 16 bits, ``v * 257``,
    comes back exactly); values outside 0..65535 are clipped. A float image (``F``) keeps Pillow's own
    0..255 convention, rounded and clipped. ``La`` (premultiplied) becomes ``LA``. Other modes are
    returned as they are: ``convert`` handles them (``1``, ``L``, ``P``, ``RGB``, ``RGBA``, ``CMYK``,
    ``YCbCr``, ``LAB``, ``HSV``, ``LA``, ``PA``, ``RGBa``, ``RGBX``).
    """
    if image.mode in SIXTEEN_BIT_MODES:
        values = np.asarray(image, dtype=np.float64)
        return Image.fromarray(np.clip(np.rint(values / 257.0), 0, 255).astype(np.uint8), mode="L")
    if image.mode == "F":
        values = np.nan_to_num(np.asarray(image, dtype=np.float64), nan=0.0, posinf=255.0, neginf=0.0)
        return Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), mode="L")
    if image.mode == "La":  # premultiplied: divide the gray by alpha
        la = np.asarray(image, dtype=np.float64).reshape(image.height, image.width, 2)
        alpha = la[..., 1]
        gray = np.where(alpha > 0, la[..., 0] * 255.0 / np.maximum(alpha, 1), 0)
        out = np.stack([np.clip(np.rint(gray), 0, 255), alpha], axis=-1).astype(np.uint8)
        return Image.fromarray(out, mode="LA")
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert to RGB, compositing any transparency onto white (the processors' ``convert_to_rgb``);
    16-bit and float images are scaled to 8 bits first (:func:`to_8bit`)."""
    image = to_8bit(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def shortest_edge_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """The (height, width) that scales the shorter side to ``shortest_edge``; the longer is truncated."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shortest_edge * long / short)
    return (new_long, shortest_edge) if width <= height else (shortest_edge, new_long)


def center_crop(pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Center-crop ``[..., H, W]`` to ``size`` = (height, width), zero-padding sides that are too short."""
    for dim, length in zip((-2, -1), size):
        have = pixels.shape[dim]
        if have >= length:
            pixels = pixels.narrow(dim, (have - length) // 2, length)
        else:
            shape = list(pixels.shape)
            shape[dim] = length
            padded = pixels.new_zeros(shape)
            padded.narrow(dim, (length - have + 1) // 2, have).copy_(pixels)
            pixels = padded
    return pixels


@dataclass(frozen=True)
class ImagePreprocess:
    """How a checkpoint turns an image into pixels.

    At most one of ``resize`` and ``shortest_edge`` is set; with neither the image keeps its size. A
    processor whose config turns rescaling or normalization off has ``rescale=1.0`` or
    ``mean=(0, 0, 0), std=(1, 1, 1)``, which give the same numbers.
    """

    resize: tuple[int, int] | None  # (height, width) exact resize, or None
    shortest_edge: int | None  # resize shortest edge to this, keeping aspect, or None
    crop: tuple[int, int] | None  # center crop (height, width) or None
    resample: str  # a key of RESAMPLE: "bilinear" | "bicubic" | "nearest" | ...
    rescale: float  # e.g. 1/255
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def __post_init__(self) -> None:
        if self.resize is not None and self.shortest_edge is not None:
            raise ValueError("set at most one of resize and shortest_edge")
        for name in ("resize", "crop"):
            value = getattr(self, name)
            if value is not None and (len(value) != 2 or min(value) < 1):
                raise ValueError(f"{name} must be a positive (height, width), got {value}")
        if self.shortest_edge is not None and self.shortest_edge < 1:
            raise ValueError(f"shortest_edge must be positive, got {self.shortest_edge}")
        if self.resample not in RESAMPLE:
            raise ValueError(f"resample must be one of {sorted(RESAMPLE)}, got {self.resample!r}")
        if len(self.mean) != 3 or len(self.std) != 3 or 0 in self.std:
            raise ValueError(f"mean and std need 3 values, std non-zero; got {self.mean}, {self.std}")

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ImagePreprocess:
        """Parse a ``preprocessor_config.json`` dict of a ViT, BiT or SigLIP image processor.

        Missing or null keys take the defaults of the processor named by ``image_processor_type`` (or the
        older ``feature_extractor_type``), as transformers does; other types fall back to the base class
        (steps off, bilinear, ``1/255``). An integer ``size`` means a square unless the processor's
        ``default_to_square`` is false (BiT, SigLIP), when it is a shortest edge.
        """
        defaults = {**_BASE_DEFAULTS, **_PROCESSOR_DEFAULTS.get(_processor_type(cfg), {})}

        def get(key: str) -> Any:
            value = cfg.get(key)
            return defaults.get(key) if value is None else value

        if get("do_pad"):
            raise ValueError("padding (do_pad) is not supported")
        resize = shortest_edge = crop = None
        if get("do_resize"):
            size = _size_dict(get("size"), square=bool(get("default_to_square")), key="size")
            if size.keys() == {"shortest_edge"}:
                shortest_edge = int(size["shortest_edge"])
            else:
                resize = _height_width(size, "size")
        if get("do_center_crop"):
            crop = _height_width(_size_dict(get("crop_size"), square=True, key="crop_size"), "crop_size")
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        if get("do_normalize"):
            mean, std = _three(get("image_mean"), "image_mean"), _three(get("image_std"), "image_std")
        return cls(
            resize=resize,
            shortest_edge=shortest_edge,
            crop=crop,
            resample=_resample_name(get("resample")),
            rescale=float(get("rescale_factor")) if get("do_rescale") else 1.0,
            mean=mean,
            std=std,
        )

    @classmethod
    def from_file(cls, path: PathLike) -> ImagePreprocess:
        """Read a ``preprocessor_config.json`` (or a checkpoint folder holding one)."""
        from .readers import ReadError, read_json_object

        path = Path(path)
        if path.is_dir():
            path = path / "preprocessor_config.json"
        config = read_json_object(path, "preprocessor config")
        try:
            return cls.from_config(config)
        except (ValueError, TypeError, KeyError) as e:
            raise ReadError(path, f"not a usable image processor config: {e}") from None

    @property
    def output_size(self) -> tuple[int, int]:
        """(height, width) of every output; an error when it depends on the input image."""
        if self.crop is not None:
            return self.crop
        if self.resize is not None:
            return self.resize
        raise ValueError("the output size depends on the image: there is no exact resize or crop")

    def with_size(self, height: int, width: int) -> ImagePreprocess:
        """A copy whose output is (height, width), e.g. to run DINOv2 at 518.

        A shortest-edge processor scales the shorter image side to ``max(height, width)`` and center-crops
        to (height, width): for a square size that is resize-to-the-crop-side then crop, and for any size
        the crop lies inside the resized image, so nothing is zero-padded. (The checkpoint's extra margin,
        e.g. DINOv2's 256 for a 224 crop, is not kept.) Any other processor resizes to exactly
        (height, width) and does not crop.
        """
        if self.shortest_edge is not None:
            return replace(self, shortest_edge=max(height, width), crop=(height, width))
        return replace(self, resize=(height, width), crop=None)

    def __call__(self, images: ImageSource | Iterable[ImageSource]) -> torch.Tensor:
        """Preprocess a path, a PIL image, or a list of those into float32 ``[B, 3, H, W]``."""
        items = [images] if isinstance(images, str | os.PathLike | Image.Image) else list(images)
        if not items:
            raise ValueError("no images given")
        pixels = [self.pixels(item) for item in items]
        shapes = sorted({tuple(p.shape[1:]) for p in pixels})
        if len(shapes) > 1:
            raise ValueError(f"images came out in different sizes {shapes}; add a crop or exact resize")
        return self.finish(torch.stack(pixels))

    def finish(self, pixels: torch.Tensor) -> torch.Tensor:
        """Rescale and normalize 8-bit ``[B, 3, H, W]`` pixels (from :meth:`pixels`) to float32."""
        batch = (pixels.to(torch.float64) * self.rescale).to(torch.float32)
        mean = torch.tensor(self.mean, dtype=torch.float32).view(1, 3, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).view(1, 3, 1, 1)
        return (batch - mean) / std

    def pixels(self, image: ImageSource) -> torch.Tensor:
        """The resized and cropped 8-bit pixels of one image, ``uint8 [3, H, W]``."""
        source = "<PIL image>"
        if isinstance(image, str | os.PathLike):
            source = os.fspath(image)
            image = load_image(image)
        elif not isinstance(image, Image.Image):
            raise TypeError(f"expected a path or a PIL image, got {type(image).__name__}")
        else:
            check_pixels(source, image.width, image.height)
        image = to_rgb(image)
        size = self.resize
        if self.shortest_edge is not None:
            size = shortest_edge_size(image.height, image.width, self.shortest_edge)
        if size is not None:
            if min(size) < 1:
                raise ImageError(source, f"its {image.width} x {image.height} pixels resize to {size[1]} x "
                                         f"{size[0]}: the aspect ratio is too extreme for this model")
            check_pixels(source, size[1], size[0],
                         f"its {image.width} x {image.height} pixels would resize (shorter side to "
                         f"{self.shortest_edge}) to" if self.shortest_edge is not None else "the resize target is")
            image = image.resize((size[1], size[0]), resample=RESAMPLE[self.resample])
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)
        return pixels if self.crop is None else center_crop(pixels, self.crop)


def preprocess_batches(
    paths: Iterable[PathLike], preprocess: ImagePreprocess, batch_size: int
) -> Iterator[tuple[list[PathLike], torch.Tensor]]:
    """Yield ``(paths, pixels)`` for consecutive batches of at most ``batch_size`` images."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    batch: list[PathLike] = []
    for path in paths:
        batch.append(path)
        if len(batch) == batch_size:
            yield batch, preprocess(batch)
            batch = []
    if batch:
        yield batch, preprocess(batch)


def _processor_type(cfg: dict[str, Any]) -> str:
    """The reference class name, e.g. ``ViTFeatureExtractor`` and ``BitImageProcessorFast`` normalized."""
    name = str(cfg.get("image_processor_type") or cfg.get("feature_extractor_type") or "")
    name = name.replace("FeatureExtractor", "ImageProcessor")
    return name.removesuffix("Fast").removesuffix("Pil")


def _size_dict(value: Any, square: bool, key: str) -> dict[str, int]:
    """A size in the dict spelling; an int is a square or a shortest edge, a pair is (height, width)."""
    if isinstance(value, int):
        return {"height": value, "width": value} if square else {"shortest_edge": value}
    if isinstance(value, list | tuple) and len(value) == 2:
        return {"height": value[0], "width": value[1]}
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if v is not None}
    raise ValueError(f"{key}: unsupported size {value!r}")


def _height_width(size: dict[str, int], key: str) -> tuple[int, int]:
    if size.keys() != {"height", "width"}:
        raise ValueError(f"{key}: need 'height' and 'width' (or 'shortest_edge' for size), got {size}")
    return int(size["height"]), int(size["width"])


def _three(value: Any, key: str) -> tuple[float, float, float]:
    if isinstance(value, int | float):
        return (float(value),) * 3
    values = tuple(float(v) for v in value)
    if len(values) != 3:
        raise ValueError(f"{key}: need 3 values, got {value!r}")
    return values  # type: ignore[return-value]


def _resample_name(value: Any) -> str:
    """A PIL filter code (``2`` is bilinear, ``3`` bicubic) or name, as a key of :data:`RESAMPLE`."""
    if isinstance(value, str) and value.lower() in RESAMPLE:
        return value.lower()
    if isinstance(value, int) and value in _RESAMPLE_BY_CODE:
        return _RESAMPLE_BY_CODE[value]
    raise ValueError(f"resample: unsupported filter {value!r}")


def read_mask(path: PathLike) -> np.ndarray:
    """A mask prompt: a 2-D numeric ``.npy`` (e.g. ``lowres_K.npy``) or a mask image (as ``L`` values)."""
    from .readers import ReadError, check_file, read_npy

    p = check_file(path, "mask file")
    if p.suffix.lower() == ".npy":
        array = read_npy(p)
    else:
        try:
            array = np.asarray(load_image_mode(p, "L"))
        except ImageError as e:
            raise ReadError(p, f"neither a .npy array nor a mask image: {e.reason}") from None
    if array.ndim != 2 or 0 in array.shape:
        raise ReadError(p, f"expected a 2-D mask, got shape {tuple(array.shape)}")
    return array
