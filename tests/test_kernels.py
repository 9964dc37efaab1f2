"""Kernel choice by measurement: every candidate is correct, the choice is cached per machine key,
every path the calibration may pick keeps parity, and the fused q/k/v projection keeps the parameters."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import ViTConfig, ViTForImageClassification

import kestrel
from kestrel.kernels import calibration as calibrate
from kestrel.kernels import gemm as kernels
from kestrel.kernels import settings
from kestrel.kernels.weights import WEIGHTS, adjacent
from kestrel.std import ops
from reference import rel_diff, resident_pages, seeded


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Each test measures into its own cache directory, never the user's."""
    monkeypatch.setenv("KESTREL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KESTREL_LINEAR", raising=False)
    monkeypatch.delenv("KESTREL_CALIBRATE", raising=False)
    # the machine is taken as quiet: a test that counts measurements must not see one re-done because
    # another process ran meanwhile (the disturbed case has its own test)
    monkeypatch.setattr(kernels, "others_share", lambda fn: (fn(), 0.0))
    calibrate.forget()
    yield
    calibrate.forget()


def _data(m=300, k=96, n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)


@pytest.mark.parametrize("name", sorted(kernels.KERNELS))
def test_every_candidate_matches_f_linear(name):
    x, w, b = _data()
    ref = F.linear(x, w, b)
    for bias in (b, None):
        out = kernels.KERNELS[name].run(x, w, bias)
        assert out.shape == ref.shape
        assert rel_diff(out, F.linear(x, w, bias)) < 1e-6


@pytest.mark.parametrize("name", sorted(kernels.KERNELS))
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_a_linear_with_its_gelu_matches_the_two_ops_on_every_kernel(monkeypatch, name, approximate):
    monkeypatch.setenv("KESTREL_LINEAR", name)
    monkeypatch.setenv("KESTREL_WEIGHT_COPIES", "1")  # a packing kernel may copy this in-memory weight
    x, w, b = _data()
    w = torch.nn.Parameter(w, requires_grad=False)
    fused_calls = []
    if kernels.KERNELS[name].run_gelu_tanh is not None:  # count the calls that took the GEMM's post-op
        fused = kernels.KERNELS[name].run_gelu_tanh
        monkeypatch.setitem(kernels.KERNELS, name, dataclasses.replace(
            kernels.KERNELS[name], run_gelu_tanh=lambda *a: fused_calls.append(1) or fused(*a)))
    with torch.no_grad():
        for bias in (b, None):
            want = F.gelu(F.linear(x, w, bias), approximate=approximate)
            out = ops.linear_gelu(x.view(3, 100, 96), w, bias, approximate)
            assert out.shape == (3, 100, 200)
            assert rel_diff(out.view(300, 200), want) < 1e-6
    # oneDNN's kernels apply the tanh GELU inside the GEMM; the exact GELU and other kernels run it after
    expected = 2 if approximate == "tanh" and name.startswith("onednn") else 0
    assert len(fused_calls) == expected


def test_a_linear_with_its_gelu_keeps_the_two_ops_in_graphs_and_int8():
    x, w, b = _data()
    w.requires_grad_(True)
    out = ops.linear_gelu(x, w, b, "tanh")  # autograd records the plain ops
    out.sum().backward()
    assert w.grad is not None
    assert rel_diff(out.detach(), F.gelu(F.linear(x, w.detach(), b), approximate="tanh")) < 1e-6
    if kernels.int8_available():
        q = torch.nn.Parameter(w.detach().clone(), requires_grad=False)
        kernels.mark_int8(q)
        with torch.no_grad():
            y = ops.linear_gelu(x, q, b, "tanh")
        assert rel_diff(y, F.gelu(F.linear(x, q, b), approximate="tanh")) < 0.05  # int8's error, not f32's


def _counting_ways(monkeypatch, name):
    """Calls of each tanh-GELU placement (the kernel's post-op, the two passes after a GEMM)."""
    calls = []
    if kernels.KERNELS[name].run_gelu_tanh is not None:
        fused = kernels.KERNELS[name].run_gelu_tanh
        monkeypatch.setitem(kernels.KERNELS, name, dataclasses.replace(
            kernels.KERNELS[name], run_gelu_tanh=lambda *a: calls.append("post-op") or fused(*a)))
    for way, gelu_pass in list(kernels._TANH_PASSES.items()):
        monkeypatch.setitem(kernels._TANH_PASSES, way,
                            lambda y, way=way, gelu_pass=gelu_pass: calls.append(way) or gelu_pass(y))
    return calls


@pytest.mark.parametrize("name", ["onednn", "torch"])
def test_where_the_tanh_gelu_runs_is_measured_per_shape_and_kept_beside_its_kernel(monkeypatch, name):
    if name not in kernels.KERNELS:
        pytest.skip(f"{name} is not in this torch build")
    x, w, b = _data()
    calls = _counting_ways(monkeypatch, name)
    raced = []
    real = kernels.measure_gelu

    def measure_gelu(*args, **kw):
        raced.append(1)
        return real(*args, **kw, budget_s=0.01)

    monkeypatch.setattr(kernels, "measure_gelu", measure_gelu)
    table = calibrate.table()
    table.put(300, 200, 96, True, {"kernel": name, "gflops": {name: 1.0}})
    want = F.gelu(F.linear(x, w, b), approximate="tanh")
    ways = ["post-op", "sigmoid", "torch"] if name == "onednn" else ["sigmoid", "torch"]
    with torch.no_grad():
        assert rel_diff(ops.linear_gelu(x, w, b, "tanh"), want) < 1e-6
        assert len(raced) == 1  # the first call raced the placements the kernel allows
        verdict = table.entry(300, 200, 96, True)["gelu_tanh"][name]
        assert sorted(verdict["ms"]) == sorted(ways) and all(t > 0 for t in verdict["ms"].values())
        assert verdict["way"] in ways
        calls.clear()  # the race's own calls went through the same functions
        assert rel_diff(ops.linear_gelu(x, w, b, "tanh"), want) < 1e-6
        assert calls == [verdict["way"]] and len(raced) == 1
        # kept in the file: a new process follows the recorded way without racing
        saved = json.loads(table.path.read_text())["shapes"][calibrate.shape_key(300, 200, 96, True)]
        assert saved["gelu_tanh"][name]["way"] == verdict["way"]
        text = "\n".join(calibrate.format_choices([(calibrate.shape_key(300, 200, 96, True), saved)]))
        assert f"tanh GELU: {verdict['way']}" in text  # kestrel doctor prints it under the shape
        for way in ways:
            calibrate.forget()
            calibrate.table().entry(300, 200, 96, True)["gelu_tanh"][name]["way"] = way
            calls.clear()
            assert rel_diff(ops.linear_gelu(x, w, b, "tanh"), want) < 1e-6
            assert calls == [way] and len(raced) == 1


