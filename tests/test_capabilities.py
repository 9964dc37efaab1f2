"""One registry of what each family can do, consulted everywhere; SAM 2.1 through segment-everything; the edge
export's pre-processing is ``kestrel segment``'s to the bit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from kestrel.cli.main import main
from kestrel.export import edge_sam2
from kestrel.export.edge import RECIPES, recipe_for
from kestrel.models import capabilities
from kestrel.models.capabilities import TASKS, Capabilities
from kestrel.models.cards import CARDS, FAMILIES
from kestrel.pipelines.segment import SEGMENTERS
from kestrel.site.build import served_tasks


def test_every_family_declares_what_the_layers_above_implement():
    for family in FAMILIES:
        caps = family.capabilities
        assert caps.tasks, f"{family.name} serves no task"
        assert caps.recipe in RECIPES
        assert caps.segmenter is None or caps.segmenter in SEGMENTERS
        if caps.serves("zero-shot") or caps.serves("similarity"):
            assert caps.text
    assert {f.name: f.capabilities.segmenter for f in FAMILIES if f.capabilities.segmenter} == {
        "sam": "sam", "sam2": "sam2"}
    with pytest.raises(ValueError, match="unknown task 'paint'"):
        Capabilities(tasks=("paint",))
    with pytest.raises(ValueError, match="names its segmenter"):
        Capabilities(tasks=("segment",))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_task_is_a_command(task, capsys):
    with pytest.raises(SystemExit) as e:
        main([task, "--help"])
    assert e.value.code == 0 and f"kestrel {task}" in capsys.readouterr().out


def test_site_lists_the_declared_tasks():
    assert [t for t, _ in served_tasks(CARDS["sam2.1-hiera-tiny"])] == ["segment"]
    assert [t for t, _ in served_tasks(CARDS["siglip-base-patch16-224"])] == ["embed", "zero-shot", "similarity"]
    assert [t for t, _ in served_tasks(CARDS["vit-base-patch16-224"])] == ["classify", "embed"]


@pytest.fixture(scope="module")
def sam2_512(sam2_small):
    import kestrel

    return kestrel.load(str(sam2_small[1]), E=32)


def test_a_loaded_model_answers_from_its_card(sam2_512):
    caps = capabilities.of(sam2_512)
    assert caps.segmenter == "sam2" and caps.recipe == "sam2-edge"
    assert type(recipe_for(sam2_512)).__name__ == "Sam2Recipe"
    assert capabilities.of(torch.nn.Linear(2, 2)) == capabilities.NONE


def _photo(path, width=900, height=700, seed=3):
    """A photo larger than the model input and not square: the resize shrinks, differently per axis."""
    rng = np.random.default_rng(seed)
    base = rng.random((height // 50 + 1, width // 50 + 1, 3))
    img = Image.fromarray((base * 255).astype("uint8")).resize((width, height), Image.Resampling.BICUBIC)
    noisy = np.asarray(img, dtype=np.int16) + rng.integers(-20, 21, (height, width, 3))
    Image.fromarray(noisy.clip(0, 255).astype("uint8")).save(path)
    return path


def test_segment_everything_runs_sam2(sam2_small, tmp_path):
    """``kestrel segment --everything`` on SAM 2.1 used to fail with "drop --mask-input" (SAM 2 was routed
    through SAM's processor); it now runs SAM 2.1's own segmenter and writes the masks and COCO RLE."""
    _, path = sam2_small
    photo = _photo(tmp_path / "photo.png", 240, 180)
    out = tmp_path / "everything"
    code = main(["segment", str(photo), "--everything", "--model", str(path), "--size", "512",
                 "--points-per-side", "3", "--pred-iou-thresh", "0", "--stability-score-thresh", "0",
                 "--out", str(out), "--quiet"])
    assert code == 0
    coco = json.loads((out / "masks.json").read_text())
    annotations = coco["annotations"] if isinstance(coco, dict) else coco
    assert len(annotations) >= 1 and (out / "mask_0.png").is_file()
    mask = np.array(Image.open(out / "mask_0.png"))
    assert mask.shape == (180, 240)


def test_export_preprocessing_is_segments_to_the_bit(sam2_small, tmp_path, monkeypatch):
    """The pixels ``kestrel segment`` feeds SAM 2.1's encoder for a photo are exactly the edge export's
    pre-processing of the same photo (the function validation.json runs)."""
    from kestrel.models import sam2

    _, path = sam2_small
    photo = _photo(tmp_path / "photo.png")
    seen: list[torch.Tensor] = []
    encode = sam2.Model.encode_image

    def spy(self, pixels):
        seen.append(pixels.detach().clone())
        return encode(self, pixels)

    monkeypatch.setattr(sam2.Model, "encode_image", spy)
    assert main(["segment", str(photo), "--model", str(path), "--size", "512", "--point", "400,300",
                 "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert len(seen) == 1
    rgb = torch.from_numpy(np.array(Image.open(photo).convert("RGB")))
    exported = edge_sam2.preprocess(rgb, 512)
    assert exported.shape == seen[0].shape == (1, 3, 512, 512)
    assert torch.equal(exported, seen[0])
    # the graph-style resize the export used before (bilinear, no antialiasing) is not what users run
    mean = torch.tensor([0.485, 0.456, 0.406]).reshape(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).reshape(1, 3, 1, 1)
    plain = torch.nn.functional.interpolate(rgb.permute(2, 0, 1)[None].float(), size=(512, 512), mode="bilinear",
                                            align_corners=False)
    assert float(((plain / 255 - mean) / std - seen[0]).abs().max()) > 0.05
    assert edge_sam2.sample_photo(512).shape == (512, 768, 3)  # validation's sample is resized too
