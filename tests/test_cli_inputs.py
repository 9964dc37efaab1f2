"""Every input has a contract (issue 25): the thirteen mistakes of the report, each a clear exit 2 naming the
option or the file (or correct output: the 16-bit image, the Excel CSV), nothing left behind.

Most cases are refused before any model loads; ``kestrel.runtime.load.load`` is patched to fail the
test if one gets that far.
"""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Dinov2Config, Dinov2Model

from kestrel.cli.main import main
from reference import seeded


def run(capsys, *args: str) -> tuple[int, str]:
    """(exit status, first line of stderr) of ``kestrel ARGS`` in-process; no traceback allowed."""
    capsys.readouterr()  # what fixtures printed (save_pretrained's progress bars)
    try:
        code = main(list(args))
    except SystemExit as e:
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, (err.splitlines() or [""])[0]


@pytest.fixture
def no_load(monkeypatch):
    import kestrel.runtime.load as load_module

    monkeypatch.setattr(load_module, "load", lambda *a, **k: pytest.fail("loaded a model before refusing"))
    monkeypatch.delenv("KESTREL_DEBUG", raising=False)


@pytest.fixture(scope="module")
def photo(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("photo") / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(scope="module")
def dino(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("dino") / "dino"
    seeded(lambda: Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            image_size=28, patch_size=14))).save_pretrained(d)
    return d


# ------------------------------------------------------------------------------ internal errors (exit 3)

@pytest.mark.parametrize("name, write, reason", [
    ("empty.npy", lambda p: p.write_bytes(b""), "not a NumPy .npy array: an empty file"),
    ("truncated.npy", lambda p: p.write_bytes(_npy_bytes()[:200]), "not a NumPy .npy array: "),
    ("text.npy", lambda p: p.write_text("1 2 3\n"), "not a NumPy .npy array: no .npy header"),
    ("object.npy", lambda p: np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True),
     "not a NumPy .npy array: it holds Python objects"),
])
def test_mask_input_npy_that_is_not_an_array(capsys, no_load, photo, tmp_path, name, write, reason):
    bad = tmp_path / name
    write(bad)
    code, first = run(capsys, "segment", str(photo), "--point", "5,5", "--mask-input", str(bad),
                      "--out", str(tmp_path / "out"))
    assert code == 2 and first.startswith(f"kestrel segment: error: argument --mask-input: {bad}: {reason}"), first
    assert not (tmp_path / "out").exists()


def _npy_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, np.zeros((256, 256), np.float32))
    return buf.getvalue()


def test_everything_with_crops_on_a_one_pixel_image(capsys, no_load, tmp_path):
    tiny = tmp_path / "one.png"
    Image.new("RGB", (1, 1)).save(tiny)
    code, first = run(capsys, "segment", str(tiny), "--everything", "--crops-n-layers", "1", "--out",
                      str(tmp_path / "out"))
    assert (code, first) == (2, "kestrel segment: error: --crops-n-layers 1: the image is 1 x 1 pixels, too small "
                                "to cut into 2 x 2 crops (layer 1 would have empty crops); use a lower "
                                "--crops-n-layers")


@pytest.mark.parametrize("args, first", [
    (["bench", "m", "--repeat", "0"], "kestrel bench: error: argument --repeat: expected an integer from 1 to "
                                      "100000, got 0"),
    (["bench", "m", "--batch", "1,,8"], "kestrel bench: error: argument --batch: expected comma-separated integers "
                                        "from 1 to 4096 such as 1,8, got '1,,8' (an empty item)"),
    (["bench", "m", "--batch=-1"], "kestrel bench: error: argument --batch: expected an integer from 1 to 4096, "
                                   "got -1 in '-1'"),
    (["doctor", "--size", "0"], "kestrel doctor: error: argument --size: expected a GEMM size from 1 to 8192, got 0"),
    (["bench", "m", "--threads", "0"], "kestrel bench: error: argument --threads: expected a thread count from 1 to "
                                       "4096, got 0"),
    (["doctor", "--threads", "0"], "kestrel doctor: error: argument --threads: expected a thread count from 1 to "
                                   "4096, got 0"),
    (["embed", "x.png", "--out", "o/", "--threads", "0"], "kestrel embed: error: argument --threads: expected a "
                                                          "thread count from 1 to 4096, got 0"),
])
def test_counts_are_refused_by_the_same_kinds_everywhere(capsys, no_load, args, first):
    assert run(capsys, *args) == (2, first)