@pytest.mark.skipif("onednn" not in kernels.KERNELS, reason="oneDNN's matmul is not in this torch build")
def test_a_gelu_placement_raced_while_others_took_the_cores_serves_this_process_only(monkeypatch):
    x, w, b = _data()
    monkeypatch.setattr(kernels, "others_share", lambda fn: (fn(), 0.9))
    table = calibrate.table()
    table.put(300, 200, 96, True, {"kernel": "onednn", "gflops": {"onednn": 1.0}})
    with torch.no_grad():
        out = ops.linear_gelu(x, w, b, "tanh")
    assert rel_diff(out, F.gelu(F.linear(x, w, b), approximate="tanh")) < 1e-6
    assert kernels.WEIGHTS.get("gelu-way", (w,), (300, True, torch.get_num_threads(), "onednn")) in kernels.GELU_WAYS
    saved = json.loads(table.path.read_text())["shapes"][calibrate.shape_key(300, 200, 96, True)]
    assert "gelu_tanh" not in saved and "gelu_tanh" not in table.entry(300, 200, 96, True)


def test_measure_times_every_candidate_and_rejects_a_wrong_one(monkeypatch):
    x, w, b = _data()
    wrong = kernels.Kernel("wrong", "test", lambda x, w, b: F.linear(x, w, b) * 1.001)
    monkeypatch.setitem(kernels.KERNELS, "wrong", wrong)
    res = kernels.measure(x, w, b, budget_s=0.01)
    assert "wrong" in res["rejected"] and "differs" in res["rejected"]["wrong"]
    assert set(res["gflops"]) == set(kernels.KERNELS) - {"wrong"}
    assert res["kernel"] in res["gflops"] and all(v > 0 for v in res["gflops"].values())
    assert res["kernel"] == kernels._pick(res["gflops"])
    # the fallback for weights that cannot be packed at no memory cost reads the weight in place
    in_place = {n: r for n, r in res["gflops"].items() if not kernels.KERNELS[n].copies_weight}
    assert res["in_place"] == kernels._pick(in_place) and not kernels.KERNELS[res["in_place"]].copies_weight


