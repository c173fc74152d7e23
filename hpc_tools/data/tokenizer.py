"""Tokenizers for ``data.tokenizer``: the built-in byte tokenizer or a local Hugging Face tokenizer folder.

Both expose ``vocab_size``, ``eos_id``, ``encode(text) -> list[int]``, ``encode_batch(texts) -> list[list[int]]`` (the
same ids, many documents per call: what ``data prepare`` uses) and ``decode(ids) -> str``. Nothing is ever
downloaded: a Hugging Face tokenizer is read from a local folder with ``local_files_only=True``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, Sequence

from hpc_tools.errors import UserError

BYTE_VOCAB_SIZE = 257
"""256 byte values plus one end-of-document token."""
BYTE_EOS_ID = 256


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, EOS = 256. Needs no files, so every recipe can run offline."""

    vocab_size = BYTE_VOCAB_SIZE
    eos_id = BYTE_EOS_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[bytes]:
        """UTF-8 bytes per text: a bytes object is already a sequence of token ids 0..255 (no per-byte list)."""
        return [t.encode("utf-8") for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        # EOS (and anything outside a byte) ends a document; it has no text of its own.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local folder (tokenizer.json / tokenizer_config.json)."""

    def __init__(self, folder: str | Path):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a folder path must never turn into a hub request
        from transformers import AutoTokenizer

        self.folder = Path(folder)
        try:
            self._tok = AutoTokenizer.from_pretrained(str(self.folder), local_files_only=True)
        except Exception as exc:  # transformers raises several types for a bad folder
            raise UserError(f"data.tokenizer={folder} could not be loaded as a Hugging Face tokenizer "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]}) "
                            "(give a local folder written by tokenizer.save_pretrained, or use tokenizer: byte)"
                            ) from None
        eos = self._tok.eos_token_id
        if eos is None:
            eos = self._tok.sep_token_id
        if eos is None:
            raise UserError(f"data.tokenizer={folder} has no eos_token (documents are joined with EOS; "
                            "set eos_token in its tokenizer_config.json)")
        self.eos_id = int(eos)
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many texts in one call of the Rust tokenizer (the same ids as ``encode`` per text)."""
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(spec: str) -> Tokenizer:
    """``byte`` or a local tokenizer folder (the value of ``data.tokenizer``)."""
    if spec == "byte":
        return ByteTokenizer()
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise UserError(f"data.tokenizer={spec} is neither `byte` nor an existing local folder "
                        "(give the folder of a saved Hugging Face tokenizer; nothing is downloaded)")
    return HFTokenizer(folder)
