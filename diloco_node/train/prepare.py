"""The offline preparation commands: `diloco-node tokenizer train` and `diloco-node tokenize`.

Run once, before training, on --data: a tokenizer trained on its documents, or its tokens written
as llm.c-layout shards (with the held-out split the node would cut, in `*_val_*` files), which a node
then maps instead of tokenizing at every start.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from diloco_node.train import shards
from diloco_node.train.sources import HUB_PREFIX, DataError, column_texts, documents, parse_hub
from diloco_node.train.tokenizer import Tokenizer, load_tokenizer
from diloco_node.train.tokens import Tally, pack, read_source, tallied


def train_tokenizer_from(spec: str | None, vocab_size: int, out: Path, text_column: str = "text",
                         tally: Tally | None = None) -> Tokenizer:
    """`diloco-node tokenizer train`: a byte-level BPE tokenizer trained on --data's documents;
    `tally` is told of every document read (its length in characters), for the command's progress."""
    from diloco_node.train.tokenizer import train_tokenizer

    if spec is not None and spec.startswith(HUB_PREFIX):
        raise DataError(f"data '{spec}': train a tokenizer on local files (a hub stream has no end to train on)")
    texts = documents(spec, text_column, tally.expect if tally else None)
    return train_tokenizer(tallied(texts, tally), vocab_size, out)


def write_shards(spec: str | None, tokenizer_spec: str | None, out: Path, text_column: str = "text",
                 max_tokens: int = 0, shard_tokens: int = shards.SHARD_TOKENS,
                 tally: Tally | None = None) -> tuple[list[Path], int, int]:
    """`diloco-node tokenize`: --data as llm.c-layout shards under `out`, the held-out split in `*_val_*`
    files (what the node holds out from the source itself). Returns the shards and the train and eval
    token counts. `max_tokens` (0: all) bounds the train tokens, for a hub stream that would not end;
    `tally` is told how many documents there are (where known) and of every one tokenized (its
    token count), for tokenize's progress."""
    tokenizer = load_tokenizer(tokenizer_spec)
    source = read_source(spec, tokenizer, text_column, tally)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"output directory '{out}' cannot be made: {exc.strerror}") from None
    prefix = ("data" if spec is None else parse_hub(spec)[0].rsplit("/", 1)[-1] if spec.startswith(HUB_PREFIX)
              else Path(spec).stem or "data")
    evals = shards.ShardWriter(out, prefix, "val", tokenizer.vocab_size, shard_tokens)
    evals.add(source.eval)
    train = shards.ShardWriter(out, prefix, "train", tokenizer.vocab_size, shard_tokens)
    if source.stream is not None:
        stream = source.stream().skip(source.skip)
        pieces: Iterable[np.ndarray] = tallied(pack(tokenizer, column_texts(stream, text_column, str(spec))),
                                                tally)
    else:
        pieces = source.train
    taken = 0
    for piece in pieces:
        if max_tokens and taken + len(piece) >= max_tokens:
            train.add([piece[:max_tokens - taken]])
            break
        train.add([piece])
        taken += len(piece)
    paths = evals.close() + train.close()
    return paths, train.tokens, evals.tokens