def _spied_weight(monkeypatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """A small GEMM's data, a kernel ``spy`` that lists the address of every weight it reads, and a cold-copy
    limit of 64 copies of that weight."""
    x, w, b = _data(m=8, k=64, n=64)
    seen: list[int] = []

    def spy(x, w, b):
        seen.append(w.data_ptr())
        return F.linear(x, w, b)

    monkeypatch.setitem(kernels.KERNELS, "spy", kernels.Kernel("spy", "test", spy))
    monkeypatch.setattr(kernels, "COLD_BYTES", 64 * w.numel() * w.element_size())
    return x, w, b, seen


def test_measure_streams_cold_copies_of_a_small_weight_and_drops_them(monkeypatch):
    x, w, b, seen = _spied_weight(monkeypatch)
    monkeypatch.setattr(kernels, "CAL_ROUNDS", (3, 3))  # a budget that holds 64 copies, and just the fewest rounds
    kernels.measure(x, w, b, kernels=["torch", "spy"], budget_s=60.0)
    # the check call reads the weight itself; every timed pass reads it and its 63 copies once each
    assert len(set(seen)) == 64 and len(seen) == 1 + 64 * 3
    monkeypatch.setattr(kernels, "PASS_FLOPS", 1.0)  # a long GEMM: one weight per pass
    seen.clear()
    kernels.measure(x, w, b, kernels=["spy"], budget_s=60.0)
    assert set(seen) == {w.data_ptr()}


def test_a_pass_shrinks_to_fit_the_calibration_budget(monkeypatch):
    """KESTREL_CALIBRATION_BUDGET=0 (the test suite's) races every candidate on one copy, its fewest rounds; a
    budget under the default shrinks the pass in proportion, the default keeps every cold copy."""
    x, w, b, seen = _spied_weight(monkeypatch)
    monkeypatch.setenv("KESTREL_CALIBRATION_BUDGET", "0")
    res = kernels.measure(x, w, b, kernels=["torch", "spy"])
    assert set(seen) == {w.data_ptr()} and len(seen) == 1 + kernels.CAL_ROUNDS[0]
    assert set(res["gflops"]) == {"torch", "spy"}
    assert kernels._pass_copies(w, 1.0, settings.DEFAULT_CALIBRATION_BUDGET_S) == 64
    assert kernels._pass_copies(w, 1.0, settings.DEFAULT_CALIBRATION_BUDGET_S / 4) == 16
    assert kernels._pass_copies(w, 1.0, 10.0) == 64
    for bad in ("-1", "soon", "inf"):
        monkeypatch.setenv("KESTREL_CALIBRATION_BUDGET", bad)
        with pytest.raises(settings.SettingError, match="KESTREL_CALIBRATION_BUDGET"):
            kernels.measure(x, w, b, kernels=["torch", "spy"])


def test_two_packing_kernels_are_each_timed_on_their_own_layouts(monkeypatch):
    """A weight keeps one packed layout, and the timing copies are shared: two packing kernels in the race
    replace each other's layouts. Each packs its own before its pass, untimed, and never inside one (there each
    was timed clean in one round of three, and a slow round chose the wrong kernel for a model's shape)."""
    from kestrel.kernels import library

    x, w, b = _data(m=8, k=64, n=64)
    events: list[tuple[str, str]] = []

    def packing(name: str) -> library.Kernel:
        def pack(weight, rows):
            events.append(("pack", name))
            return weight.clone()

        def run_packed(x, layout, weight, bias, rows):
            events.append(("run", name))
            return F.linear(x, layout, bias)

        return library.Kernel(name, "test", library._packing(name), pack=pack, run_packed=run_packed, any_rows=True)

    for name in ("pack-a", "pack-b"):
        monkeypatch.setitem(kernels.KERNELS, name, packing(name))
    monkeypatch.setattr(kernels, "COLD_BYTES", 16 * w.numel() * w.element_size())
    monkeypatch.setattr(kernels, "CAL_ROUNDS", (3, 3))
    kernels.measure(x, w, b, kernels=["torch", "pack-a", "pack-b"], budget_s=60.0)
    runs = [e for e in events if e[0] == "run"]
    assert len(runs) == 2 * (1 + 16 * 3)  # the check call, then every timed pass
    packs = [e for e in events if e[0] == "pack"]
    assert len(packs) > 2 * 16  # the two did replace each other's layouts between rounds
    inside = [i for i in range(1, len(events)) if events[i][0] == "pack" and events[i - 1] == ("run", events[i][1])]
    assert not inside, f"{len(inside)} packs inside a timed pass"


def test_the_pick_prefers_the_default_within_noise():
    assert kernels._pick({"torch": 100, "a": 102, "packed": 101}) == "torch"   # within noise: the default
    assert kernels._pick({"torch": 100, "a": 110, "packed": 115}) == "packed"
    assert kernels._pick({"a": 50}) == "a"
    assert kernels._pick({}) == "torch"


needs_packed = pytest.mark.skipif("mkl-packed" not in kernels.KERNELS or not sys.platform.startswith("linux"),
                                  reason="MKL's packed GEMM (x86 builds of torch) and Linux's /proc")


def _file_weights(tmp_path, *shapes):
    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    save_file({f"w{i}": torch.randn(*s, generator=g) for i, s in enumerate(shapes)}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        return [torch.nn.Parameter(f.get_tensor(f"w{i}"), requires_grad=False) for i in range(len(shapes))]


def _calibrated(monkeypatch, winner: str, fallback: str = "torch"):
    """Every shape calibrates to ``winner`` (the in-place fallback: ``fallback``), without timing."""
    def fake(x, w, b, kernels_=None, budget_s=0.0):
        return {"kernel": winner, "in_place": fallback, "gflops": {}, "rejected": {}, "rows": x.shape[0]}
    monkeypatch.setattr(kernels, "measure", fake)
    monkeypatch.setattr(kernels, "MIN_CALIBRATED_FLOPS", 0)


@needs_packed
def test_a_checkpoint_weight_runs_packed_in_the_place_of_its_file_pages(tmp_path, monkeypatch):
    from kestrel.kernels.pages import file_pages

    _calibrated(monkeypatch, "mkl-packed", "onednn" if "onednn" in kernels.KERNELS else "torch")
    monkeypatch.delenv("KESTREL_WEIGHT_COPIES", raising=False)
    (w,) = _file_weights(tmp_path, (512, 256))
    x, b = torch.randn(64, 256), torch.randn(512)
    want = F.linear(x, w, b)
    with torch.no_grad():
        assert kernels.choose(x, w, b) == "mkl-packed"
        assert rel_diff(ops.linear(x, w, b), want) < 1e-6
    assert WEIGHTS.get("packed", (w,)) is not None and file_pages(w)
    assert resident_pages(w) == 0  # the weight's own pages were handed back after packing
    # the same shape on a weight built in memory: packing it would be a second copy, so the in-place
    # kernel runs, unless KESTREL_WEIGHT_COPIES=1 allows the copy
    heap = torch.nn.Parameter(w.clone(), requires_grad=False)
    in_place = "onednn" if "onednn" in kernels.KERNELS else "torch"
    with torch.no_grad():
        assert kernels.choose(x, heap, b) == in_place
        monkeypatch.setenv("KESTREL_WEIGHT_COPIES", "1")
        assert kernels.choose(x, heap, b) == "mkl-packed"
        monkeypatch.delenv("KESTREL_WEIGHT_COPIES")
        assert kernels.choose(x, w[:], b) == in_place  # a view made per call would be packed per call
        # written to after packing: no longer the file's pages; the stale packed copy goes, numbers follow
        w.mul_(2)
        assert kernels.choose(x, w, b) != "mkl-packed" and WEIGHTS.get("packed", (w,)) is None
        assert rel_diff(ops.linear(x, w, b), F.linear(x, w, b)) < 1e-6


@needs_packed
def test_a_packed_weight_keeps_one_layout(tmp_path, monkeypatch):
    _calibrated(monkeypatch, "mkl-packed")
    (w,) = _file_weights(tmp_path, (256, 128))
    with torch.no_grad():
        for rows in (8, 32, 8):
            x = torch.randn(rows, 128)
            assert rel_diff(ops.linear(x, w), F.linear(x, w)) < 1e-6
            assert WEIGHTS.get("packed", (w,))[0] == ("mkl-packed", rows)


@needs_packed
def test_fused_projection_packs_as_one_gemm_in_the_place_of_the_parts_pages(tmp_path, monkeypatch):
    _calibrated(monkeypatch, "mkl-packed")
    ws = _file_weights(tmp_path, (96, 64), (96, 64), (96, 64))
    bs = [torch.randn(96), None, torch.randn(96)]
    x = torch.randn(2, 10, 64)
    wants = [F.linear(x, w, b) for w, b in zip(ws, bs)]  # read now: reading a weight faults its pages in
    with torch.no_grad():
        for _ in range(2):
            outs = ops.fused_linear(x, ws, bs)
            for o, want in zip(outs, wants):
                assert rel_diff(o, want) < 1e-6
    group = WEIGHTS.get("packed-group", ws)
    assert group.rows == 20 and group.shape.shape == (288, 64)
    assert adjacent(ws) is None  # no fused buffer: the parameters stay where they were
    assert all(resident_pages(w) == 0 for w in ws)  # their pages handed back to the file
    with torch.no_grad():  # written to: the group is not used any more, and the numbers follow
        ws[1].mul_(3)
        outs = ops.fused_linear(x, ws, bs)
    assert rel_diff(outs[1], F.linear(x, ws[1])) < 1e-6


@needs_packed
def test_fused_projection_of_packed_parts_runs_them_apart(tmp_path, monkeypatch):
    def fake(x, w, b, kernels_=None, budget_s=0.0):  # the parts' shape packs, the fused one does not
        name = "torch" if w.shape[0] == 288 else "mkl-packed"
        return {"kernel": name, "in_place": "torch", "gflops": {}, "rejected": {}, "rows": x.shape[0]}
    monkeypatch.setattr(kernels, "measure", fake)
    monkeypatch.setattr(kernels, "MIN_CALIBRATED_FLOPS", 0)
    ws = _file_weights(tmp_path, (96, 64), (96, 64), (96, 64))
    bs = [torch.randn(96) for _ in ws]
    x = torch.randn(2, 10, 64)
    with torch.no_grad():
        outs = ops.fused_linear(x, ws, bs)
    for o, w, b in zip(outs, ws, bs):
        assert rel_diff(o, F.linear(x, w, b)) < 1e-6
    assert adjacent(ws) is None  # not concatenated: each part packed in its file pages' place
    assert all(WEIGHTS.get("packed", (w,)) is not None for w in ws)



def test_choice_is_measured_once_and_cached_per_thread_count(tmp_path, monkeypatch):
    x, w, b = _data(m=512, k=256, n=256)
    calls = []
    real = kernels.measure
    monkeypatch.setattr(kernels, "measure", lambda *a, **k: calls.append(1) or real(*a, **k, budget_s=0.01))
    with torch.no_grad():
        y = ops.linear(x, w, b)
        ops.linear(x, w, b)
    assert len(calls) == 1
    assert rel_diff(y, F.linear(x, w, b)) < 1e-6
    files = list((tmp_path / "cache" / "calibration").glob("*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["key"]["threads"] == torch.get_num_threads() and data["key"]["cpu"] == calibrate.cpu_model()
    assert data["key"]["torch"] == torch.__version__
    assert set(data["shapes"]) == {"512x256x256+b"}
    # a fresh process (forget) reads the file instead of measuring again
    calibrate.forget()
    with torch.no_grad():
        ops.linear(x, w, b)
    assert len(calls) == 1
    # another thread count is another machine key: measured again, in its own file
    other = torch.get_num_threads() + 1
    assert calibrate.key_digest(calibrate.machine_key(other)) != files[0].stem
    assert calibrate.table(other).get(512, 256, 256, True) is None


def test_a_linear_decides_once_per_weight_and_row_count_until_written_or_forgotten(monkeypatch):
    x, w, b = _data()
    calls = []
    real = kernels.choose
    monkeypatch.setattr(kernels, "choose", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("KESTREL_LINEAR", "torch")
    with torch.no_grad():
        ops.linear(x, w, b)
        ops.linear(x, w, b)
        assert len(calls) == 1  # the steady state: one lookup, no settings or table read
        ops.linear(x[:10], w, b)
        assert len(calls) == 2  # another row count is decided apart
        w.mul_(1.0)
        ops.linear(x, w, b)
        assert len(calls) == 3  # a weight written to is decided again
        calibrate.forget()
        ops.linear(x, w, b)
        assert len(calls) == 4  # and all of them after a forget (settings changed mid-process)
        threads = torch.get_num_threads()
        torch.set_num_threads(threads + 1)
        try:
            ops.linear(x, w, b)
        finally:
            torch.set_num_threads(threads)
        assert len(calls) == 5  # another thread count has its own calibration


def test_a_choice_measured_while_others_took_the_cores_serves_this_process_only(monkeypatch):
    """A calibration timed while other processes competed for the cores ranks the kernels by the noise: kept
    for the process that measured it (measuring again under the same load would not help), measured again by
    the next one."""
    from kestrel.kernels import contention

    x, w, b = _data(m=512, k=256, n=256)
    calls = []
    real = kernels.measure
    monkeypatch.setattr(kernels, "measure", lambda *a, **k: calls.append(1) or real(*a, **k, budget_s=0.01))
    share = [0.6]
    monkeypatch.setattr(kernels, "others_share", lambda fn: (fn(), share[0]))
    with torch.no_grad():
        ops.linear(x, w, b)
        calibrate.forget_decisions()
        ops.linear(x, w, b)
    assert len(calls) == 1  # this process keeps it
    entry = calibrate.table().entry(512, 256, 256, True)
    assert entry["disturbed"] and entry["others"] == 0.6
    calibrate.forget()  # a fresh process reads the file, skips the disturbed choice and measures again
    share[0] = 0.01
    with torch.no_grad():
        ops.linear(x, w, b)
    assert len(calls) == 2
    entry = calibrate.table().entry(512, 256, 256, True)
    assert "disturbed" not in entry and entry["others"] == 0.01
    calibrate.forget()
    with torch.no_grad():
        ops.linear(x, w, b)
    assert len(calls) == 2  # a quiet measurement stands
    _, measured = contention.others_share(lambda: sum(range(10**6)))
    assert measured is None or 0.0 <= measured <= 1.0


def test_a_corrupt_cache_is_measured_again(tmp_path):
    t = calibrate.table()
    t.path.parent.mkdir(parents=True, exist_ok=True)
    t.path.write_text("{not json")
    calibrate.forget()
    t = calibrate.table()
    assert t.load_error and t.get(1, 2, 3, False) is None


def test_forced_kernel_and_switches(monkeypatch):
    x, w, b = _data()
    monkeypatch.setenv("KESTREL_LINEAR", "onednn" if "onednn" in kernels.KERNELS else "torch")
    assert kernels.choose(x, w, b) == kernels.forced()
    monkeypatch.setenv("KESTREL_LINEAR", "no-such-gemm")
    with pytest.raises(ValueError, match=r"KESTREL_LINEAR='no-such-gemm'.*available: torch"):
        kernels.choose(x, w, b)
    monkeypatch.setenv("KESTREL_LINEAR", "auto")
    monkeypatch.setenv("KESTREL_CALIBRATE", "0")
    assert kernels.choose(x, w, b) == "torch"
    assert not calibrate.table().shapes  # nothing measured, nothing written


def test_autograd_tracing_and_other_dtypes_keep_f_linear():
    x, w = torch.randn(4, 8), torch.nn.Parameter(torch.randn(6, 8))
    assert not kernels.eager_ok(x, w)  # a weight that wants gradients
    y = ops.linear(x, w)
    y.sum().backward()
    assert w.grad is not None
    with torch.no_grad():
        assert kernels.eager_ok(x, w)
    assert not kernels.eager_ok(x.double(), w.double())

    compiled = torch.compile(_Linear(w.detach()), backend="aot_eager", fullgraph=True)
    assert torch.allclose(compiled(x), F.linear(x, w.detach()))
    graph = torch.export.export(_Linear(w.detach()), (x,)).graph
    targets = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert not any("mkldnn" in t or "mkl" in t for t in targets), targets


class _Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return ops.linear(a, self.weight)


def test_fused_linear_views_the_parameters_in_one_buffer():
    g = torch.Generator().manual_seed(1)
    ws = [torch.nn.Parameter(torch.randn(8, 5, generator=g), requires_grad=False) for _ in range(3)]
    bs = [torch.nn.Parameter(torch.randn(8, generator=g), requires_grad=False) for _ in range(3)]
    before = [w.clone() for w in ws]
    x = torch.randn(2, 7, 5, generator=g)
    outs = ops.fused_linear(x, ws, bs)
    for o, w, b in zip(outs, ws, bs):
        assert rel_diff(o, F.linear(x, w, b)) < 1e-6
    assert all(torch.equal(a, w) for a, w in zip(before, ws))  # same numbers
    whole = adjacent(ws)
    assert whole is not None and whole.shape == (24, 5)  # now one buffer, no copy on later calls
    assert ws[1].untyped_storage().data_ptr() == ws[0].untyped_storage().data_ptr()
    # a missing bias is zeros for that part
    outs = ops.fused_linear(x, ws, [bs[0], None, bs[2]])
    assert rel_diff(outs[1], F.linear(x, ws[1])) < 1e-6


@pytest.mark.parametrize("name", sorted(kernels.KERNELS))
def test_vit_parity_with_every_kernel_the_calibration_may_pick(tmp_path, monkeypatch, name):
    monkeypatch.setenv("KESTREL_LINEAR", name)
    cfg = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
               patch_size=8, num_labels=5)
    ref = seeded(lambda: ViTForImageClassification(ViTConfig(**cfg)))
    ref.save_pretrained(tmp_path / "ckpt")
    ours = kestrel.load(tmp_path / "ckpt")
    names = list(ours.state_dict())
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert rel_diff(ours.forward(x), ref(pixel_values=x).logits) <= 1e-4
    assert list(ours.state_dict()) == names  # the fused projection kept every parameter path
    sd = ref.state_dict()
    assert torch.equal(ours.state_dict()["layers.1.attention.key.weight"],
                       sd["vit.layers.1.attention.k_proj.weight"])


@needs_packed
def test_packed_weights_follow_a_load_state_dict(tmp_path, monkeypatch):
    """Weights packed (their file pages handed back) then overwritten in place: the next forward uses the
    new numbers, and reading the parameters gives the file's (then the new) values."""
    monkeypatch.setenv("KESTREL_LINEAR", "mkl-packed")
    cfg = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
               patch_size=8, num_labels=5)
    for seed, name in ((0, "a"), (1, "b")):
        torch.manual_seed(seed)
        ViTForImageClassification(ViTConfig(**cfg)).save_pretrained(tmp_path / name)
    a, b = kestrel.load(tmp_path / "a"), kestrel.load(tmp_path / "b")
    x = torch.randn(2, 3, 32, 32)
    before = {k: v.clone() for k, v in a.state_dict().items()}
    with torch.no_grad():
        want_b = b.forward(x)
        a.forward(x)  # packs a's weights and releases their pages
        assert all(torch.equal(v, before[k]) for k, v in a.state_dict().items())  # read back from the file
        a.load_state_dict(b.state_dict())
        assert rel_diff(a.forward(x), want_b) == 0.0
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


def test_calibrate_model_reports_every_shape(tmp_path):
    # two layers: the last runs its MLP for the class tokens alone (40 rows), the first for every token
    cfg = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
               patch_size=8, num_labels=5)
    seeded(lambda: ViTForImageClassification(ViTConfig(**cfg))).save_pretrained(tmp_path / "ckpt")
    ours = kestrel.load(tmp_path / "ckpt")
    x = torch.randn(40, 3, 32, 32)  # 40 x 17 rows: the projections are big enough to be measured
    rows = calibrate.calibrate_model(lambda: ours.forward(x))
    shapes = [s for s, _ in rows]
    assert "680x192x64+b" in shapes and "680x128x64+b" in shapes and "40x5x64+b" in shapes
    assert "40x128x64+b" in shapes  # the last layer's MLP, class tokens only
    measured = dict(rows)["680x192x64+b"]
    assert measured["kernel"] in kernels.KERNELS and set(measured["gflops"]) <= set(kernels.KERNELS)
    text = "\n".join(calibrate.format_choices(rows))
    assert "680x192x64+b" in text and "not measured" in text  # the tiny head is not timed


def test_int8_is_opt_in_close_and_keeps_the_f32_parameters(tmp_path):
    if not kernels.int8_available():
        pytest.skip("no quantized engine in this torch build")
    cfg = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
               patch_size=8, num_labels=5)
    seeded(lambda: ViTForImageClassification(ViTConfig(**cfg))).save_pretrained(tmp_path / "ckpt")
    f32 = kestrel.load(tmp_path / "ckpt")
    q = kestrel.load(tmp_path / "ckpt", quantize="int8")
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        a, b = f32.features(x), q.features(x)
        b2 = q.features(x)  # the second call reuses the packed weights (and the fused q/k/v buffer)
    assert 1e-5 < rel_diff(b, a) < 0.2  # int8 really ran, and stayed close
    assert torch.equal(b, b2)
    assert float(F.cosine_similarity(a.flatten(0, 1), b.flatten(0, 1)).mean()) > 0.999
    for (k1, v1), (k2, v2) in zip(f32.state_dict().items(), q.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)  # the parameters stay f32 and exact
    with pytest.raises(kestrel.models.cards.CardError, match="quantize='int4'"):
        kestrel.load(tmp_path / "ckpt", quantize="int4")


@pytest.mark.parametrize("channels_last", [False, True])
def test_transposed_2x2_convolution_as_one_gemm_matches_torch(channels_last):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 24, 5, 7, generator=g)
    if channels_last:  # SAM's decoder hands its image tokens over this way
        x = x.contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(24, 8, 2, 2, generator=g), torch.randn(8, generator=g)
    for bias in (b, None):
        ref = F.conv_transpose2d(x, w, bias, stride=2)
        with torch.inference_mode():
            out = ops.conv_transpose2x2(x, w, bias)
        assert out.shape == (2, 8, 10, 14)
        assert out.is_contiguous(memory_format=torch.channels_last)  # the GEMM path ran (torch's keeps NCHW)
        assert rel_diff(out, ref) < 1e-6
    # int8 asked for the convolution's weight: its GEMM (on the derived [4 * Cout, Cin] rows) runs int8
    if kernels.int8_available():
        wq = torch.nn.Parameter(w.clone(), requires_grad=False)
        kernels.mark_int8(wq)
        with torch.inference_mode():
            ref = F.conv_transpose2d(x, w, b, stride=2)
            out = ops.conv_transpose2x2(x, wq, b)
        assert 1e-5 < rel_diff(out, ref) < 0.05  # quantised: close, not exact
    # autograd keeps torch's own op (and its gradient)
    wg = w.clone().requires_grad_(True)
    ops.conv_transpose2x2(x, wg, b).sum().backward()
    assert wg.grad is not None and wg.grad.shape == w.shape