@pytest.mark.parametrize("text, reason", [
    ("", "empty; expected a preprocessor config holding a JSON object"),
    ("[1, 2]", "expected a JSON object {...}, got a JSON list"),
    ('{"do_resize": true, "size": {"height"', "not valid JSON: "),
])
def test_a_broken_preprocessor_config_names_the_file(tmp_path, text, reason):
    from kestrel.pipelines.images import ImagePreprocess
    from kestrel.pipelines.readers import ReadError

    path = tmp_path / "preprocessor_config.json"
    path.write_text(text)
    with pytest.raises(ReadError) as info:
        ImagePreprocess.from_file(path)
    assert str(info.value).startswith(f"{path}: {reason}")


def test_embed_with_a_broken_preprocessor_config_is_exit_2(capsys, photo, dino, tmp_path):
    import shutil

    d = tmp_path / "dino"
    shutil.copytree(dino, d)
    (d / "preprocessor_config.json").write_text('{"do_resize": tr')
    code, first = run(capsys, "embed", str(photo), "--model", str(d), "--out", str(tmp_path / "f.safetensors"),
                       "--quiet")
    assert code == 2 and first.startswith(f"kestrel embed: error: {d / 'preprocessor_config.json'}: not valid JSON")
    assert not (tmp_path / "f.safetensors").exists()


def test_a_dataset_folder_with_a_latin1_name(capsys, no_load, tmp_path, photo):
    from kestrel.pipelines.datasets import SourceError, read_source

    folder = tmp_path / "photos"
    folder.mkdir()
    Image.open(photo).save(folder / "ok.png")
    latin1 = os.fsencode(str(folder)) + b"/caf\xe9.png"
    with open(latin1, "wb") as f:
        Image.open(photo).save(f, format="PNG")
    with pytest.raises(SourceError, match=r"caf\\xe9.png: the file name is not valid UTF-8"):
        read_source(folder)
    code, first = run(capsys, "embed", str(folder), "--model", "dinov2-small", "--out", str(tmp_path / "feats"))
    assert code == 2 and "caf\\xe9.png: the file name is not valid UTF-8" in first, first
    assert not (tmp_path / "feats").exists()


def _vit_onnx_export(folder: Path) -> None:
    """The manifest ``kestrel export vit-... --target onnx`` writes (files as a list of rows)."""
    folder.mkdir()
    (folder / "forward.onnx").write_bytes(b"onnx")
    (folder / "manifest.json").write_text(json.dumps({
        "format": "kestrel-onnx/1", "model": "vit::ViTModel", "generics": {"Height": 224}, "batch": 1,
        "exporter": "torch.onnx.export(dynamo=True)", "files": [{"file": "forward.onnx", "entry": "forward"}]}))


