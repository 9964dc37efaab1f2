"""SigLIP text tokenizer: strings to the fixed-length id tensor the SigLIP text tower expects.

Reproduces, id for id, the reference slow ``SiglipTokenizer`` (SentencePiece based) as SigLIP users
call it: ``processor(text=..., padding="max_length", max_length=64, truncation=True)``. The steps:

1. Prefix the text with ``"▁"`` (U+2581) after turning every ``"▁"`` already in it into a space.
2. Split out the special tokens (eos, pad, unk) written literally in the text, case-sensitively;
   each becomes its own id.
3. Canonicalise every other chunk: lowercase (``do_lower_case``), delete ASCII punctuation
   (``string.punctuation``), collapse each whitespace run to one space, strip the ends.
4. Run SentencePiece on ``unk_token + chunk`` and drop the pieces the bare ``unk_token`` encodes to.
5. Drop a lone leading ``"▁"`` piece when a special token follows it.
6. Map pieces to ids, keep the first ``max_length - 1``, then append eos unless the last id is
   already eos, and pad on the right with the pad id up to ``max_length``.

Only ``sentencepiece`` runs the model file; transformers is not needed at runtime.
"""

from __future__ import annotations

import json
import os
import re
import string
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch

from ..errors import KestrelError

SPIECE_UNDERLINE = "\u2581"
SPIECE_MODEL_FILE = "spiece.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
DEFAULT_MAX_LENGTH = 64

_DELETE_PUNCTUATION = str.maketrans("", "", string.punctuation)
_WHITESPACE_RUN = re.compile(r"\s+")
_SPECIAL_TOKEN_KEYS = ("eos_token", "pad_token", "unk_token")


class TokenizerError(KestrelError, ValueError):
    """A tokenizer that cannot be built from the given files, or input it cannot take."""