@pytest.mark.parametrize("channels_last", [False, True])
def test_channel_layer_norm_matches_the_reference_formula_in_either_layout(channels_last):
    g = torch.Generator().manual_seed(5)
    x = 3 * torch.randn(2, 16, 6, 9, generator=g) + 1
    if channels_last:  # as the transposed convolution leaves SAM's upscaled masks
        x = x.contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(16, generator=g), torch.randn(16, generator=g)
    mean = x.mean(1, keepdim=True)  # SAM's channels-first layer norm, as the reference writes it
    ref = w[:, None, None] * (x - mean) / torch.sqrt((x - mean).pow(2).mean(1, keepdim=True) + 1e-6) \
        + b[:, None, None]
    with torch.inference_mode():
        out = ops.layer_norm_chw(x, w, b, 1e-6)
    assert rel_diff(out, ref) < 1e-6
    # the fused pass keeps a channels-last map channels-last (the next GELU and convolution read it so)
    assert out.is_contiguous(memory_format=torch.channels_last) == channels_last
    wg = w.clone().requires_grad_(True)  # autograd keeps the formula, op by op
    ops.layer_norm_chw(x, wg, b, 1e-6).sum().backward()
    assert wg.grad is not None


def test_a_taller_input_takes_over_the_choice_measured_at_the_capped_rows(monkeypatch):
    """measure() times at most CAL_ROWS rows: a row count above it reuses what another tall one measured
    (SAM 2's memory attention grows by E x E rows a frame and must not measure on every frame)."""
    calls = []

    def fake(x, w, b, kernels_=None, budget_s=0.0):
        calls.append(x.shape[0])
        return {"kernel": "torch", "in_place": "torch", "gflops": {"torch": 1.0}, "rejected": {},
                "rows": min(x.shape[0], kernels.CAL_ROWS)}

    monkeypatch.setattr(kernels, "measure", fake)
    monkeypatch.setattr(kernels, "MIN_CALIBRATED_FLOPS", 0)
    w, b = torch.randn(24, 16), torch.randn(24)
    tall = kernels.CAL_ROWS + 8
    for rows in (tall, 2 * tall, 3 * tall):
        kernels.choose(torch.randn(rows, 16), w, b)
    assert calls == [tall]  # measured once; the others took it over, and are in the table as measured
    table = calibrate.table()
    assert table.entry(2 * tall, 24, 16, True)["rows"] == kernels.CAL_ROWS
    kernels.choose(torch.randn(kernels.CAL_ROWS, 16), w, b)  # at or under the cap: its own experiment
    kernels.choose(torch.randn(tall, 16), w, None)  # another shape (no bias)
    assert calls == [tall, kernels.CAL_ROWS, tall]


