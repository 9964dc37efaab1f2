"""The ``kestrel`` command on ordinary mistakes, as a newcomer makes them: one clear line, no traceback.

Every case asserts the exit status (0 ok, 1 check failed, 2 usage or input error, 3 internal error) and the
first line of stderr. A handful run the real command in a subprocess (``python -m kestrel.cli.main``, with
this checkout's ``src`` first on the path); the rest call ``main([...])`` in-process, which runs the same
parser and error path without paying for a torch import each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open
from transformers import Dinov2Config, Dinov2Model, ViTConfig, ViTForImageClassification, ViTImageProcessor

from kestrel.cli.main import main
from reference import seeded

SRC = Path(__file__).resolve().parents[1] / "src"


def kestrel(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the command as a user would, in a fresh process."""
    base = {k: v for k, v in os.environ.items() if k != "KESTREL_DEBUG"}
    full = {**base, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "kestrel.cli.main", *args], capture_output=True, text=True,
                          env=full, timeout=timeout)


def run(capsys, *args: str) -> tuple[int, str, str]:
    """``main(args)`` in-process: (exit status, stdout, first line of stderr), with no traceback allowed."""
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own exit (usage errors, --help)
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, (err.splitlines() or [""])[0]


def first_line(proc: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    return (proc.stderr.splitlines() or [""])[0]


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv("KESTREL_DEBUG", raising=False)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny ViT classifier, a tiny DINOv2 (patch 14) and three images, one of them unreadable."""
    root = tmp_path_factory.mktemp("models")
    labels = {0: "cat", 1: "dog"}
    vit = root / "vit"
    seeded(lambda: ViTForImageClassification(ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
        patch_size=8, num_labels=2, id2label=labels, label2id={v: k for k, v in labels.items()}))).save_pretrained(vit)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(vit)
    dino = root / "dino"
    seeded(lambda: Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            image_size=28, patch_size=14))).save_pretrained(dino)
    images = root / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for name, (h, w) in {"a.png": (40, 50), "c.png": (30, 30)}.items():
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(images / name)
    (images / "b.png").write_bytes(b"not a png at all")
    return {"vit": vit, "dino": dino, "images": images}


# ------------------------------------------------------------------------------- the command itself


def test_user_mistakes_in_a_real_process(dirs):
    """The console command: a mistake is one line and exit 2; --debug shows the traceback (each process pays
    for a torch import, so this test runs just two)."""
    proc = kestrel("classify", str(dirs["images"] / "a.png"), "--model", str(dirs["dino"]))
    assert proc.returncode == 2
    assert first_line(proc).startswith("kestrel classify: error: classify needs an image classifier")
    proc = kestrel("inspect", "no-such-model", "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "CardError" in proc.stderr


def test_help_documents_exit_codes_and_debug(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "exit status:" in out and "2  usage or input error" in out
    assert "KESTREL_DEBUG=1" in out and "--debug" in out and "3  internal error" in out
    code, out, _ = run(capsys, "classify", "--help")
    assert code == 0 and "--debug" in out and "--strict" in out and ">= 1" in out


def test_debug_by_environment_reraises(capsys, monkeypatch, tmp_path):
    from kestrel.errors import KestrelError

    monkeypatch.setenv("KESTREL_DEBUG", "1")
    with pytest.raises(KestrelError, match="unknown model 'no-such-model'"):
        main(["inspect", "no-such-model"])
    monkeypatch.setenv("KESTREL_DEBUG", "0")
    assert run(capsys, "inspect", "no-such-model")[0] == 2


def test_check_on_a_syntax_error(capsys, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from kestrel.blocks import Block\n\nclass Oops(Block:\n    pass\n")
    code, _, first = run(capsys, "check", str(bad))
    assert code == 2 and first.startswith(f"kestrel check: error: {bad}:3: syntax error: ")  # then Python's words


def test_no_network_fails_fast_without_retries(tmp_path, dirs):  # a real process: huggingface_hub reads env at import
    """No cache and no Hub: one short connection attempt, then the message; never huggingface_hub's retry loop."""
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0",
           "TRANSFORMERS_OFFLINE": "0", "KESTREL_HUB_TIMEOUT": "2"}
    env_no_cache = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    proc = kestrel("classify", str(dirs["images"] / "a.png"), env={**env_no_cache, **env})
    assert proc.returncode == 2
    assert first_line(proc).startswith("kestrel classify: error: google/vit-base-patch16-224 at revision ")
    assert "the Hub could not be reached" in proc.stderr and "(one try, 2 s timeout)" in proc.stderr
    assert "Retrying" not in proc.stderr and "Retry " not in proc.stderr


