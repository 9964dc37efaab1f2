"""ViT and DINOv2: parity with transformers from save_pretrained checkpoints (small and real configs)."""

from __future__ import annotations

import pytest
import torch
from transformers import Dinov2Config, Dinov2Model, ViTConfig, ViTForImageClassification

import kestrel
from kestrel.blocks import EntryError
from reference import rel_diff, seeded

TOL = 1e-4

SMALL_VIT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=64,
                 patch_size=16, num_labels=7)
REAL_VIT = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                image_size=224, patch_size=16, num_labels=1000)
SMALL_DINO = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=4, image_size=56,
                  patch_size=14)
REAL_DINO = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, mlp_ratio=4, image_size=518,
                 patch_size=14)


def _vit(tmp_path, cfg):
    ref = seeded(lambda: ViTForImageClassification(ViTConfig(**cfg)))
    ref.save_pretrained(tmp_path)
    return ref, kestrel.load(tmp_path)


def _dino(tmp_path, cfg, **size):
    ref = seeded(lambda: Dinov2Model(Dinov2Config(**cfg)))
    ref.save_pretrained(tmp_path)
    return ref, kestrel.load(tmp_path, **size)


def _check_vit(ref, ours, size, batch=2):
    x = torch.randn(batch, 3, size, size)
    with torch.no_grad():
        out = ref(pixel_values=x, output_hidden_states=True)
        assert rel_diff(ours.forward(x), out.logits) <= TOL
        ref_tokens = ref.vit.layernorm(out.hidden_states[-1])
        assert rel_diff(ours.features(x), ref_tokens) <= TOL


@pytest.mark.parametrize("fold", ["always", "0"])  # the last layer's class-token attention folded, or projected
def test_vit_small_matches_reference(tmp_path, fold, monkeypatch):
    monkeypatch.setenv("KESTREL_FOLD", fold)
    ref, ours = _vit(tmp_path, SMALL_VIT)
    assert ours.generics["Classes"] == 7 and ours.generics["Layers"] == 2
    _check_vit(ref, ours, 64)


@pytest.mark.parametrize("variant", [dict(patch_size=8, image_size=32), dict(hidden_size=96, num_attention_heads=6),
                                     dict(num_hidden_layers=3, num_labels=3)])
def test_vit_family_variants(tmp_path, variant):
    ref, ours = _vit(tmp_path, {**SMALL_VIT, **variant})
    _check_vit(ref, ours, ours.generics["Height"])


@pytest.mark.slow
def test_vit_base_real_config(tmp_path):
    ref, ours = _vit(tmp_path, REAL_VIT)
    _check_vit(ref, ours, 224, batch=1)


def _check_dino(ref, ours, h, w, batch=2):
    x = torch.randn(batch, 3, h, w)
    with torch.no_grad():
        assert rel_diff(ours.forward(x), ref(pixel_values=x).last_hidden_state) <= TOL


def test_dinov2_small_native_size(tmp_path):
    ref, ours = _dino(tmp_path, SMALL_DINO)
    _check_dino(ref, ours, 56, 56)


@pytest.mark.parametrize(("h", "w"), [(28, 28), (84, 84), (42, 70)])
def test_dinov2_small_resized_positions(tmp_path, h, w):
    ref, ours = _dino(tmp_path, SMALL_DINO, Height=h, Width=w)
    _check_dino(ref, ours, h, w)


def test_dinov2_swiglu_giant_structure(tmp_path):
    ref, ours = _dino(tmp_path, {**SMALL_DINO, "use_swiglu_ffn": True})
    assert type(ours).__name__ == "SwiGluModel"
    _check_dino(ref, ours, 56, 56)


def test_dinov2_size_must_be_a_multiple_of_the_patch(tmp_path):
    _, ours = _dino(tmp_path, SMALL_DINO)
    with pytest.raises(EntryError, match=r"input image has shape \(1, 3, 50, 56\).*axis 2 is 50, declared 56"):
        ours.forward(torch.randn(1, 3, 50, 56))


@pytest.mark.slow
@pytest.mark.parametrize(("h", "w"), [(518, 518), (224, 224), (224, 336)])
def test_dinov2_base_real_config(tmp_path, h, w):
    ref, ours = _dino(tmp_path, REAL_DINO, Height=h, Width=w)
    _check_dino(ref, ours, h, w, batch=1)


@pytest.mark.filterwarnings("ignore::kestrel.errors.KestrelWarning")  # 'bf16 will be slow' where it is emulated
def test_bf16_runs_close_to_f32(tmp_path):
    ref, _ = _vit(tmp_path, SMALL_VIT)
    ours = kestrel.load(tmp_path, dtype="bf16")
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        out = ours.forward(x.bfloat16())
        assert out.dtype == torch.bfloat16
        assert rel_diff(out, ref(pixel_values=x).logits) < 0.05  # bf16 keeps ~3 significant digits
    with pytest.raises(EntryError, match="dtype f32, declared bf16"):
        ours.forward(x)