def test_int8_runs_only_where_it_measured_faster_than_the_shapes_f32_kernel(monkeypatch):
    if not kernels.int8_available():
        pytest.skip("no quantized engine in this torch build")
    x, w, b = _data(m=512, k=256, n=256)
    kernels.mark_int8(w)
    exact = F.linear(x, w, b)
    real_race = kernels._race
    verdict = {}

    def race(runs, copies, budget_s, prepare=None):  # the real race (every path runs), then the verdict asked for
        best, others = real_race(runs, copies, 0.01, prepare)
        if "int8" in runs:  # every int8 kernel (one per quantized engine) gets the verdict
            slow = max(best.values()) * 10
            best = {nm: (slow if nm.startswith("int8") == (verdict["int8"] == "slower") else t)
                    for nm, t in best.items()}
        return best, others

    monkeypatch.setattr(kernels, "_race", race)
    verdict["int8"] = "slower"
    with torch.no_grad():
        y = ops.linear(x, w, b)
    assert rel_diff(y, exact) < 1e-5  # int8 lost the race: the f32 kernel ran
    key = "int8 512x256x256+b"
    entry = calibrate.table().shapes[key]
    assert entry["kernel"] not in kernels.INT8_KERNELS
    assert set(entry["gflops"]) == {*kernels.INT8_KERNELS, entry["kernel"]}
    assert key in "\n".join(calibrate.format_choices([(key, entry)]))
    calibrate.reset()
    verdict["int8"] = "faster"
    with torch.no_grad():
        y = ops.linear(x, w, b)
    assert 1e-5 < rel_diff(y, exact) < 0.1  # int8 won: quantised, and close
    assert calibrate.table().shapes[key]["kernel"] in kernels.INT8_KERNELS


