"""Resolving a Hugging Face Hub repo at a pinned revision to a local snapshot directory.

Only safetensors weights, their shard index, ``config.json``, ``preprocessor_config.json`` and tokenizer
files are ever fetched: :func:`fetch` refuses any pattern that could match anything else (pickled ``*.bin``
checkpoints in particular). The environment is read at call time, not at import time: ``HF_HUB_OFFLINE`` (or
``TRANSFORMERS_OFFLINE``) makes the call local-only, and the cache location follows ``HF_HUB_CACHE``,
``HUGGINGFACE_HUB_CACHE``, ``HF_HOME`` and ``XDG_CACHE_HOME`` with the same precedence as ``huggingface_hub``.
"""

from __future__ import annotations

import fnmatch
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import huggingface_hub
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from ..errors import KestrelError
from ..kernels import settings

__all__ = ["ALLOWED_FILE_PATTERNS", "HubError", "fetch", "hub_cache_dir", "is_offline"]

# Every file fetch() may download matches one of these (fnmatch, on the file's base name).
ALLOWED_FILE_PATTERNS: tuple[str, ...] = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "preprocessor_config.json",
    # tokenizer files (JSON / plain text / sentencepiece protobuf - nothing pickled)
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)

_TRUE = {"1", "ON", "YES", "TRUE"}


class HubError(KestrelError, RuntimeError):
    """A repo could not be resolved to a local snapshot.

    The message says which repo and revision was wanted, where the cache is, and how to proceed.
    """


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in _TRUE


def is_offline() -> bool:
    """Whether Hub access is disabled (``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``, now or at import)."""
    return (
        _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE") or bool(hf_constants.HF_HUB_OFFLINE)
    )


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(os.path.expandvars(value)).expanduser() if value else None


def hub_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The Hub cache directory: ``cache_dir`` if given, else from the environment as huggingface_hub reads it.

    Precedence: ``HF_HUB_CACHE``, ``HUGGINGFACE_HUB_CACHE``, ``$HF_HOME/hub``,
    ``$XDG_CACHE_HOME/huggingface/hub``, ``~/.cache/huggingface/hub``. Read at call time (huggingface_hub
    itself freezes it at import).
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if (path := _env_path(name)) is not None:
            return path
    if (home := _env_path("HF_HOME")) is not None:
        return home / "hub"
    if (xdg := _env_path("XDG_CACHE_HOME")) is not None:
        return xdg / "huggingface" / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def _check_patterns(allow_patterns: Sequence[str]) -> list[str]:
    if isinstance(allow_patterns, str):
        allow_patterns = [allow_patterns]
    patterns = list(allow_patterns)
    if not patterns:
        raise ValueError(
            "allow_patterns is empty: name the files to fetch (e.g. ['*.safetensors', 'config.json'])"
        )
    refused = [
        p
        for p in patterns
        if not isinstance(p, str)
        or not any(fnmatch.fnmatchcase(p.rsplit("/", 1)[-1], allowed) for allowed in ALLOWED_FILE_PATTERNS)
    ]
    if refused:
        raise ValueError(
            f"refusing to fetch files matching {refused}: only safetensors weights, config.json, "
            "preprocessor_config.json and tokenizer files are fetched "
            f"(allowed: {', '.join(ALLOWED_FILE_PATTERNS)})"
        )
    return patterns