# ------------------------------------------------------------------------------------- flag ranges


@pytest.mark.parametrize(("args", "first"), [
    (["classify", "x.png", "--top", "0"], "kestrel classify: error: argument --top: expected an integer >= 1, got 0"),
    (["classify", "x.png", "--batch-size", "0"],
     "kestrel classify: error: argument --batch-size: expected an integer from 1 to 4096, got 0"),
    (["classify", "x.png", "--top", "many"],
     "kestrel classify: error: argument --top: expected an integer >= 1, got 'many'"),
    (["classify", "x.png", "--device", "tpu"],
     "kestrel classify: error: argument --device: expected cpu, cuda, cuda:N or mps, got 'tpu'"),
    (["embed", "x.png", "--out", "o.safetensors", "--model", "dinov2-base", "--size", "-3"],
     "kestrel embed: error: argument --size: expected a size in pixels from 1 to 16384, got -3"),
    (["export", "vit-base-patch16-224", "--out", "o", "--batch", "0"],
     "kestrel export: error: argument --batch: expected an integer from 1 to 4096, got 0"),
    (["zero-shot", "x.png", "--labels", "a", "--template", "a photo of a"],
     "kestrel zero-shot: error: argument --template: the template 'a photo of a' has no '{}' where the text goes, "
     "e.g. 'a photo of {}.'"),
    (["classify", "x.png", "--weights", "/no/such/folder"],
     "kestrel classify: error: argument --weights: '/no/such/folder': no such file or folder; give a folder with "
     "config.json and *.safetensors"),
])
def test_flags_are_range_checked_by_the_parser(capsys, args, first):
    assert run(capsys, *args)[::2] == (2, first)


def test_cuda_on_a_cpu_build_is_a_parser_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, first = run(capsys, "classify", "x.png", "--device", "cuda")
    assert code == 2 and first.startswith("kestrel classify: error: argument --device: 'cuda' is not available: ")


def test_an_internal_error_is_one_line_and_exit_3(capsys, monkeypatch):
    from dataclasses import replace

    from kestrel.cli.commands import all_commands
    from kestrel.cli.options import REGISTRY

    def broken(args):
        raise RuntimeError("something Kestrel got wrong")

    all_commands()
    monkeypatch.setitem(REGISTRY, "check", replace(REGISTRY["check"], run=broken))
    code, _, first = run(capsys, "check")
    assert (code, first) == (3, "kestrel check: internal error: RuntimeError: something Kestrel got wrong")


# ---------------------------------------------------------------------------------- models and files


def test_classify_refuses_a_non_classifier_before_loading(capsys, dirs, monkeypatch):
    import kestrel.runtime.load as load_module

    monkeypatch.setattr(load_module, "load", lambda *a, **k: pytest.fail("loaded a model it should refuse"))
    img = str(dirs["images"] / "a.png")
    for model in ("dinov2-base", str(dirs["dino"]), "facebook/dinov2-base"):
        code, _, first = run(capsys, "classify", img, "--model", model)
        assert code == 2 and first.startswith("kestrel classify: error: classify needs an image classifier"), first
    code, _, first = run(capsys, "zero-shot", img, "--labels", "a cat", "--model", str(dirs["vit"]))
    assert code == 2 and first.startswith("kestrel zero-shot: error: zero-shot needs an image-text model")


def test_check_on_broken_user_files(capsys, tmp_path):
    missing = tmp_path / "imports.py"
    missing.write_text("import numpy\n\nimport no_such_module_for_kestrel\n")
    code, _, first = run(capsys, "check", str(missing))
    assert (code, first) == (2, f"kestrel check: error: {missing}:3: importing it failed: ModuleNotFoundError: "
                                "No module named 'no_such_module_for_kestrel'")
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n")
    code, _, first = run(capsys, "check", str(empty))
    assert code == 2 and first.startswith(f"kestrel check: error: {empty} defines no blocks")
    code, _, first = run(capsys, "check", str(tmp_path / "nope.py"))
    assert (code, first) == (2, f"kestrel check: error: no such file: {tmp_path / 'nope.py'}")


def test_a_failed_check_exits_1(capsys, tmp_path):
    src = tmp_path / "mine_errors.py"
    src.write_text(textwrap.dedent('''
        from kestrel.blocks import Block, Dim, Float, Param, f32
        from kestrel.std import ops

        class Proj(Block, module="mine_errors"):
            In: Dim
            Out: Dim
            T: Float = f32
            weight: Param["Out, In; T"]

            def forward(self, x: "Tensor[B, Out; T]") -> "Tensor[B, Out; T]":
                return ops.linear(x, self.weight)
    '''))
    code, out, _ = run(capsys, "check", str(src))
    assert code == 1 and "contraction dimension differs" in out