needs_onednn_packed = pytest.mark.skipif("onednn-packed" not in kernels.KERNELS, reason="no oneDNN weight reorder")


@needs_onednn_packed
def test_a_onednn_packed_weight_serves_every_row_count(tmp_path, monkeypatch):
    _calibrated(monkeypatch, "onednn-packed")
    (w,) = _file_weights(tmp_path, (256, 128))
    with torch.no_grad():
        for rows in (8, 32, 8):
            x = torch.randn(rows, 128)
            assert rel_diff(ops.linear(x, w), F.linear(x, w)) < 1e-6
            assert WEIGHTS.get("packed", (w,))[0] == ("onednn-packed", 8)  # packed once, at the first rows


def test_bf16_linears_are_calibrated_among_the_bf16_kernels_under_their_own_keys(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "MIN_CALIBRATED_FLOPS", 0)
    seen = []
    real = kernels.measure
    monkeypatch.setattr(kernels, "measure",
                        lambda x, w, b, *a, **k: seen.append(x.dtype) or real(x, w, b, budget_s=0.01))
    w = torch.nn.Parameter(torch.randn(96, 64).bfloat16(), requires_grad=False)
    b = torch.randn(96).bfloat16()
    x = torch.randn(40, 64).bfloat16()
    with torch.no_grad():
        got = ops.linear(x, w, b)
    want = F.linear(x.float(), w.float(), b.float())
    assert got.dtype == torch.bfloat16 and rel_diff(got.float(), want) < 1e-2
    assert seen == [torch.bfloat16]
    entry = calibrate.table().entry(40, 96, 64, True, torch.bfloat16)
    assert entry is not None and calibrate.table().entry(40, 96, 64, True) is None  # not an f32 choice
    assert set(entry["gflops"]) | set(entry["rejected"]) == set(kernels.kernels_for(torch.bfloat16))
    assert "mkl-packed" not in kernels.kernels_for(torch.bfloat16)
    assert kernels.packs_in_place(w)  # a converted half-precision weight may be packed (README: bf16)


