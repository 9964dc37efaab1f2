"""``kestrel.load``: card names through the hub cache at the pinned revision, directories, and bad checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import ViTConfig, ViTForImageClassification

import kestrel
from kestrel.models.cards import CARDS, CardError
from kestrel.runtime.checkpoint import CheckpointError
from kestrel.runtime.hub import HubError
from reference import make_cached_repo, rel_diff, seeded

pytestmark = pytest.mark.usefixtures("hermetic")  # offline, HF env in tmp_path, no request

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
             patch_size=8, num_labels=4)


@pytest.fixture
def saved(tmp_path):
    ref = seeded(lambda: ViTForImageClassification(ViTConfig(**SMALL)))
    d = tmp_path / "saved"
    ref.save_pretrained(d)
    return d, ref


def _same_outputs(model, ref):
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert rel_diff(model.forward(x), ref(pixel_values=x).logits) <= 1e-4


def test_card_name_resolves_through_the_hub_cache_at_its_pinned_revision(saved, tmp_path, monkeypatch):
    d, ref = saved
    card = CARDS["vit-base-patch16-224"]
    cache = tmp_path / "hf_home" / "hub"
    files = {p.name: p.read_bytes() for p in d.iterdir()}
    make_cached_repo(cache, card.repo, card.revision, files)
    model = kestrel.load("vit-base-patch16-224")
    assert model.loaded.card is card and model.loaded.directory.name == card.revision
    _same_outputs(model, ref)


def test_offline_without_a_cache_says_what_to_do(tmp_path):
    with pytest.raises(HubError) as e:
        kestrel.load("vit-base-patch16-224")
    text = str(e.value)
    assert "google/vit-base-patch16-224" in text and CARDS["vit-base-patch16-224"].revision in text
    assert "--weights" in text


def test_weights_dir_for_a_card_and_a_plain_directory(saved):
    d, ref = saved
    _same_outputs(kestrel.load("vit-base-patch16-224", weights=d), ref)
    _same_outputs(kestrel.load(d), ref)


def test_sharded_checkpoint(tmp_path):
    ref = seeded(lambda: ViTForImageClassification(ViTConfig(**SMALL)))
    ref.save_pretrained(tmp_path, max_shard_size="30KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    _same_outputs(kestrel.load(tmp_path), ref)


def _rewrite(d, edit):
    tensors = load_file(d / "model.safetensors")
    edit(tensors)
    save_file(tensors, d / "model.safetensors")


def test_missing_unexpected_and_misshapen_tensors_are_named(saved):
    d, _ = saved
    _rewrite(d, lambda t: (t.pop("vit.layernorm.weight"),
                           t.__setitem__("vit.extra.weight", torch.zeros(3)),
                           t.__setitem__("classifier.bias", torch.zeros(5))))
    with pytest.raises(CheckpointError) as e:
        kestrel.load(d)
    text = str(e.value)
    assert "norm.weight" in text and "missing" in text
    assert "vit.extra.weight" in text and "unexpected" in text
    assert "head.bias" in text and "classifier.bias" in text and "(4,)" in text.replace("[4]", "(4,)")


def test_integer_tensor_where_a_float_is_declared(saved):
    d, _ = saved
    _rewrite(d, lambda t: t.__setitem__("classifier.bias", torch.zeros(4, dtype=torch.int64)))
    with pytest.raises(CheckpointError, match=r"head\.bias"):
        kestrel.load(d)


def test_bad_config_and_unknown_family(saved, tmp_path):
    d, _ = saved
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_attention_heads"] = 3  # 32 is not a multiple of 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=r"D % Heads == 0.*D = 32, Heads = 3"):
        kestrel.load(d)
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CardError, match="model_type 'gpt2'"):
        kestrel.load(d)
    with pytest.raises(CardError, match="unknown model"):
        kestrel.load(tmp_path / "nowhere")


def test_only_rebindable_generics_can_be_overridden(saved):
    d, _ = saved
    with pytest.raises(CardError, match="vit cannot rebind Height"):
        kestrel.load(d, Height=64)


def test_state_dict_keys_are_the_parameter_paths(saved):
    d, _ = saved
    model = kestrel.load(d)
    from kestrel.blocks import parameter_manifest

    manifest = {p: s for p, s, _, _ in parameter_manifest(type(model), model.generics)}
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == manifest


def test_from_config_binds_an_unweighted_model_from_a_config_dict():
    cfg = {"model_type": "vit", **SMALL}
    model = kestrel.from_config(cfg)
    assert model.generics["D"] == 32 and model.generics["Classes"] == 4
    assert tuple(model.state_dict()["positions"].shape) == (1, 1 + (32 // 8) ** 2, 32)
    assert model.forward(torch.zeros(1, 3, 32, 32)).shape == (1, 4)
    with pytest.raises(CardError, match="model_type 'gpt2'"):
        kestrel.from_config({"model_type": "gpt2"})


def test_half_precision_is_native_only_where_the_cpu_flags_say_so():
    from kestrel.kernels.calibration import native_half_in

    zen2 = "processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma f16c\n"
    sapphire = "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile avx512_fp16\n"
    graviton3 = "Features\t: fp asimd fphp asimdhp bf16 i8mm\n"
    assert native_half_in(zen2, "bf16") is False and native_half_in(zen2, "f16") is False
    assert native_half_in(sapphire, "bf16") is True and native_half_in(sapphire, "f16") is True
    assert native_half_in(graviton3, "bf16") is True and native_half_in(graviton3, "f16") is True
    assert native_half_in("processor: 0\n", "bf16") is None  # no flags line: unknown, no warning


@pytest.mark.parametrize("native", [False, True, None])
def test_bf16_on_a_cpu_without_native_bf16_warns_that_it_will_be_slow(saved, monkeypatch, native):
    import warnings

    from kestrel.errors import KestrelWarning

    monkeypatch.setattr("kestrel.runtime.load.native_half", lambda name: native)
    monkeypatch.setattr("kestrel.runtime.load.measured_rates", lambda name: {"f32": 100.0, name: 190.0})
    d, _ = saved
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = kestrel.load(d, dtype="bf16")
        kestrel.load(d)  # f32 never warns
    ours = [w for w in seen if issubclass(w.category, KestrelWarning)]
    assert str(model.loaded.generics["T"]) == "bf16"
    if native is False:
        assert len(ours) == 1 and "bf16 will be slow on this CPU" in str(ours[0].message)
        assert ours[0].filename == __file__  # points at the caller's kestrel.load line
    else:
        assert ours == []


def test_bf16_with_native_flags_but_slower_gemms_warns_with_the_measured_rates(saved, monkeypatch):
    """An Intel Xeon with avx512_bf16 and no AMX: native by its flags, its bf16 GEMMs slower than f32's."""
    import warnings

    from kestrel.errors import KestrelWarning

    monkeypatch.setattr("kestrel.runtime.load.native_half", lambda name: True)
    monkeypatch.setattr("kestrel.runtime.load.measured_rates", lambda name: {"f32": 150.0, name: 90.0})
    d, _ = saved
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        kestrel.load(d, dtype="bf16")
    ours = [str(w.message) for w in seen if issubclass(w.category, KestrelWarning)]
    assert len(ours) == 1 and "bf16 will be slow on this CPU" in ours[0]
    assert "measured 90 GFLOP/s against f32's 150" in ours[0]


