"""The run's tokenizer in an exported folder, so that ``AutoTokenizer.from_pretrained(folder)`` encodes as training did.

A local Hugging Face tokenizer folder (``data.tokenizer: DIR``) is re-saved into the export. The byte tokenizer
(``data.tokenizer: byte``: UTF-8 bytes 0..255, end-of-document 256) has no files; the export writes an equivalent
fast tokenizer built locally with ``tokenizers``: a byte-level BPE with no merges whose vocabulary maps byte ``b`` to
id ``b`` (under GPT-2's printable byte alphabet), and ``<|endoftext|>`` = 256 as eos/bos. Encoding any text gives
its UTF-8 bytes, exactly as ``hpc_tools.data.tokenizer.ByteTokenizer`` does.
"""

from __future__ import annotations

import os
from pathlib import Path

from hpc_tools.data.tokenizer import BYTE_EOS_ID, BYTE_VOCAB_SIZE

BYTE_EOS_TOKEN = "<|endoftext|>"


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` equivalent to the byte tokenizer (ids = UTF-8 bytes, eos = 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins of GPT-2's byte-level BPE
    by_byte = _bytes_to_unicode()
    assert sorted(by_byte.values()) == sorted(alphabet)
    vocab = {by_byte[b]: b for b in range(256)}
    vocab[BYTE_EOS_TOKEN] = BYTE_EOS_ID
    assert len(vocab) == BYTE_VOCAB_SIZE
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTE_EOS_TOKEN])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=BYTE_EOS_TOKEN, bos_token=BYTE_EOS_TOKEN,
                                   unk_token=None, model_max_length=int(1e30))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the one ByteLevel pre-tokenization uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def save_tokenizer(spec: str, out: Path) -> dict[str, object]:
    """Write the tokenizer of ``data.tokenizer`` (``byte`` or a local folder) into ``out``; returns its eos/bos ids
    and a one-word kind for the summary."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if spec == "byte":
        tok = byte_tokenizer()
        kind = "byte"
    else:
        from hpc_tools.data.tokenizer import HFTokenizer

        tok = HFTokenizer(Path(spec).expanduser())._tok  # one loader of data.tokenizer folders (its errors)
        kind = "copied"
    tok.save_pretrained(str(out))
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    bos = tok.bos_token_id if tok.bos_token_id is not None else eos
    return {"tokenizer": kind, "eos_token_id": eos, "bos_token_id": bos, "pad_token_id": tok.pad_token_id}