def test_plain_f32_attention_keeps_the_fused_kernel_and_measures_nothing():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 32, generator=g) for _ in range(3))
    with torch.no_grad():
        assert torch.equal(ops.attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert not any(key.startswith("sdpa ") for key in calibrate.table().shapes)


def test_plain_bf16_attention_is_a_measured_choice_and_both_paths_agree():
    from kestrel.kernels import attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 32, generator=g).bfloat16() for _ in range(3))  # enough scores to time
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    tol = 2e-2
    key = attention.sdpa_key(q, k, v)
    assert key.startswith("sdpa bf16 ")
    with torch.no_grad():
        got = ops.attention(q, k, v)  # first call of the shape: both paths timed, the faster kept
        entry = calibrate.table().shapes[key]
        assert entry["kernel"] in ("fused", "gemm") and set(entry["seconds"]) == {"fused", "gemm"}
        assert rel_diff(got.float(), want) < tol
        for path in ("fused", "gemm"):  # whichever a machine picks keeps the numbers
            calibrate.DECIDED[key] = path
            assert rel_diff(ops.attention(q, k, v).float(), want) < tol
    with torch.enable_grad():  # autograd takes torch's kernel, never the measured path
        qg = q.detach().clone().requires_grad_()
        ops.attention(qg, k, v).float().sum().backward()
        assert qg.grad is not None


@needs_onednn_packed
def test_an_int8_fused_projection_runs_int8_where_its_f32_shape_packs(tmp_path, monkeypatch):
    if not kernels.int8_available():
        pytest.skip("no quantized engine in this torch build")
    _calibrated(monkeypatch, "onednn-packed")
    monkeypatch.setattr(kernels, "choose_int8", lambda x, w, b: "int8")
    ws = _file_weights(tmp_path, (96, 64), (96, 64), (96, 64))
    bs = [torch.randn(96) for _ in ws]
    for w in ws:
        kernels.mark_int8(w)
    x = torch.randn(2, 10, 64)
    wants = [F.linear(x, w, b) for w, b in zip(ws, bs)]
    with torch.no_grad():
        outs = ops.fused_linear(x, ws, bs)
    assert WEIGHTS.get("packed-group", ws) is None  # not the f32 packed group
    for o, want in zip(outs, wants):
        assert 1e-5 < rel_diff(o, want) < 0.05  # int8 ran, and stayed close


def test_each_quantized_engine_is_an_int8_kernel_with_its_own_pack(monkeypatch):
    if len(kernels.INT8_KERNELS) < 2:
        pytest.skip("one quantized engine here: nothing to choose between")
    x, w, b = _data(m=64, k=128, n=96)
    kernels.mark_int8(w)
    exact = F.linear(x, w, b)
    outs = {}
    for i, name in enumerate(kernels.INT8_KERNELS):  # each engine's kernel, as if it had won the race
        monkeypatch.setattr(kernels, "choose_int8", lambda x, w, b, name=name: name)
        calibrate.forget_decisions()
        with torch.no_grad():
            outs[name] = ops.linear(x, w, b)
        assert 1e-5 < rel_diff(outs[name], exact) < 0.05  # quantised, and close
        assert WEIGHTS.count("int8") == i + 1 and WEIGHTS.get("int8", (w, b), name) is not None
    first = next(iter(kernels.INT8_KERNELS))
    monkeypatch.setattr(kernels, "choose_int8", lambda x, w, b: first)
    calibrate.forget_decisions()
    with torch.no_grad():
        again = ops.linear(x, w, b)
    assert WEIGHTS.count("int8") == len(kernels.INT8_KERNELS)  # back to the first engine: its pack, not a new one
    assert torch.equal(again, outs[first])
    a, c = outs.values()
    assert rel_diff(a, c) < 0.05  # the same quantisation, two libraries


@pytest.mark.parametrize("shape, slabs", [((2, 24, 8, 128), False), ((2, 40, 8, 128), True), ((1, 40, 7, 9), False),
                                          ((3, 64, 1024), True), ((1, 64, 64, 64), True), ((1, 64, 4096), True)])
def test_a_transposed_token_map_copies_row_major_with_the_same_values(shape, slabs):
    """ops.contiguous copies a channels-first map viewed channels-last in slabs where its rows alias in
    the caches (a 4 KiB multiple: 8 x 128 and 1024 tokens, more than one slab of channels), a lone image's
    too, and as torch copies it elsewhere: same values."""
    from kestrel.kernels.layout import aliasing_rows

    x = torch.randn(*shape)
    view = x.flatten(2).transpose(1, 2) if x.dim() == 3 else x.permute(0, 2, 3, 1)
    assert (aliasing_rows(view) is not None) == slabs
    with torch.inference_mode():
        out = ops.contiguous(view)
    assert out.is_contiguous() and out.shape == view.shape and torch.equal(out, view)


def test_grid_fourier_is_computed_once_per_table_and_again_after_a_write():
    """SAM's dense positional encoding: the same numbers as its formula, kept for a parameter in eager
    inference (one tensor, every call), made again when the table is written to, never kept for a plain tensor."""
    import math

    table = torch.nn.Parameter(torch.randn(2, 8), requires_grad=False)
    side = 6
    g = (torch.arange(side, dtype=torch.float32) + 0.5) / side
    xy = torch.stack([g.unsqueeze(0).expand(side, side), g.unsqueeze(1).expand(side, side)], dim=-1)
    c = (xy * 2 - 1) @ table * (2 * math.pi)
    want = torch.cat([c.sin(), c.cos()], dim=-1).permute(2, 0, 1).unsqueeze(0)
    with torch.inference_mode():
        first = ops.grid_fourier(table, side)
        assert first.shape == (1, 16, side, side) and torch.equal(first, want)
        assert ops.grid_fourier(table, side) is first  # kept: one computation per table and side
        assert ops.grid_fourier(table, side + 1).shape == (1, 16, side + 1, side + 1)
    with torch.no_grad():
        table.mul_(2)  # a write: the kept encoding is stale
    with torch.inference_mode():
        again = ops.grid_fourier(table, side)
    assert again is not first and not torch.equal(again, first)
    plain = table.detach().clone()
    assert ops.grid_fourier(plain, side) is not ops.grid_fourier(plain, side)  # not a parameter: not kept


def _projections(g, d_in, width, dout, biases=(True, True, True, True)):
    shapes = [(width, d_in), (width, d_in), (width, d_in), (dout, width)]
    return [(torch.randn(*s, generator=g) * s[1] ** -0.5, torch.randn(s[0], generator=g) if b else None)
            for s, b in zip(shapes, biases)]