def test_the_half_precision_rate_is_measured_once_per_machine(own_calibration, monkeypatch):
    from kestrel.kernels import calibration, half

    calls = []

    def fake(names, n=1024, rounds=4):
        calls.append(names)
        return {"f32": 150.0, "bf16": 90.0}

    monkeypatch.setattr(half, "dtype_rates", fake)
    monkeypatch.setattr(half, "others_share", lambda fn: (fn(), 0.0))  # a quiet machine, whatever runs beside
    assert half.measured_rates("bf16") == {"f32": 150.0, "bf16": 90.0}
    calibration.forget()  # a new process reads the table's file
    assert half.measured_rates("bf16") == {"f32": 150.0, "bf16": 90.0}
    assert calls == [("f32", "bf16")]
    monkeypatch.setenv("KESTREL_CALIBRATE", "0")
    assert half.measured_rates("f16") is None  # calibration off: nothing measured, no warning
    monkeypatch.delenv("KESTREL_CALIBRATE")
    monkeypatch.setattr(half, "others_share", lambda fn: (fn(), 0.6))  # another process took the cores
    assert half.measured_rates("f16") == {"f32": 150.0, "bf16": 90.0}
    calibration.forget()
    half.measured_rates("f16")  # a disturbed measurement is not reused by the next process
    assert calls == [("f32", "bf16"), ("f32", "f16"), ("f32", "f16")]


def test_the_half_precision_rates_are_real_gemm_rates():
    from kestrel.kernels import half

    rates = half.dtype_rates(("f32", "bf16"), n=128, rounds=2)
    assert set(rates) == {"f32", "bf16"} and all(0 < r < 1e5 for r in rates.values())


def test_the_command_line_prints_the_warning_as_one_line(saved, monkeypatch, capsys, tmp_path):
    from PIL import Image

    from kestrel.cli.main import main

    monkeypatch.setattr("kestrel.runtime.load.native_half", lambda name: False)
    d, _ = saved
    image = tmp_path / "cat.png"
    Image.new("RGB", (40, 30), (200, 120, 40)).save(image)
    assert main(["classify", str(image), "--model", str(d), "--dtype", "bf16"]) == 0
    err = capsys.readouterr().err
    assert "kestrel classify: warning: bf16 will be slow on this CPU" in err
    assert "KestrelWarning" not in err and "load.py" not in err
