"""SAM for users: processor parity, every prompt kind against transformers, post-processing, bad prompts.

One small random-weight SamModel (the real structure at width 32) is saved with ``save_pretrained`` and
loaded by Kestrel; the image is encoded once per module and the decoders compared on that embedding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import SamProcessor
from transformers.models.sam.image_processing_pil_sam import SamImageProcessorPil

import kestrel
from kestrel.pipelines.prompts import Prompt, PromptError
from kestrel.pipelines.sam_processing import SamImageProcessor, prompt_tensors
from kestrel.pipelines.segment import EmbeddingError, SamSegmenter, load_embedding, save_embedding
from kestrel.pipelines.segmenter import ImageEmbedding, image_digest
from reference import SMALL, rel_diff, seeded_sam

TOL = 1e-4


def _photo(h: int = 375, w: int = 500, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    img = (rng.random((h, w, 3)) * 255).astype(np.uint8)
    img[h // 4: h // 2, w // 3: 2 * w // 3] = (200, 40, 40)
    return Image.fromarray(img)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ref = seeded_sam(SMALL, seed=5)
    path = tmp_path_factory.mktemp("sam-seg")
    ref.save_pretrained(path)
    SamImageProcessorPil().save_pretrained(path)
    ours = kestrel.load(path)
    seg = SamSegmenter(ours)
    photo = _photo()
    proc = SamProcessor(image_processor=SamImageProcessorPil())
    emb = seg.encode(photo)
    return ref, seg, photo, proc, emb


def test_pixels_and_sizes_match_the_processor(setup):
    _, seg, photo, proc, _ = setup
    want = proc(images=photo, return_tensors="pt")
    got = seg.processor(photo)
    assert got.original_size == tuple(want["original_sizes"][0].tolist()) == (375, 500)
    assert got.reshaped_input_size == tuple(want["reshaped_input_sizes"][0].tolist()) == (768, 1024)
    assert torch.equal(got.pixel_values, want["pixel_values"])
    tall = _photo(700, 301)  # odd sizes round as the processor rounds
    sizes = proc(images=tall, return_tensors="pt")["reshaped_input_sizes"]
    assert seg.processor(tall).reshaped_input_size == tuple(sizes[0].tolist())


def test_image_embedding_matches_reference(setup):
    ref, _, photo, proc, emb = setup
    with torch.no_grad():
        want = ref.get_image_embeddings(proc(images=photo, return_tensors="pt")["pixel_values"])
    assert rel_diff(emb.tensors["image_embeddings"], want) <= TOL


def _reference(ref, proc, photo, emb, multimask, input_masks=None, **prompts):
    inputs = proc(images=photo, return_tensors="pt", **prompts)
    kwargs = {k: inputs[k] for k in ("input_points", "input_labels", "input_boxes") if k in inputs}
    if "input_points" in kwargs:
        kwargs["input_points"] = kwargs["input_points"].float()
    if "input_boxes" in kwargs:
        kwargs["input_boxes"] = kwargs["input_boxes"].float()
    with torch.no_grad():
        out = ref(image_embeddings=emb.tensors["image_embeddings"], multimask_output=multimask,
                  input_masks=input_masks, **kwargs)
    return out.pred_masks[0], out.iou_scores[0], inputs


CASES = {
    "points": ([Prompt([(250.0, 120.0), (40.0, 300.0)], [1, 0])],
               dict(input_points=[[[250.0, 120.0], [40.0, 300.0]]], input_labels=[[1, 0]])),
    "box": ([Prompt(box=(100.0, 50.0, 400.0, 300.0))], dict(input_boxes=[[[100.0, 50.0, 400.0, 300.0]]])),
    "points with a box": ([Prompt([(250.0, 120.0)], [1], (100.0, 50.0, 400.0, 300.0))],
                          dict(input_points=[[[250.0, 120.0]]], input_labels=[[1]],
                               input_boxes=[[[100.0, 50.0, 400.0, 300.0]]])),
    "several boxes": ([Prompt(box=(100.0, 50.0, 400.0, 300.0)), Prompt(box=(0.0, 0.0, 499.0, 374.0)),
                       Prompt(box=(5.0, 6.0, 50.0, 60.0))],
                      dict(input_boxes=[[[100.0, 50.0, 400.0, 300.0], [0.0, 0.0, 499.0, 374.0],
                                         [5.0, 6.0, 50.0, 60.0]]])),
    "label -10": ([Prompt([(250.0, 120.0), (40.0, 300.0), (10.0, 10.0)], [1, -10, 0])],
                  dict(input_points=[[[250.0, 120.0], [40.0, 300.0], [10.0, 10.0]]], input_labels=[[1, -10, 0]])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_prompts_match_reference(setup, case):
    """Single-mask and multimask outputs; the IoUs compared as one vector (a lone IoU may be near 0)."""
    ref, seg, photo, proc, emb = setup
    prompts, ref_prompts = CASES[case]
    got, want = [], []
    for multimask in (False, True):
        want_masks, want_iou, inputs = _reference(ref, proc, photo, emb, multimask, **ref_prompts)
        decoded = seg.decode(emb, prompts, multimask=multimask)
        assert decoded.low_res.shape == want_masks.shape and decoded.iou.shape == want_iou.shape
        got.append(decoded)
        want.append((want_masks, want_iou))
        # full size: thresholded masks against post_process_masks
        full_want = proc.image_processor.post_process_masks(want_masks[None], inputs["original_sizes"],
                                                            inputs["reshaped_input_sizes"])[0]
        full = seg.postprocess(decoded.low_res, emb)
        assert full.shape == full_want.shape == (len(prompts), 3 if multimask else 1, 375, 500)
        union = (full | full_want).sum().item()
        assert union == 0 or (full & full_want).sum().item() / union >= 0.999
    assert rel_diff(torch.cat([g.low_res for g in got], 1), torch.cat([w[0] for w in want], 1)) <= TOL
    assert rel_diff(torch.cat([g.iou for g in got], 1), torch.cat([w[1] for w in want], 1)) <= TOL


def test_mask_prompt_matches_reference(setup):
    ref, seg, photo, proc, emb = setup
    torch.manual_seed(7)
    mask = torch.randn(1, 1, 256, 256) * 5
    prompts, ref_prompts = CASES["points"]
    want_masks, want_iou, _ = _reference(ref, proc, photo, emb, True, input_masks=mask, **ref_prompts)
    got = seg.decode(emb, prompts, multimask=True, mask_input=mask)
    assert rel_diff(got.low_res, want_masks) <= TOL and rel_diff(got.iou, want_iou) <= TOL
    assert want_iou.abs().max() > 0.05  # a scale the IoU comparison can see
    plain = seg.decode(emb, prompts, multimask=True)
    assert rel_diff(plain.low_res, got.low_res) > 1e-3  # the mask prompt changed the answer


def test_ragged_points_are_padded_as_the_processor_pads(setup):
    ref, seg, photo, proc, emb = setup
    prompts = [Prompt([(250.0, 120.0), (40.0, 300.0)], [1, 0]), Prompt([(300.0, 200.0)], [1])]
    t = prompt_tensors(prompts, (375, 500), seg.processor)
    # the processor pads ragged lists across images (each image's points) with -10 points and labels
    # (it appends one label per list, so its padding works for lists one point short: compared there)
    want = proc(images=[photo, photo], input_points=[[[250.0, 120.0], [40.0, 300.0]], [[300.0, 200.0]]],
                input_labels=[[1, 0], [1]], return_tensors="pt")
    assert torch.equal(t.points[0].double(), want["input_points"][:, 0].double().float().double())
    assert torch.equal(t.labels[0].long(), want["input_labels"][:, 0].long())
    # and the padded prompt decodes as the reference decodes it
    with torch.no_grad():
        out = ref(image_embeddings=emb.tensors["image_embeddings"], input_points=t.points, input_labels=t.labels.long(),
                  multimask_output=False)
    got = seg.decode(emb, prompts)
    assert rel_diff(got.low_res, out.pred_masks[0]) <= TOL and rel_diff(got.iou, out.iou_scores[0]) <= TOL


@pytest.mark.parametrize("prompt, message", [
    (Prompt([(float("nan"), 3.0)], [1]), "finite"),
    (Prompt([(1.0, 3.0)], [2]), "label 2"),
    (Prompt([(1.0, 3.0)], [1, 0]), "1 points but 2 labels"),
    (Prompt(box=(10.0, 5.0, 3.0, 50.0)), "x1 < x0"),
    (Prompt(), "no point and no box"),
])
def test_bad_prompts_are_named(setup, prompt, message):
    _, seg, _, _, emb = setup
    with pytest.raises(PromptError, match=message):
        seg.decode(emb, [prompt])


def test_prompts_outside_the_photo_are_refused(setup):
    """The one rule of kestrel.pipelines.input_rules: refused, not clipped (transformers would decode it)."""
    from kestrel.pipelines.input_rules import InputRuleError

    _, seg, _, _, emb = setup
    with pytest.raises(InputRuleError, match=r"point 0 \(-30, 900\) lies outside the 500 x 375 image"):
        seg.decode(emb, [Prompt([(-30.0, 900.0)], [1])])


def test_mixed_boxes_are_refused(setup):
    _, seg, _, _, emb = setup
    with pytest.raises(PromptError, match="prompt 1 has no box"):
        seg.decode(emb, [Prompt(box=(1.0, 2.0, 3.0, 4.0)), Prompt([(1.0, 1.0)], [1])])


def test_embeddings_round_trip_and_refusals(setup, tmp_path):
    _, seg, photo, _, emb = setup
    digest = image_digest(photo)
    emb = ImageEmbedding(dict(emb.tensors), emb.original_size, emb.input_size, emb.model, emb.revision, digest)
    path = tmp_path / "e.safetensors"
    save_embedding(emb, path)
    back = load_embedding(path, seg, digest)
    assert torch.equal(back.tensors["image_embeddings"], emb.tensors["image_embeddings"])
    assert back.original_size == (375, 500) and back.input_size == (768, 1024)
    with pytest.raises(EmbeddingError, match="another image"):
        load_embedding(path, seg, image_digest(_photo(seed=1)))
    foreign = ImageEmbedding(dict(emb.tensors), emb.original_size, emb.input_size, "sam-vit-huge", "main", digest)
    save_embedding(foreign, tmp_path / "f.safetensors")
    with pytest.raises(EmbeddingError, match="model 'sam-vit-huge'"):
        load_embedding(tmp_path / "f.safetensors", seg, digest)
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(EmbeddingError, match="not a readable"):
        load_embedding(tmp_path / "junk.safetensors", seg, digest)


def test_mask_prompt_from_a_photo_sized_mask():
    proc = SamImageProcessor()
    mask = np.zeros((375, 500), dtype=bool)
    mask[100:200, 50:150] = True
    logits = proc.mask_prompt(mask, (375, 500))
    assert logits.shape == (1, 1, 256, 256)
    assert logits[0, 0, 75, 50] == 10 and logits[0, 0, 10, 10] == -10 and logits[0, 0, 250, 10] == -10
    with pytest.raises(PromptError, match="image's size"):
        proc.mask_prompt(np.zeros((10, 10)), (375, 500))