def _network_errors() -> tuple[type[BaseException], ...]:
    """Exception bases of the HTTP stack huggingface_hub uses (httpx2 / httpx / requests), if loaded."""
    errors: list[type[BaseException]] = [OSError]
    for module, attr in (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException")):
        cls = getattr(sys.modules.get(module), attr, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            errors.append(cls)
    return tuple(errors)


_COMMIT = re.compile(r"^[0-9a-f]{40}$")
DEFAULT_CONNECT_TIMEOUT = 5.0  # seconds; KESTREL_HUB_TIMEOUT overrides


def _connect_timeout() -> float:
    return settings.hub_timeout(DEFAULT_CONNECT_TIMEOUT)


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or hf_constants.ENDPOINT).rstrip("/")


def _probe_hub(timeout: float) -> str | None:
    """None when the Hub endpoint answers at all (any HTTP status), else why not, after one short try.

    Uses huggingface_hub's own HTTP session (so its proxy settings and client factory apply), without its
    retries: a machine without network should hear so at once.
    """
    from huggingface_hub.utils import get_session

    url = f"{_endpoint()}/api/models"
    try:
        get_session().head(url, timeout=timeout)
    except _network_errors() as e:
        return f"{url}: no answer (one try, {timeout:g} s timeout): {type(e).__name__}: {e}"
    return None


def _cached_snapshot(repo_id: str, revision: str, patterns: list[str], cache: Path) -> Path | None:
    """The complete cached snapshot of a pinned commit, or None (then the Hub is asked)."""
    try:
        snapshot = Path(huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=patterns, cache_dir=str(cache), local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None
    has = any(p.is_file() and any(fnmatch.fnmatch(p.relative_to(snapshot).as_posix(), pat) for pat in patterns)
              for p in snapshot.rglob("*"))
    return snapshot if has else None


def _how_to_proceed(repo_id: str, revision: str, patterns: list[str], cache: Path) -> str:
    include = " ".join(f"--include '{p}'" for p in patterns)
    return (
        "To proceed, either:\n"
        "  - connect to the network (and unset HF_HUB_OFFLINE) so it can be downloaded;\n"
        "  - pass a local directory that holds the weights: weights=DIR in Python, --weights DIR on the "
        "command line;\n"
        f"  - or download it beforehand: hf download {repo_id} --revision {revision} {include} "
        f"--cache-dir {cache}\n"
        "    (`huggingface-cli download` with the same arguments on huggingface_hub < 1.0)."
    )


def fetch(
    repo_id: str,
    revision: str,
    allow_patterns: list[str],
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool | None = None,
) -> Path:
    """Return the local snapshot directory of ``repo_id`` at ``revision``, downloading what is missing.

    Uses ``huggingface_hub.snapshot_download`` with the pinned ``revision`` (a commit hash is best: it
    resolves offline without a ``refs/`` entry) and ``allow_patterns``, which must only match safetensors
    weights, ``config.json``, ``preprocessor_config.json`` or tokenizer files (see
    :data:`ALLOWED_FILE_PATTERNS`; anything else raises ``ValueError``). ``local_files_only=None`` means:
    local-only when ``HF_HUB_OFFLINE`` is set. The cache is ``cache_dir`` or the one the HF environment
    variables name (:func:`hub_cache_dir`).

    Raises :class:`HubError` when the snapshot is not cached and the Hub cannot be used (offline, unreachable,
    repo or revision not found, access denied), saying which repo and revision was wanted, where the cache is,
    and how to proceed.
    """
    if not isinstance(repo_id, str) or not repo_id.strip():
        raise ValueError(f"repo_id must be a non-empty string like 'org/name', got {repo_id!r}")
    if not isinstance(revision, str) or not revision.strip():
        raise ValueError(f"revision must be a non-empty commit hash, tag or branch, got {revision!r}")
    patterns = _check_patterns(allow_patterns)
    cache = hub_cache_dir(cache_dir)
    offline_env = is_offline()
    local_only = offline_env if local_files_only is None else bool(local_files_only)
    wanted = f"{repo_id} at revision {revision}"
    hint = _how_to_proceed(repo_id, revision, patterns, cache)

    if local_only:
        reason = (
            "offline mode is on (HF_HUB_OFFLINE)" if local_files_only is None else "local_files_only=True"
        )
    else:
        reason = "the Hub could not be reached"
    not_cached = f"{wanted} is not in the Hugging Face cache at {cache} and {reason}."

    if not local_only:
        # A pinned commit never changes: a complete cached copy needs no network at all.
        if _COMMIT.match(revision):
            cached = _cached_snapshot(repo_id, revision, patterns, cache)
            if cached is not None:
                return cached
        # Fail in seconds, not after a minute of retries, when the Hub cannot be reached at all.
        unreachable = _probe_hub(_connect_timeout())
        if unreachable is not None:
            raise HubError(f"{not_cached}\n{hint}\n({unreachable})")

    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=patterns,
            cache_dir=str(cache),
            local_files_only=local_only,
        )
    except LocalEntryNotFoundError as e:  # includes IncompleteSnapshotError (huggingface_hub >= 2)
        if type(e).__name__ == "IncompleteSnapshotError":  # its message lists the missing files
            raise HubError(
                f"the cached snapshot of {wanted} at {getattr(e, 'snapshot_path', cache)} is incomplete "
                f"and {reason}.\n{hint}\n(huggingface_hub: {e})"
            ) from e
        raise HubError(f"{not_cached}\n{hint}") from e
    except RevisionNotFoundError as e:
        raise HubError(
            f"revision {revision} of {repo_id} does not exist on the Hub; pin an existing commit hash or "
            "tag. "
            f"(huggingface_hub: {e})"
        ) from e
    except RepositoryNotFoundError as e:  # includes GatedRepoError
        raise HubError(
            f"{wanted}: repository not found or not accessible (private or gated repos need a token: "
            f"`hf auth login` or HF_TOKEN), and it is not in the cache at {cache}.\n{hint}\n"
            f"(huggingface_hub: {e})"
        ) from e
    except HfHubHTTPError as e:
        raise HubError(f"{wanted}: the Hub answered with an error: {e}\n{hint}") from e
    except ValueError as e:  # HFValidationError: malformed repo id or revision
        raise HubError(f"{wanted}: invalid request: {e}") from e
    except _network_errors() as e:
        raise HubError(f"{not_cached}\n{hint}\n({type(e).__name__}: {e})") from e

    path = Path(snapshot)
    if not path.is_dir():
        raise HubError(f"{wanted}: huggingface_hub returned {path}, which is not a directory.\n{hint}")
    found = [
        p
        for p in path.rglob("*")
        if p.is_file() and any(fnmatch.fnmatch(p.relative_to(path).as_posix(), pat) for pat in patterns)
    ]
    if not found:
        where = f"the snapshot of {wanted} at {path} has no file matching {patterns}"
        if local_only:
            raise HubError(f"{not_cached} ({where}.)\n{hint}")
        raise HubError(f"{where}: the repo does not provide them at this revision.")
    return path
