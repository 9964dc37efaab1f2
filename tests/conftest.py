"""Session-wide test settings and the fixtures several test modules share."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest


def _session_setting(name: str, value: Callable[[], str]) -> Iterator[None]:
    """``name`` set in the environment for the session (the CLI's processes inherit it), unless already set there;
    ``value()`` gives it."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value()
    try:
        yield
    finally:
        os.environ.pop(name, None)


@pytest.fixture(autouse=True, scope="session")
def _private_kestrel_cache(tmp_path_factory: pytest.TempPathFactory):
    """Calibrations and downloads measured by the tests go to a temporary folder, never the user's cache
    (and the user's cached choices never steer a test). A folder given in KESTREL_CACHE_DIR is kept."""
    yield from _session_setting("KESTREL_CACHE_DIR", lambda: str(tmp_path_factory.mktemp("kestrel-cache")))


@pytest.fixture(autouse=True, scope="session")
def _quick_kernel_races():
    """Every kernel race runs its fewest rounds (``KESTREL_CALIBRATION_BUDGET=0``; the CLI's processes inherit it):
    each candidate still runs and is checked against F.linear, and a model's first call chooses among them,
    without the 0.4-1.2 s per new shape a user's first call spends to rank them reliably (about half of the
    SAM 2.1 parity tests' time). A budget given in the environment is kept."""
    yield from _session_setting("KESTREL_CALIBRATION_BUDGET", lambda: "0")


@pytest.fixture
def own_calibration(tmp_path, monkeypatch):
    """A calibration cache of the test's own and no forced kernel: the choices a test measures (or counts)
    neither come from nor leak into another test's."""
    from kestrel.kernels import calibration

    monkeypatch.setenv("KESTREL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KESTREL_LINEAR", raising=False)
    calibration.forget()
    yield
    calibration.forget()


@pytest.fixture
def small_vit(tmp_path):
    """``small_vit(layers=1, labels=5)`` saves a small seeded ViT classifier (transformers, 32 px, 8 px patches)
    under the test's folder and returns the folder."""
    def make(layers: int = 1, labels: int = 5):
        from transformers import ViTConfig, ViTForImageClassification

        from reference import seeded

        cfg = ViTConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=128,
                        image_size=32, patch_size=8, num_labels=labels)
        path = tmp_path / f"vit-{layers}x{labels}"
        seeded(lambda: ViTForImageClassification(cfg)).save_pretrained(path)
        return path

    return make


@pytest.fixture(scope="session")
def sam2_small(tmp_path_factory: pytest.TempPathFactory):
    """A small SAM 2.1 checkpoint (Hiera-tiny's layout at small widths, seeded random weights) saved by
    transformers: ``(reference Sam2Model, directory)``."""
    from reference import seeded_sam2, small_config

    ref = seeded_sam2(small_config(1024))
    path = tmp_path_factory.mktemp("sam2-small")
    ref.save_pretrained(path)
    return ref, path


@pytest.fixture(scope="session")
def spiece_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small unigram model with SigLIP's special ids (<pad>=0, </s>=1, <unk>=2, no <s>)."""
    import random

    import sentencepiece as spm

    rng = random.Random(0)
    words = "a an the of photo picture dog cat bird car tree house red blue small big sleeping running".split()
    words += ["".join(rng.choices("ka lo mi ne ra to su vi pe ba".split(), k=rng.randint(1, 3))) for _ in range(60)]
    lines = [" ".join(rng.choices(words, k=rng.randint(3, 9))) for _ in range(600)]
    folder = tmp_path_factory.mktemp("spiece")
    (folder / "corpus.txt").write_text("\n".join(lines), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"), model_prefix=str(folder / "spiece"), model_type="unigram",
        vocab_size=80, pad_id=0, eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>",
        unk_piece="<unk>", minloglevel=2,
    )
    return str(folder / "spiece.model")


@pytest.fixture
def siglip_dir(spiece_model, tmp_path):
    """A small SigLIP checkpoint with its tokenizer and processor saved, two photos, and the reference's output
    for them against ``SIGLIP_LABELS`` in ``SIGLIP_TEMPLATE``: ``(directory, photo paths, reference output)``."""
    import warnings

    import numpy as np
    import torch
    import transformers
    from PIL import Image

    from reference import SIGLIP_LABELS, SIGLIP_TEMPLATE, build_siglip

    ref = build_siglip(
        vision=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                    patch_size=8),
        text=dict(vocab_size=80, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=16))
    tok = transformers.SiglipTokenizer(vocab_file=spiece_model, model_max_length=16)
    proc = transformers.SiglipImageProcessorPil(size={"height": 32, "width": 32})
    d = tmp_path / "siglip"
    for part in (ref, tok, proc):
        part.save_pretrained(d)
    rng = np.random.default_rng(1)
    paths = []
    for i, (h, w) in enumerate([(40, 56), (32, 32)]):
        paths.append(tmp_path / f"img{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        ids = tok([SIGLIP_TEMPLATE.format(t) for t in SIGLIP_LABELS], padding="max_length", max_length=16,
                  truncation=True, return_tensors="pt")
        pixels = proc([Image.open(p) for p in paths], return_tensors="pt")["pixel_values"]
        out = ref(input_ids=ids["input_ids"], pixel_values=pixels)
    return d, paths, out


@pytest.fixture
def hermetic(monkeypatch, tmp_path):
    """Offline, HF env pointing into tmp_path, and an HTTP client that records (and refuses) every request
    (use with ``pytestmark = pytest.mark.usefixtures("hermetic")``)."""
    import httpx2
    import huggingface_hub
    from huggingface_hub.utils import _http as hf_http

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    requests: list[str] = []

    def refuse(request: httpx2.Request) -> httpx2.Response:
        requests.append(f"{request.method} {request.url}")
        return httpx2.Response(599, text="network access is not allowed in tests")

    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(refuse)))
    yield requests
    huggingface_hub.set_client_factory(hf_http.default_client_factory)
    assert requests == [], f"a test tried to reach the network: {requests}"
