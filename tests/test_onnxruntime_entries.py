"""onnxruntime as a backend per entry and signature: raced against eager, recorded, followed at load,
accurate to 1e-5, and switchable off."""

from __future__ import annotations

import pytest
import torch

import kestrel
from kestrel.blocks import EntryError
from kestrel.errors import KestrelWarning
from kestrel.export import onnxruntime_race as race
from kestrel.kernels import calibration
from kestrel.kernels.settings import SettingError, onnxruntime_entries
from kestrel.runtime import onnxruntime_entries as backend
from kestrel.runtime.race import call_signature

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

IMAGE = (1, 3, 32, 32)


def _inputs(batch: int = 1, seed: int = 0) -> tuple[torch.Tensor]:
    return (torch.randn(batch, *IMAGE[1:], generator=torch.Generator().manual_seed(seed)),)


def _eager(model, *args):
    return type(model).forward(model, *args)


def test_a_race_records_its_choice_and_a_later_load_follows_it(small_vit, own_calibration, monkeypatch, tmp_path):
    directory = small_vit()
    model = kestrel.load(directory)
    x = _inputs()
    result = race.race_entry(model, "forward", x, trials=2)
    assert set(result["seconds"]) == {"eager", "onnxruntime"}
    assert result["rel_diff"] <= race.REL_TOLERANCE
    key = backend.decision_key(model, "forward", call_signature(x, {}))
    assert calibration.table().shapes[key]["kernel"] == result["kernel"]

    # whatever this machine measured, "always" keeps the accurate program: the rest of the test follows it
    monkeypatch.setenv("KESTREL_ONNXRUNTIME", "always")
    program = backend.program_path(model, "forward")
    made = program.stat().st_mtime_ns
    assert race.race_entry(model, "forward", x, trials=1)["kernel"] == "onnxruntime"
    assert program.stat().st_mtime_ns == made  # exported once per checkpoint, not once per race
    monkeypatch.delenv("KESTREL_ONNXRUNTIME")

    calibration.forget()
    again = kestrel.load(directory)
    assert backend.runs_on(again, "forward", *x) == "onnxruntime"
    assert backend.runs_on(again, "forward", *_inputs(batch=2)) == "eager"  # another signature: not raced
    for batch in (1, 2):
        xs = _inputs(batch, seed=1)
        out, want = again.forward(*xs), _eager(again, *xs)
        assert out.shape == want.shape
        assert float((out - want).abs().max()) <= race.REL_TOLERANCE * float(want.abs().max())
    assert again.forward.onnxruntime_state["program"] is not None  # batch 1 did run the program
    again.requires_grad_(True)  # training: gradients need eager
    assert again.forward(*x).grad_fn is not None
    again.requires_grad_(False)

    with pytest.raises(EntryError) as on_ort:  # the declared types are checked before onnxruntime runs
        again.forward(torch.randn(1, 3, 31, 32))
    with pytest.raises(EntryError) as on_eager:
        _eager(again, torch.randn(1, 3, 31, 32))
    assert str(on_ort.value) == str(on_eager.value)

    program.write_bytes(b"not an onnx file")  # a corrupt cache: the call warns and runs eager
    broken = kestrel.load(directory)
    with pytest.warns(KestrelWarning, match="cannot be loaded"):
        out = broken.forward(*x)
    assert torch.equal(out, _eager(broken, *x))
    assert race.race_entry(broken, "forward", x, trials=1)["rel_diff"] <= race.REL_TOLERANCE  # exported again

    from kestrel.export.onnx import export_onnx  # a traced call goes through the wrapper to eager

    assert [p.name for p in export_onnx(again, tmp_path / "out", entries=["forward"])] == ["forward.onnx"]

    monkeypatch.setenv("KESTREL_ONNXRUNTIME", "0")
    assert backend.runs_on(again, "forward", *x) == "eager"
    assert backend.attach(kestrel.load(directory)) == []


def test_a_program_that_misses_the_tolerance_is_rejected(small_vit, own_calibration, monkeypatch):
    model = kestrel.load(small_vit())
    x = _inputs()
    real = backend.load_program

    def off_by_a_little(path):
        program = real(path)
        return lambda *args: program(*args) * (1 + 1e-4)

    monkeypatch.setattr(backend, "load_program", off_by_a_little)
    monkeypatch.setenv("KESTREL_ONNXRUNTIME", "always")
    result = race.race_entry(model, "forward", x, trials=1)
    assert result["kernel"] == "eager"
    assert "differs from eager" in result["rejected"] and result["rel_diff"] > race.REL_TOLERANCE
    assert backend.runs_on(model, "forward", *x) == "eager"


@pytest.mark.filterwarnings("ignore::kestrel.errors.KestrelWarning")  # 'bf16 will be slow' on some CPUs
def test_only_f32_checkpoints_take_part(small_vit, own_calibration):
    directory = small_vit()
    assert backend.ineligible(kestrel.load(directory)) is None
    assert "bf16" in backend.ineligible(kestrel.load(directory, dtype="bf16"))
    assert "quantized" in backend.ineligible(kestrel.load(directory, quantize="int8"))
    result = race.race_entry(kestrel.load(directory, dtype="bf16"), "forward", _inputs())
    assert result["kernel"] == "eager" and "bf16" in result["skipped"]


def test_the_setting_names_its_values(monkeypatch):
    monkeypatch.setenv("KESTREL_ONNXRUNTIME", "sometimes")
    with pytest.raises(SettingError, match="KESTREL_ONNXRUNTIME='sometimes'"):
        onnxruntime_entries()
    monkeypatch.setenv("KESTREL_ONNXRUNTIME", "1")
    assert onnxruntime_entries() == "auto"


def test_doctor_races_the_entry_and_prints_the_choice(small_vit, own_calibration, capsys):
    from kestrel.cli.main import main

    assert main(["doctor", "--model", str(small_vit()), "--onnxruntime", "--threads", "1", "--size", "64"]) == 0
    out = capsys.readouterr().out
    assert "eager against its onnxruntime export" in out
    assert "forward f32[1, 3, 32, 32]: " in out and "largest difference" in out
    assert main(["doctor", "--threads", "1", "--size", "64"]) == 0
    assert "onnxruntime vit::Model@" in capsys.readouterr().out  # the cached choices list it
    assert main(["doctor", "--reset"]) == 0
    assert "removed 1 cached onnxruntime program(s)" in capsys.readouterr().out
    assert not backend.remove_programs()
    assert main(["doctor", "--onnxruntime"]) == 2
    assert "--onnxruntime races a model's entry: give the model with --model" in capsys.readouterr().err


def test_each_path_of_a_race_is_timed_after_the_one_before_has_settled(monkeypatch):
    """onnxruntime's threads spin for a while after a run; a path timed in that window pays for it. So the
    race idles before each path's calls: here the clock shows the settle before every path of every round."""
    from kestrel.runtime import race as timing

    events: list[str] = []
    monkeypatch.setattr(timing.time, "sleep", lambda s: events.append(f"sleep {s}"))
    paths = {"a": lambda: events.append("a"), "b": lambda: events.append("b")}
    best = timing.best_times(paths, (), {}, trials=2, calls=2)
    assert set(best) == {"a", "b"}
    settle = f"sleep {timing.SETTLE_S}"
    assert events == [settle, "a", "a", settle, "b", "b", settle, "b", "b", settle, "a", "a"]
