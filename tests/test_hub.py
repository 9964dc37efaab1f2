"""kestrel.runtime.hub: resolving a pinned Hugging Face repo revision from the local cache.

No test touches the network: HF_HUB_OFFLINE=1 is set, the cache lives in tmp_path, and huggingface_hub's
HTTP client is replaced by an in-process transport (a fake Hub in one test, refusing everything elsewhere).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import httpx2
import huggingface_hub
import pytest
import torch
from safetensors.torch import save

from kestrel.runtime.checkpoint import read_headers
from kestrel.runtime.hub import ALLOWED_FILE_PATTERNS, HubError, fetch, hub_cache_dir
from reference import make_cached_repo

REPO = "kestrel-test/tiny-vit"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
PATTERNS = ["*.safetensors", "*.safetensors.index.json", "config.json"]

CONFIG = json.dumps({"model_type": "vit", "hidden_size": 4}).encode()
pytestmark = pytest.mark.usefixtures("hermetic")  # offline, HF env in tmp_path, no request

WEIGHTS = save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})








def test_fetch_returns_cached_snapshot_for_pinned_commit(tmp_path):
    cache = tmp_path / "cache"
    snapshot = make_cached_repo(
        cache, REPO, COMMIT, {"config.json": CONFIG, "model.safetensors": WEIGHTS, "pytorch_model.bin": b"x"}
    )
    path = fetch(REPO, COMMIT, PATTERNS, cache_dir=cache, local_files_only=True)
    assert path == snapshot
    assert path.name == COMMIT
    assert json.loads((path / "config.json").read_text())["model_type"] == "vit"
    headers = read_headers(path)  # the snapshot is directly loadable (through the symlinks into blobs/)
    assert headers["w"].shape == (2, 3) and headers["w"].dtype == "F32"


def test_fetch_resolves_branch_through_refs(tmp_path):
    cache = tmp_path / "cache"
    snapshot = make_cached_repo(cache, REPO, COMMIT, {"config.json": CONFIG, "model.safetensors": WEIGHTS})
    assert fetch(REPO, "main", PATTERNS, cache_dir=cache) == snapshot  # HF_HUB_OFFLINE => local only


@pytest.mark.parametrize("var", ["HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"])
def test_fetch_honours_cache_env_vars(tmp_path, monkeypatch, var):
    root = tmp_path / "from_env"
    cache = {
        "HF_HUB_CACHE": root,
        "HUGGINGFACE_HUB_CACHE": root,
        "HF_HOME": root / "hub",
        "XDG_CACHE_HOME": root / "huggingface" / "hub",
    }[var]
    if var == "XDG_CACHE_HOME":
        monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv(var, str(root))
    assert hub_cache_dir() == cache
    snapshot = make_cached_repo(cache, REPO, COMMIT, {"config.json": CONFIG, "model.safetensors": WEIGHTS})
    assert fetch(REPO, COMMIT, PATTERNS) == snapshot


def test_hf_hub_cache_takes_precedence_over_hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "b"))
    assert hub_cache_dir() == tmp_path / "a"
    assert hub_cache_dir(tmp_path / "explicit") == tmp_path / "explicit"


def _assert_helpful(message: str, revision: str, cache: Path) -> None:
    assert REPO in message
    assert revision in message
    assert str(cache) in message
    assert "weights=DIR" in message and "--weights DIR" in message
    assert f"hf download {REPO} --revision {revision}" in message
    assert "connect" in message


def test_not_cached_repo_gives_hub_error_with_hint(tmp_path):
    cache = tmp_path / "empty-cache"
    with pytest.raises(HubError) as info:
        fetch(REPO, COMMIT, PATTERNS, cache_dir=cache)
    message = str(info.value)
    _assert_helpful(message, COMMIT, cache)
    assert "not in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE" in message


def test_not_cached_branch_gives_hub_error(tmp_path):
    cache = tmp_path / "cache"
    make_cached_repo(cache, REPO, COMMIT, {"config.json": CONFIG, "model.safetensors": WEIGHTS}, ref=None)
    with pytest.raises(HubError) as info:
        fetch(REPO, "v1.0", PATTERNS, cache_dir=cache)  # no refs/v1.0
    _assert_helpful(str(info.value), "v1.0", cache)


def test_other_revision_cached_is_not_good_enough(tmp_path):
    cache = tmp_path / "cache"
    make_cached_repo(cache, REPO, OTHER_COMMIT, {"config.json": CONFIG, "model.safetensors": WEIGHTS})
    with pytest.raises(HubError) as info:
        fetch(REPO, COMMIT, PATTERNS, cache_dir=cache)
    _assert_helpful(str(info.value), COMMIT, cache)


def test_snapshot_without_requested_files_is_not_cached(tmp_path):
    # e.g. only config.json was fetched earlier: the snapshot folder exists, the weights do not.
    cache = tmp_path / "cache"
    make_cached_repo(cache, REPO, COMMIT, {"config.json": CONFIG})
    with pytest.raises(HubError) as info:
        fetch(REPO, COMMIT, ["*.safetensors"], cache_dir=cache)
    _assert_helpful(str(info.value), COMMIT, cache)


@pytest.mark.parametrize(
    "patterns",
    [["*"], ["*.bin"], ["pytorch_model.bin"], ["*.safetensors", "*.pt"], ["**"], ["*.json"], ["model.*"], []],
)
def test_only_safe_files_are_ever_requested(tmp_path, patterns):
    with pytest.raises(ValueError, match=r"refusing|empty"):
        fetch(REPO, COMMIT, patterns, cache_dir=tmp_path)


def test_allowed_patterns_pass_the_filter(tmp_path):
    cache = tmp_path / "cache"
    files = {
        "config.json": CONFIG,
        "preprocessor_config.json": b"{}",
        "tokenizer.json": b"{}",
        "tokenizer_config.json": b"{}",
        "model-00001-of-00002.safetensors": WEIGHTS,
    }
    make_cached_repo(cache, REPO, COMMIT, files)
    patterns = [
        *PATTERNS,
        "preprocessor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model-*.safetensors",
    ]
    assert fetch(REPO, COMMIT, patterns, cache_dir=cache).name == COMMIT
    assert "*.bin" not in ALLOWED_FILE_PATTERNS


# ------------------------------------------------------------------------------------------------------------
# Populating the cache by huggingface_hub's own download code, against an in-process fake Hub.


class FakeHub:
    """Answers the few Hub endpoints snapshot_download uses, for one repo at one commit."""

    def __init__(self, repo_id: str, commit: str, files: dict[str, bytes]):
        self.repo_id, self.commit, self.files = repo_id, commit, files
        self.requests: list[tuple[str, str]] = []

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        self.requests.append((request.method, path))
        tree = f"/api/models/{self.repo_id}/tree/{self.commit}"
        resolve = f"/{self.repo_id}/resolve/{self.commit}/"
        if request.method == "GET" and path.rstrip("/") == tree:
            listing = [
                {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for name, data in self.files.items()
            ]
            return httpx2.Response(200, json=listing)
        if path.startswith(resolve) and path[len(resolve) :] in self.files:
            data = self.files[path[len(resolve) :]]
            headers = {
                "X-Repo-Commit": self.commit,
                "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                "Content-Length": str(len(data)),
            }
            return httpx2.Response(200, headers=headers, content=b"" if request.method == "HEAD" else data)
        return httpx2.Response(404, headers={"X-Error-Code": "EntryNotFound"}, text=f"no {path}")


def test_cache_populated_by_huggingface_hub_then_offline(tmp_path, monkeypatch):
    files = {
        "config.json": CONFIG,
        "model.safetensors": WEIGHTS,
        "pytorch_model.bin": b"pickled weights must never be downloaded",
        "README.md": b"# tiny",
        "tokenizer.json": b"{}",
    }
    hub = FakeHub(REPO, COMMIT, files)
    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(hub)))
    cache = tmp_path / "cache"

    # "Online" (through the fake hub): only the allowed files are requested and stored.
    online = fetch(REPO, COMMIT, PATTERNS, cache_dir=cache, local_files_only=False)
    resolved = sorted(p.rsplit("/", 1)[-1] for m, p in hub.requests if "/resolve/" in p)
    assert set(resolved) == {"config.json", "model.safetensors"}
    assert online == cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert sorted(p.name for p in online.iterdir()) == ["config.json", "model.safetensors"]
    assert read_headers(online)["w"].shape == (2, 3)

    # Offline (HF_HUB_OFFLINE=1 from the fixture): served from the cache, no request at all.
    hub.requests.clear()
    assert fetch(REPO, COMMIT, PATTERNS, cache_dir=cache) == online
    assert hub.requests == []

    # A snapshot the library knows to be incomplete (its cached tree lists a missing file) is reported.
    (online / "model.safetensors").unlink()
    with pytest.raises(HubError) as info:
        fetch(REPO, COMMIT, PATTERNS, cache_dir=cache)
    assert "incomplete" in str(info.value)
    _assert_helpful(str(info.value), COMMIT, cache)
    assert hub.requests == []


def test_unreachable_hub_gives_hub_error(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "sleep", lambda seconds: None)  # huggingface_hub backs off between retries
    attempts: list[str] = []

    def unreachable(request: httpx2.Request) -> httpx2.Response:
        attempts.append(str(request.url))
        raise httpx2.ConnectError("Name or service not known", request=request)

    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(unreachable)))
    cache = tmp_path / "cache"
    with pytest.raises(HubError) as info:
        fetch(REPO, COMMIT, PATTERNS, cache_dir=cache, local_files_only=False)
    assert attempts  # it did try (the in-process transport), and says so
    assert "could not be reached" in str(info.value)
    _assert_helpful(str(info.value), COMMIT, cache)