def test_inspect_takes_a_directory_a_hub_id_and_gives_a_summary(capsys, dirs):
    code, out, _ = run(capsys, "inspect", str(dirs["dino"]))
    assert code == 0 and "dinov2::Model" in out and "Patch" in out
    code, out, _ = run(capsys, "inspect", "google/vit-base-patch16-224")
    assert code == 0 and out.startswith("vit-base-patch16-224: ")
    from kestrel.models.cards import CARDS

    code, out, _ = run(capsys, "inspect")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["model", "checked", "parameters", "entries"]
    rows = {line.split()[0]: line.split() for line in lines[1: 1 + len(CARDS)]}
    assert set(rows) == set(CARDS)
    assert rows["vit-base-patch16-224"][1:4] == ["ok", "86,567,656", "forward,"]
    assert "kestrel inspect --all" in out


def test_size_must_be_whole_patches_of_a_resizable_model(capsys, dirs, tmp_path):
    img = str(dirs["images"] / "a.png")
    out = str(tmp_path / "f.safetensors")
    code, _, first = run(capsys, "embed", img, "--model", str(dirs["dino"]), "--out", out, "--size", "50")
    assert (code, first) == (2, f"kestrel embed: error: --size 50: {dirs['dino']} cuts images into 14 x 14 patches, "
                                "so the size must be a multiple of 14 (e.g. 42 or 56)")
    code, _, first = run(capsys, "embed", img, "--model", str(dirs["vit"]), "--out", out, "--size", "64")
    assert code == 2 and first.startswith("kestrel embed: error: --size 64: ") and "vit model" in first
    assert not Path(out).exists()


