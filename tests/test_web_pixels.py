"""The page's preprocessing (static/pixels.js, run by Node.js) against Kestrel's Python recipe (Pillow)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

STATIC = Path(__file__).resolve().parents[1] / "src" / "kestrel" / "web" / "static"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="Node.js is not installed (the page's JavaScript runs on it)")

SCRIPT = """
import { resizeBilinear, normalize } from '%s/pixels.js';
import fs from 'fs';
const job = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const rgba = new Uint8ClampedArray(fs.readFileSync(job.input));
const rgb = resizeBilinear(rgba, job.width, job.height, job.size, job.size);
fs.writeFileSync(job.rgb, rgb);
const x = normalize(rgb, job.size, job.recipe);
fs.writeFileSync(job.pixels, Buffer.from(x.buffer));
"""

RECIPE = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "rescale": 1 / 255}


def run_js(tmp_path: Path, image: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    h, w, _ = image.shape
    rgba = np.concatenate([image, np.full((h, w, 1), 255, np.uint8)], axis=2)
    (tmp_path / "in.rgba").write_bytes(rgba.tobytes())
    script = tmp_path / "run.mjs"
    script.write_text(SCRIPT % STATIC.as_posix())
    job = {"input": str(tmp_path / "in.rgba"), "width": w, "height": h, "size": size, "recipe": RECIPE,
           "rgb": str(tmp_path / "out.rgb"), "pixels": str(tmp_path / "out.f32")}
    (tmp_path / "job.json").write_text(json.dumps(job))
    subprocess.run([NODE, str(script), str(tmp_path / "job.json")], check=True, timeout=60)
    rgb = np.frombuffer((tmp_path / "out.rgb").read_bytes(), np.uint8).reshape(size, size, 3)
    pixels = np.frombuffer((tmp_path / "out.f32").read_bytes(), "<f4").reshape(1, 3, size, size)
    return rgb, pixels


def python_recipe(rgb: np.ndarray) -> np.ndarray:
    """Kestrel's ImagePreprocess arithmetic: uint8 * rescale in float64, to float32, (x - mean) / std."""
    x = (torch.from_numpy(rgb).permute(2, 0, 1)[None].to(torch.float64) * RECIPE["rescale"]).to(torch.float32)
    mean = torch.tensor(RECIPE["mean"], dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(RECIPE["std"], dtype=torch.float32).view(1, 3, 1, 1)
    return ((x - mean) / std).numpy()


@pytest.mark.parametrize(("width", "height"), [(640, 480), (300, 200), (512, 512), (1, 100), (777, 333), (1000, 37)])
def test_resize_and_normalize_equal_pillow_and_torch_bit_for_bit(tmp_path, width, height):
    rng = np.random.default_rng(width * 7 + height)
    image = (np.cumsum(rng.integers(0, 40, (height, width, 3)), axis=1) % 256).astype(np.uint8)
    rgb, pixels = run_js(tmp_path, image, 512)
    expected = np.array(Image.fromarray(image).resize((512, 512), Image.BILINEAR))
    assert np.array_equal(rgb, expected)
    assert np.array_equal(pixels, python_recipe(expected))


@pytest.mark.parametrize(("width", "height"), [(300, 800), (37, 1000), (841, 870)])
def test_resize_when_pillow_orders_the_passes_otherwise(tmp_path, width, height):
    """Pillow 13 resamples some shapes vertically first; the page follows its rule for a wider, shorter
    image. Where the rules differ, 8-bit rounding between the passes differs by at most one level."""
    rng = np.random.default_rng(width + height)
    image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    rgb, _ = run_js(tmp_path, image, 512)
    expected = np.array(Image.fromarray(image).resize((512, 512), Image.BILINEAR))
    assert np.abs(rgb.astype(int) - expected).max() <= 1