@pytest.mark.parametrize("nq,nk", [(7, 300), (300, 7)])  # few queries (SAM's tokens to the image) and few keys
@pytest.mark.parametrize("biases", [(True, True, True, True), (False, True, False, False)])
@pytest.mark.parametrize("key_bias", [False, True])
def test_folded_attention_is_the_projected_attention(nq, nk, biases, key_bias):
    from kestrel.kernels import folded_attention as folded

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 3, nq, 64, generator=g), torch.randn(2, 3, nk, 64, generator=g), \
        torch.randn(2, 3, nk, 64, generator=g)
    projections = _projections(g, 64, 32, 48, biases)
    bias = None
    if key_bias:
        bias = torch.zeros(2, 3, 1, nk)
        bias[0, 1, 0, 2] = -1e9  # a padding key
    want = folded.projected_reference(q.double(), k.double(), v.double(), 4,
                                      [(w.double(), b if b is None else b.double()) for w, b in projections],
                                      None if bias is None else bias.double())
    with torch.no_grad():
        got = folded.folded_attention(q, k, v, 4, projections, bias)
        projected = folded.projected_reference(q, k, v, 4, projections, bias)
    assert got.shape == (2, 3, nq, 48)
    # as close to float64 as the projected path is (both ~4e-7 here)
    assert rel_diff(got.double(), want) < max(3 * rel_diff(projected.double(), want), 2e-6)
    strided = [(w.t().contiguous().t(), b) for w, b in projections]  # weights that are not row-major
    with torch.no_grad():
        assert rel_diff(folded.folded_attention(q, k, v, 4, strided, bias), got) < 1e-6


def test_projected_attention_measures_the_fold_once_and_keeps_the_numbers(monkeypatch):
    from kestrel.kernels import folded_attention as folded

    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 7, 64, generator=g), torch.randn(1, 300, 64, generator=g), \
        torch.randn(1, 300, 64, generator=g)
    projections = _projections(g, 64, 64, 64)
    projected, folded_work = folded.work(7, 300, 64, 64, 64, 64, 64, 64, 2)
    assert folded_work <= folded.MAX_WORK * projected  # the case folding is for
    want = folded.projected_reference(q, k, v, 2, projections, None)
    from kestrel.kernels import attention

    monkeypatch.setattr(attention, "others_share", lambda fn: (fn(), 0.0))  # a quiet machine: its choice is kept
    races = []
    real = folded._measure
    monkeypatch.setattr(folded, "_measure", lambda *a: races.append(a[0]) or real(*a))
    with torch.no_grad():
        first = ops.projected_attention(q, k, v, 2, projections)
        key = folded.folded_key(q, k, v, 2, projections, False)
        entry = calibrate.table().shapes[key]
        assert entry["kernel"] in ("folded", "projected") and set(entry["seconds"]) == {"folded", "projected"}
        assert entry["error"] < folded.TOL
        assert rel_diff(first, want) < 1e-5
        calibrate.forget()  # a new process: the table on disk answers, nothing is timed again
        ops.projected_attention(q, k, v, 2, projections)
        for path in ("folded", "projected"):  # whichever a machine picks keeps the numbers
            calibrate.DECIDED[key] = path
            assert rel_diff(ops.projected_attention(q, k, v, 2, projections), want) < 1e-5
    assert races == [key]
    lines = calibrate.format_choices([(key, entry)])
    assert any(key in line and entry["kernel"] in line for line in lines)


def test_projected_attention_projects_where_folding_saves_nothing(monkeypatch):
    from kestrel.kernels import folded_attention as folded

    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 40, 64, generator=g), torch.randn(1, 50, 64, generator=g), \
        torch.randn(1, 50, 64, generator=g)
    projections = _projections(g, 64, 32, 64)
    monkeypatch.setattr(folded, "_measure", lambda *a: pytest.fail("raced a problem folding cannot help"))
    with torch.no_grad():
        got = ops.projected_attention(q, k, v, 4, projections)
    assert rel_diff(got, folded.projected_reference(q, k, v, 4, projections, None)) < 1e-5
    qg = q.clone().requires_grad_()  # autograd: the composition as written
    ops.projected_attention(qg, k.repeat(1, 6, 1), v.repeat(1, 6, 1), 4, projections).sum().backward()
    assert qg.grad is not None
    assert not any(s.startswith("folded ") for s in calibrate.table().shapes)


def test_projected_attention_with_calibration_off_projects_and_records_nothing(monkeypatch):
    from kestrel.kernels import folded_attention as folded

    monkeypatch.setenv("KESTREL_CALIBRATE", "0")
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 7, 64, generator=g), torch.randn(1, 300, 64, generator=g), \
        torch.randn(1, 300, 64, generator=g)
    projections = _projections(g, 64, 64, 64)
    folded_calls = []
    monkeypatch.setattr(folded, "folded_attention", lambda *a: folded_calls.append(a))
    with torch.no_grad():
        got = ops.projected_attention(q, k, v, 2, projections)
    assert folded_calls == [] and rel_diff(got, folded.projected_reference(q, k, v, 2, projections, None)) < 1e-5
    assert not any(s.startswith("folded ") for s in calibrate.table().shapes)


def test_the_fold_setting_turns_it_off_or_on_without_measuring(monkeypatch):
    from kestrel.kernels import folded_attention as folded

    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, 7, 64, generator=g), torch.randn(1, 300, 64, generator=g), \
        torch.randn(1, 300, 64, generator=g)
    projections = _projections(g, 64, 64, 64)
    want = folded.projected_reference(q, k, v, 2, projections, None)
    folds = []
    real = folded.folded_attention
    monkeypatch.setattr(folded, "folded_attention", lambda *a: folds.append(1) or real(*a))
    monkeypatch.setattr(folded, "_measure", lambda *a: pytest.fail("measured under a fixed KESTREL_FOLD"))
    with torch.no_grad():
        for mode, runs in (("0", 0), ("always", 1)):
            monkeypatch.setenv("KESTREL_FOLD", mode)
            folds.clear()
            assert rel_diff(ops.projected_attention(q, k, v, 2, projections), want) < 1e-5
            assert len(folds) == runs, mode
        monkeypatch.setenv("KESTREL_FOLD", "sometimes")
        with pytest.raises(settings.SettingError, match=r"KESTREL_FOLD='sometimes': expected 0 .*auto .*always"):
            ops.projected_attention(q, k, v, 2, projections)
    assert not any(s.startswith("folded ") for s in calibrate.table().shapes)