class SiglipTextTokenizer:
    """Text -> Tensor[B, MaxPositions; i32] as the reference SiglipTokenizer produces it.

    ``MaxPositions`` is ``max_length`` (64 for the released SigLIP checkpoints). Every row ends in
    eos (unless truncation kept an eos written literally in the text as its last id) and is padded
    on the right with the pad id; SigLIP pads with ``</s>``, so eos and pad share one id.
    """

    def __init__(
        self,
        spiece_model: str | os.PathLike[str],
        max_length: int = DEFAULT_MAX_LENGTH,
        *,
        do_lower_case: bool = True,
        eos_token: str = "</s>",
        pad_token: str = "</s>",
        unk_token: str = "<unk>",
    ) -> None:
        path = Path(spiece_model)
        if not path.is_file():
            raise TokenizerError(f"SentencePiece model {str(path)!r} does not exist")
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise TokenizerError(f"max_length must be a positive int, got {max_length!r}")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as err:
            raise TokenizerError(f"{str(path)!r} is not a SentencePiece model: {err}") from err

        self.max_length = max_length
        self.do_lower_case = do_lower_case
        self.eos_token, self.pad_token, self.unk_token = eos_token, pad_token, unk_token
        self.eos_id = self._vocab_id(eos_token, "eos_token")
        self.pad_id = self._vocab_id(pad_token, "pad_token")
        self.unk_id = self._vocab_id(unk_token, "unk_token")
        self._special_ids = {eos_token: self.eos_id, pad_token: self.pad_id, unk_token: self.unk_id}
        alternatives = sorted(self._special_ids, key=len, reverse=True)
        self._special_split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
        self._unk_prefix_len = len(self._sp.encode(unk_token))

    @classmethod
    def from_dir(
        cls, directory: str | os.PathLike[str], max_length: int | None = None
    ) -> SiglipTextTokenizer:
        """Load from a checkpoint folder holding ``spiece.model`` and, optionally, the JSON configs.

        ``tokenizer_config.json`` supplies ``do_lower_case``, ``model_max_length`` (used when
        ``max_length`` is None) and the eos/pad/unk tokens; ``special_tokens_map.json`` supplies the
        tokens only when the config has no ``added_tokens_decoder``, as the reference loader does.
        """
        directory = Path(directory)
        model_file = directory / SPIECE_MODEL_FILE
        if not model_file.is_file():
            raise TokenizerError(f"tokenizer folder {str(directory)!r} has no {SPIECE_MODEL_FILE}")
        config = _read_json(directory / TOKENIZER_CONFIG_FILE)
        added = config.get("added_tokens_decoder") or {}
        settings = dict(config)
        if not added:
            settings.update(_read_json(directory / SPECIAL_TOKENS_MAP_FILE))
        if settings.get("legacy") is False:
            raise TokenizerError(f"{directory}: legacy=false (no dummy-prefix) tokenizers are not supported")
        if settings.get("additional_special_tokens") or settings.get("extra_special_tokens"):
            raise TokenizerError(f"{directory}: additional special tokens are not supported")

        tokens = {key: _token_content(settings[key]) for key in _SPECIAL_TOKEN_KEYS if settings.get(key)}
        if max_length is None:
            max_length = config.get("model_max_length", DEFAULT_MAX_LENGTH)
            if not isinstance(max_length, int) or not 0 < max_length <= 1 << 20:
                raise TokenizerError(
                    f"{directory}: model_max_length {max_length!r} is unusable; pass max_length explicitly"
                )
        lower = bool(config.get("do_lower_case", True))
        tokenizer = cls(model_file, max_length, do_lower_case=lower, **tokens)

        # The reference splits the text on every added token; only eos/pad/unk are supported here.
        # Their lstrip/rstrip flags need no handling: canonicalisation strips every chunk anyway.
        for entry in added.values():
            single_word = isinstance(entry, dict) and entry.get("single_word")
            if _token_content(entry) not in tokenizer._special_ids or single_word:
                raise TokenizerError(f"{directory}: added token {entry!r} is not supported")
        return tokenizer

    def encode(self, text: str) -> list[int]:
        """Ids of one text, eos-terminated and truncated to ``max_length``, without padding."""
        if not isinstance(text, str):
            raise TokenizerError(f"expected a str, got {type(text).__name__}")
        special, vocab = self._special_ids, self._sp.piece_to_id
        ids = [special[piece] if piece in special else vocab(piece) for piece in self._pieces(text)]
        ids = ids[: self.max_length - 1]
        if not ids or ids[-1] != self.eos_id:
            ids.append(self.eos_id)
        return ids

    def __call__(self, texts: str | list[str]) -> torch.Tensor:
        """Tensor[B, max_length; int32] of ids, each row right-padded with the pad id."""
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, (list, tuple)):
            raise TokenizerError(f"expected a str or a list of str, got {type(texts).__name__}")
        out = torch.full((len(texts), self.max_length), self.pad_id, dtype=torch.int32)
        for row, text in enumerate(texts):
            ids = self.encode(text)
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        return out

    def canonicalize(self, text: str) -> str:
        """The reference text normalisation applied to each chunk between special tokens."""
        if self.do_lower_case:
            text = text.lower()
        text = text.translate(_DELETE_PUNCTUATION)
        return _WHITESPACE_RUN.sub(" ", text).strip()

    def _pieces(self, text: str) -> list[str]:
        """SentencePiece pieces of ``text``, special tokens kept whole, before truncation."""
        parts = self._special_split.split(SPIECE_UNDERLINE + text.replace(SPIECE_UNDERLINE, " "))
        # re.split with one group: even indexes are plain text, odd indexes are special tokens. The
        # whitespace next to a special token needs no stripping: canonicalize strips every chunk.
        pieces: list[str] = []
        for i, part in enumerate(parts):
            if i % 2:
                pieces.append(part)
            elif part:
                pieces.extend(self._chunk_pieces(part))
        if len(pieces) > 1 and pieces[0] == SPIECE_UNDERLINE and pieces[1] in self._special_ids:
            pieces = pieces[1:]
        return pieces

    def _chunk_pieces(self, chunk: str) -> list[str]:
        """Pieces of one plain-text chunk, encoded behind an unk-token prefix that is then cut off."""
        pieces = self._sp.encode(self.unk_token + self.canonicalize(chunk), out_type=str)
        return pieces[self._unk_prefix_len :] if len(pieces) >= self._unk_prefix_len else pieces

    def _vocab_id(self, token: str, role: str) -> int:
        token_id = self._sp.piece_to_id(token)
        if not 0 <= token_id < self._sp.get_piece_size() or self._sp.id_to_piece(token_id) != token:
            raise TokenizerError(f"{role} {token!r} is not a piece of the SentencePiece vocabulary")
        return token_id


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise TokenizerError(f"cannot read {path}: {err}") from err
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} does not hold a JSON object")
    return data


def _token_content(value: Any) -> str:
    """A token written as a string or as a serialised AddedToken ``{"content": ...}``."""
    content = value.get("content") if isinstance(value, dict) else value
    if not isinstance(content, str) or not content:
        raise TokenizerError(f"malformed special token {value!r}")
    return content
