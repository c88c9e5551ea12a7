"""Tokenizers: raw bytes (the default, vocabulary 256) or a Hugging Face `tokenizers` file.

`--tokenizer` takes a `tokenizer.json` or a directory holding one (what `save_pretrained` writes).
Every node of a run must cut text into the same ids, so a tokenizer's `digest` (a hash of its
vocabulary, merges and special tokens) is part of the run's fingerprint (config/).
`train_tokenizer` trains a byte-level BPE tokenizer from local data, offline.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from diloco_node import registry
from diloco_node.errors import NodeError

BYTE_VOCAB = 256
# The byte tokenizer has no spare id: NUL never occurs in UTF-8 text, so it ends a document.
BYTE_EOT = 0
EOT_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(NodeError, ValueError):
    """A tokenizer that cannot be used; one line, fit for the CLI."""


class Tokenizer(Protocol):
    vocab_size: int
    eot_id: int
    digest: str
    name: str

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids (vocabulary 256); documents end with NUL."""

    vocab_size = BYTE_VOCAB
    eot_id = BYTE_EOT
    digest = "bytes"
    name = "bytes"

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]


class HFTokenizer:
    """A `tokenizers.Tokenizer` from a tokenizer.json; its end-of-text token ends each document."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as Backend

        try:
            text = path.read_text(encoding="utf-8")
            self.backend = Backend.from_str(text)
        except OSError as exc:
            raise TokenizerError(f"tokenizer '{path}' cannot be read: {exc.strerror}") from None
        except Exception as exc:  # tokenizers raises plain Exceptions for malformed files
            raise TokenizerError(f"tokenizer '{path}' is not a tokenizer.json: {str(exc).splitlines()[0]}") from None
        self.name = str(path)
        self.vocab_size = int(self.backend.get_vocab_size(with_added_tokens=True))
        eot = next((self.backend.token_to_id(n) for n in EOT_NAMES if self.backend.token_to_id(n) is not None), None)
        if eot is None:
            raise TokenizerError(f"tokenizer '{path}' has no end-of-text token (one of {', '.join(EOT_NAMES)}), "
                                 "which separates documents")
        self.eot_id = int(eot)
        self.digest = vocabulary_digest(json.loads(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self.backend.encode_batch(list(texts), add_special_tokens=False)]


def vocabulary_digest(spec: dict[str, Any]) -> str:
    """16 hex digits over what decides the ids: the model (vocabulary, merges, type), the added
    tokens and the normalizer and pre-tokenizer. Not the file's formatting or its decoder."""
    fields = {key: spec.get(key) for key in ("model", "added_tokens", "normalizer", "pre_tokenizer")}
    canonical = json.dumps(fields, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def tokenizer_file(spec: str) -> Path:
    """The tokenizer.json that `spec` (a file or a directory holding one) names."""
    path = Path(spec)
    if not path.exists():
        raise TokenizerError(f"tokenizer '{spec}' does not exist")
    if path.is_dir():
        path = path / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(f"tokenizer directory '{spec}' has no {TOKENIZER_FILE}")
    return path


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str | None) -> Tokenizer:
    """The byte tokenizer for None, else the tokenizer.json `spec` names; TokenizerError if unusable."""
    if spec is None or spec in ("", "bytes"):
        return ByteTokenizer()
    return HFTokenizer(tokenizer_file(spec))


def vocab_size_of(spec: str | None) -> int:
    return load_tokenizer(spec).vocab_size


registry.TOKENIZER_VOCAB.declare(vocab_size_of)  # what config/ checks against the model's vocabulary


def train_tokenizer(texts: Iterable[str], vocab_size: int, out: Path) -> HFTokenizer:
    """Train a byte-level BPE tokenizer (GPT-2's scheme: any text encodes, no unknown token) and
    write it to `out` (a tokenizer.json, or a directory that gets one); offline."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    special = [EOT_NAMES[0]]
    minimum = len(pre_tokenizers.ByteLevel.alphabet()) + len(special)
    if vocab_size < minimum:
        raise TokenizerError(f"vocab size {vocab_size} is too small for byte-level BPE (at least {minimum})")
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_nonempty(texts), trainer=trainer)
    target = out / TOKENIZER_FILE if out.is_dir() or not out.suffix else out
    target.parent.mkdir(parents=True, exist_ok=True)
    backend.save(str(target))
    return HFTokenizer(target)


def _nonempty(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        if text:
            yield text