def _edge_export(folder: Path, size: int) -> None:
    """A SAM 2.1 edge manifest bound at ``size`` (the shape of seed 002's), with its files present."""
    folder.mkdir()
    files = {}
    for name in ("sam2_encoder.onnx", "sam2_decoder.onnx"):
        (folder / name).write_bytes(b"x" * 10)
        files[name] = {"bytes": 10, "sha256": "0" * 64}
    (folder / "manifest.json").write_text(json.dumps({
        "model": "facebook/sam2.1-hiera-tiny", "export": {"programs": {
            "sam2_encoder.onnx": {"inputs": [{"name": "pixels", "shape": [1, 3, size, size], "dtype": "float32"}]},
            "sam2_decoder.onnx": {"inputs": [{"name": "image_embeddings", "shape": [1, 256, size // 16, size // 16]}]},
        }}, "files": files}))


def test_serve_refuses_a_vit_export(capsys, no_load, tmp_path):
    _vit_onnx_export(tmp_path / "vit-export")
    code, first = run(capsys, "serve", "--export", str(tmp_path / "vit-export"))
    assert code == 2 and first.startswith(f"kestrel serve: error: {tmp_path / 'vit-export' / 'manifest.json'}: not a "
                                          "SAM 2.1 edge export of vit::ViTModel"), first


# ------------------------------------------------------------------------------------- silently wrong

def test_a_16_bit_gray_png_reads_as_its_8_bit_copy(tmp_path):
    from kestrel.pipelines.images import ImagePreprocess, load_image

    gray8 = np.random.default_rng(1).integers(0, 256, (40, 50), dtype=np.uint8)
    Image.fromarray(gray8).save(tmp_path / "g8.png")
    Image.fromarray(gray8.astype(np.uint16) * 257).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    Image.new("L", (50, 40), 255).save(tmp_path / "white.png")
    a, b = load_image(tmp_path / "g8.png"), load_image(tmp_path / "g16.png")
    assert np.array_equal(np.asarray(a), np.asarray(b))
    pre = ImagePreprocess(resize=(28, 28), shortest_edge=None, crop=None, resample="bicubic", rescale=1 / 255,
                          mean=(0.5,) * 3, std=(0.5,) * 3)
    x8, x16, white = pre(tmp_path / "g8.png"), pre(tmp_path / "g16.png"), pre(tmp_path / "white.png")
    assert torch.equal(x8, x16) and not torch.allclose(x16, white)
    # 32-bit integer and float modes, and a PIL image handed over directly, too
    assert np.array_equal(np.asarray(pre.pixels(Image.fromarray(gray8.astype(np.int32) * 257, mode="I"))),
                          np.asarray(pre.pixels(Image.fromarray(gray8))))
    assert np.array_equal(np.asarray(pre.pixels(Image.fromarray(gray8.astype(np.float32), mode="F"))),
                          np.asarray(pre.pixels(Image.fromarray(gray8))))


@pytest.mark.parametrize("mode", ["1", "L", "P", "RGB", "RGBA", "CMYK", "YCbCr", "LAB", "HSV", "I", "F", "LA", "PA",
                                  "La", "RGBa", "RGBX", "I;16", "I;16B", "I;16L"])
def test_every_pillow_mode_converts_to_rgb(mode):
    from kestrel.pipelines.images import to_rgb

    out = to_rgb(Image.new(mode, (3, 2)))
    assert out.mode == "RGB" and out.size == (3, 2)


def test_export_size_50_on_patch_14_is_refused_like_embed(capsys, no_load, dino, tmp_path, photo):
    out = tmp_path / "export-out"
    code, first = run(capsys, "export", str(dino), "--size", "50", "--out", str(out))
    rule = (f"--size 50: {dino} cuts images into 14 x 14 patches, so the size must be a multiple of 14 "
            "(e.g. 42 or 56)")
    assert (code, first) == (2, f"kestrel export: error: {rule}")
    assert not out.exists()
    code, first = run(capsys, "embed", str(photo), "--model", str(dino), "--size", "50", "--out",
                      str(tmp_path / "f.safetensors"))
    assert (code, first) == (2, f"kestrel embed: error: {rule}")


def test_serve_size_must_match_the_export(capsys, no_load, tmp_path):
    _edge_export(tmp_path / "edge512", 512)
    code, first = run(capsys, "serve", "--export", str(tmp_path / "edge512"), "--encode", "server", "--model",
                      "sam2.1-hiera-tiny", "--size", "1024")
    assert (code, first) == (2, f"kestrel serve: error: --size 1024: the export {tmp_path / 'edge512'} is bound at "
                                "512 px (its encoder takes [1, 3, 512, 512]); drop --size or export again at 1024")


def test_serve_reads_the_size_from_the_export(tmp_path):
    from kestrel.pipelines.readers import ReadError, read_edge_manifest

    _edge_export(tmp_path / "edge", 512)
    assert read_edge_manifest(tmp_path / "edge")[1] == 512
    (tmp_path / "edge" / "sam2_decoder.onnx").write_bytes(b"short")
    with pytest.raises(ReadError, match="5 bytes, but the manifest says 10"):
        read_edge_manifest(tmp_path / "edge")


@pytest.mark.parametrize("point, first", [
    ("5000,5000", "kestrel segment: error: prompt 0: point 0 (5000, 5000) lies outside the 64 x 48 image (x from 0 "
                  "to 64, y from 0 to 48); prompts are in pixels of the photo and must lie inside it"),
    ("-5,10", "kestrel segment: error: argument --point: expected X,Y[:LABEL], two finite numbers >= 0 and a label "
              "1, 0, -1 or -10, got '-5,10' (a negative coordinate lies outside the image)"),
])
def test_points_outside_the_image_are_refused(capsys, no_load, photo, tmp_path, point, first):
    assert run(capsys, "segment", str(photo), f"--point={point}", "--out", str(tmp_path / "o")) == (2, first)
    assert not (tmp_path / "o").exists()


def test_a_box_outside_the_image_is_refused(capsys, no_load, photo, tmp_path):
    code, first = run(capsys, "segment", str(photo), "--box", "10,10,100,20", "--out", str(tmp_path / "o"))
    assert code == 2 and "box (10, 10, 100, 20) reaches outside the 64 x 48 image" in first


def test_the_prompt_rule_holds_in_python_too():
    from kestrel.pipelines.input_rules import InputRuleError, as_json
    from kestrel.pipelines.prompts import Prompt
    from kestrel.pipelines.sam_processing import SamImageProcessor, prompt_tensors

    proc = SamImageProcessor()
    prompt_tensors([Prompt([(64.0, 48.0), (0.0, 0.0)], [1, 0])], (48, 64), proc)  # the edges are inside
    with pytest.raises(InputRuleError, match=r"point 1 \(64.5, 3\) lies outside the 64 x 48 image"):
        prompt_tensors([Prompt([(1.0, 1.0), (64.5, 3.0)], [1, 1])], (48, 64), proc)
    prompt_tensors([Prompt([(1.0, 1.0), (-10.0, -10.0)], [1, -10])], (48, 64), proc)  # padding has no position
    assert as_json()["prompt_outside_image"] == "refuse"


# --------------------------------------------------------------------------------------------- unfriendly

def test_an_excel_csv_with_bom_crlf_and_quotes(tmp_path, photo):
    from kestrel.pipelines.datasets import read_source

    Image.open(photo).save(tmp_path / "a b.png")
    Image.open(photo).save(tmp_path / "c,d.png")
    (tmp_path / "index.csv").write_bytes('\ufeffpath,label\r\n"a b.png",x\r\n"c,d.png","y ""z"""\r\n'.encode())
    assert read_source(tmp_path / "index.csv") == [str(tmp_path / "a b.png"), str(tmp_path / "c,d.png")]


def test_dataset_files_follow_the_umask(tmp_path):
    import pyarrow as pa

    from kestrel.scale.output import atomic_write, write_parquet

    old = os.umask(0o027)
    try:
        write_parquet(pa.table({"x": [1]}), tmp_path / "part-00000.parquet")
        atomic_write(tmp_path / "manifest.json", lambda t: t.write_text("{}"))
    finally:
        os.umask(old)
    for name in ("part-00000.parquet", "manifest.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o640, name


def test_a_failed_export_leaves_no_out_folder(capsys, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "dinov2", "hidden_size": ')
    out = tmp_path / "new-out"
    code, first = run(capsys, "export", str(broken), "--out", str(out))
    assert code == 2 and "config.json" in first, first
    assert not out.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    assert run(capsys, "export", str(broken), "--out", str(existing))[0] == 2
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]


def test_segment_out_on_a_dangling_link(capsys, no_load, photo, tmp_path):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone")
    code, first = run(capsys, "segment", str(photo), "--point", "5,5", "--out", str(link))
    assert (code, first) == (2, f"kestrel segment: error: argument --out: '{link}': a dangling symbolic link (to "
                                f"'{tmp_path / 'gone'}'); remove it or choose another path")


def test_a_fifo_given_as_an_image_is_refused_without_blocking(capsys, no_load, tmp_path):
    fifo = tmp_path / "photo.png"
    os.mkfifo(fifo)

    def hung(*_):
        raise AssertionError("opened the FIFO and blocked")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        code, first = run(capsys, "segment", str(fifo), "--point", "1,1", "--out", str(tmp_path / "o"))
        assert (code, first) == (2, f"kestrel segment: error: argument IMAGE: '{fifo}': a named pipe (FIFO), "
                                    "not a file")
        code, first = run(capsys, "classify", str(fifo))
        assert code == 2 and "a named pipe (FIFO), not an image file" in first, first
        from kestrel.pipelines.images import ImageError, load_image

        with pytest.raises(ImageError, match="FIFO"):
            load_image(fifo)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_truncated_safetensors_names_the_file(tmp_path):
    from safetensors.torch import save_file

    from kestrel.pipelines.readers import ReadError, check_safetensors

    save_file({"w": torch.zeros(64)}, str(tmp_path / "w.safetensors"))
    assert "w" in check_safetensors(tmp_path / "w.safetensors")
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    with pytest.raises(ReadError, match=r"cut.safetensors: truncated"):
        check_safetensors(tmp_path / "cut.safetensors")


def test_the_page_server_refuses_a_vit_export(tmp_path):
    from kestrel.web.server import App, ServeError

    _vit_onnx_export(tmp_path / "vit-export")
    with pytest.raises(ServeError, match=r"not a SAM 2\.1 edge export"):
        App(export_dir=tmp_path / "vit-export", vendor_dir=tmp_path)


@pytest.mark.parametrize("name, data, reason", [
    ("t.parquet", b"PAR1 not really", "not a readable Parquet file"),
    ("t.csv", "path\ncaf\xe9.png\n".encode("latin-1"), "not UTF-8 text"),
    ("list.txt", b"\xff\xfe\x00garbage", "neither an image nor a UTF-8 text list"),
])
def test_corrupt_tables_name_the_file(tmp_path, name, data, reason):
    from kestrel.pipelines.datasets import SourceError, read_source

    (tmp_path / name).write_bytes(data)
    with pytest.raises(SourceError) as info:
        read_source(tmp_path / name)
    assert str(tmp_path / name) in str(info.value) and reason in str(info.value)


def test_a_fifo_as_a_dataset_source_is_refused(tmp_path):
    from kestrel.pipelines.datasets import SourceError, read_source

    os.mkfifo(tmp_path / "list.txt")
    with pytest.raises(SourceError, match="FIFO"):
        read_source(tmp_path / "list.txt")


def test_python_load_applies_the_same_size_rule(dino):
    import kestrel
    from kestrel.models.cards import CardError

    with pytest.raises(CardError, match=r"Height=50: dinov2 cuts images into 14 x 14 patches, so Height must be a "
                                        r"multiple of 14 \(e.g. 42 or 56\)"):
        kestrel.load(dino, Height=50, Width=56)
    assert kestrel.load(dino, Height=42, Width=56).generics["Height"] == 42