def test_hub_ids_of_cards_resolve_to_the_card(capsys, dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    code, _, first = run(capsys, "classify", str(dirs["images"] / "a.png"), "--model", "google/vit-base-patch16-224")
    assert code == 2
    assert first.startswith("kestrel classify: error: google/vit-base-patch16-224 at revision 3f49326e")
    assert first.endswith("and offline mode is on (HF_HUB_OFFLINE).")


def test_hub_id_of_a_known_family_loads_from_the_cache(capsys, dirs, tmp_path, monkeypatch):
    """A hub id that is no card (org/name) is fetched (here: from the offline cache) and loaded by its family."""
    from test_hub import make_cached_repo

    files = {p.name: p.read_bytes() for p in dirs["vit"].iterdir() if p.is_file()}
    make_cached_repo(tmp_path / "cache", "someone/tiny-vit", "0123456789abcdef0123456789abcdef01234567", files)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    code, out, _ = run(capsys, "classify", str(dirs["images"] / "a.png"), "--model", "someone/tiny-vit", "--top", "1")
    assert code == 0 and out.splitlines()[0].endswith("a.png") and out.splitlines()[1].split()[-1] in ("cat", "dog")


# ---------------------------------------------------------------------------------------- zero-shot


def test_zero_shot_needs_explicit_labels(capsys, tmp_path, dirs):
    img = str(dirs["images"] / "a.png")
    code, _, first = run(capsys, "zero-shot", img, "a cat", "a dog")
    assert code == 2
    assert first == ("kestrel zero-shot: error: missing --labels ('a cat' is not a file: is it a label?); the labels "
                     'now follow --labels: kestrel zero-shot IMAGE... --labels "a cat" "a dog" (the old form, '
                     "images then labels as positional arguments, is no longer accepted)")
    code, _, first = run(capsys, "zero-shot", img, "--labels", "")
    assert (code, first) == (2, "kestrel zero-shot: error: argument --labels: expected non-empty label, got ''")
    long_label = "a very long description " * 20
    code, _, first = run(capsys, "zero-shot", long_label, "--labels", "a cat")
    assert code == 2 and first.startswith("kestrel zero-shot: error: no such image file or folder: 'a very long")
    assert len(first) < 400


def test_a_label_that_names_a_file_stays_a_label(dirs, monkeypatch, capsys):
    """``--labels`` decides, not the file system: a label equal to an existing path is still a label."""
    seen = {}

    def fake_run(args):
        seen["images"], seen["labels"] = args.images, args.labels
        return 0

    from kestrel.cli import tasks

    monkeypatch.setattr(tasks, "cmd_zero_shot", fake_run)
    from kestrel.cli.main import build_parser

    img = str(dirs["images"] / "a.png")
    args = build_parser().parse_args(["zero-shot", img, "--labels", img, str(dirs["images"]), "a dog"])
    assert args.images == [img] and args.labels == [img, str(dirs["images"]), "a dog"]


# -------------------------------------------------------------------------------------------- writes


def test_embed_skips_unreadable_images_and_records_them(capsys, dirs, tmp_path):
    out = tmp_path / "nested" / "feats.safetensors"
    code, stdout, first = run(capsys, "embed", str(dirs["images"]), "--model", str(dirs["dino"]), "--out", str(out),
                              "--quiet")
    assert code == 0
    assert first.startswith(f"kestrel embed: skipped {dirs['images'] / 'b.png'}: ")
    with safe_open(str(out), "pt") as f:
        meta, shape = f.metadata(), f.get_slice("features").get_shape()
    assert shape[0] == 2 and json.loads(meta["images"]) == [str(dirs["images"] / n) for n in ("a.png", "c.png")]
    assert [s["path"] for s in json.loads(meta["skipped"])] == [str(dirs["images"] / "b.png")]
    assert "(1 skipped" in stdout
    code, _, first = run(capsys, "embed", str(dirs["images"]), "--model", str(dirs["dino"]), "--out",
                         str(tmp_path / "strict.safetensors"), "--quiet", "--strict")
    assert code == 2 and first.startswith(f"kestrel embed: error: cannot read image {dirs['images'] / 'b.png'}")
    assert not (tmp_path / "strict.safetensors").exists()


def test_embed_checks_the_destination_before_any_work(capsys, dirs, tmp_path, monkeypatch):
    import kestrel.runtime.load as load_module

    monkeypatch.setattr(load_module, "load", lambda *a, **k: pytest.fail("did the work before checking --out"))
    img = str(dirs["images"] / "a.png")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    cases = {
        str(blocker / "out.safetensors"): f"argument --out: '{blocker / 'out.safetensors'}': a part of the path "
                                          "is a file, not a folder",
        "/dev/null": "argument --out: '/dev/null': a device, not a file",
        str(tmp_path): f"cannot write {tmp_path}: it is a folder",
    }
    link = tmp_path / "link.safetensors"
    link.symlink_to(blocker)
    cases[str(link)] = f"argument --out: '{link}': a symbolic link; refusing to replace it"
    for out, message in cases.items():
        code, _, first = run(capsys, "embed", img, "--model", str(dirs["dino"]), "--out", out)
        assert code == 2 and first.startswith(f"kestrel embed: error: {message}"), first
    assert blocker.read_text() == "x" and link.is_symlink()


def test_outputs_honour_the_umask_and_diagram_makes_folders(capsys, dirs, tmp_path):
    old = os.umask(0o027)
    try:
        out = tmp_path / "u" / "feats.safetensors"
        assert run(capsys, "embed", str(dirs["images"] / "a.png"), "--model", str(dirs["dino"]), "--out", str(out),
                   "--quiet")[0] == 0
        assert out.stat().st_mode & 0o777 == 0o640
        svg = tmp_path / "deep" / "er" / "vit.svg"
        assert run(capsys, "diagram", "vit-base-patch16-224", "-o", str(svg))[0] == 0
        assert "<svg" in svg.read_text()[:400] and svg.stat().st_mode & 0o777 == 0o640
        assert sorted(p.name for p in svg.parent.iterdir()) == ["vit.svg"]  # no temporary file left
    finally:
        os.umask(old)


def test_classify_skips_an_unreadable_image_and_says_so(capsys, dirs):
    code, out, first = run(capsys, "classify", str(dirs["images"]), "--model", str(dirs["vit"]), "--top", "1")
    assert code == 0 and first.startswith(f"kestrel classify: skipped {dirs['images'] / 'b.png'}: ")
    assert [line for line in out.splitlines() if not line.startswith(" ")] == [
        str(dirs["images"] / "a.png"), str(dirs["images"] / "c.png")]


def test_a_huge_resize_is_refused_not_attempted(capsys, dirs, tmp_path):
    """A 1 x 100,000 PNG (a few hundred bytes) would become 28 x 2.8 M pixels under this DINOv2's shortest-edge
    resize (28 x 28 crop; the real checkpoints' 256 would make 25.6 M): refused before PIL allocates it."""
    strip = tmp_path / "strip.png"
    Image.new("RGB", (100_000, 1)).save(strip)
    assert strip.stat().st_size < 2_000
    code, _, first = run(capsys, "embed", str(strip), "--model", str(dirs["dino"]), "--out",
                         str(tmp_path / "f.safetensors"), "--strict")
    assert code == 2
    assert first == (f"kestrel embed: error: cannot read image {strip}: its 100000 x 1 pixels would resize (shorter "
                     "side to 28) to 2800000 x 28 = 78,400,000 pixels (width x height), above the limit of "
                     "67,108,864; set KESTREL_MAX_PIXELS to allow more")
