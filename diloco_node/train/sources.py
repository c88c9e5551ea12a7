"""Reading what --data names: its documents (text), or its bytes for the byte-level corpus.

One job: turn a --data value into text, whatever it names: a local text file or directory, jsonl/json,
parquet or arrow files (through `datasets`), a hub dataset streamed (`hf:NAME[:CONFIG][:SPLIT]`), or
nothing (the embedded corpus: this Python's stdlib sources, always there offline). Tokenizing and the
held-out split are tokens.py's; token shards are shards.py's. Every unusable source is a DataError
whose message is one line, so that the CLI and the node's start-up can print it as it is.
"""

from __future__ import annotations

import json
import logging
import os
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from diloco_node.errors import NodeError
from diloco_node.train import shards

logger = logging.getLogger(__name__)

# Below this a 128-byte window sampler repeats itself almost immediately and the eval split is a
# handful of windows; a corpus this small is almost certainly the wrong path.
MIN_CORPUS_BYTES = 4096
_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "__pycache__"})


class DataError(NodeError, ValueError):
    """A corpus that cannot be used; the message is one line, fit for the CLI to print."""


DATASET_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
HUB_PREFIX = "hf:"
HUB_TIMEOUT = 5.0  # seconds to reach the hub before saying it cannot be reached
TOKENIZE_CHUNK = 512  # documents per tokenizer call (tokenizers parallelises within one call), and per dataset read


def data_error(spec: str, exc: BaseException) -> DataError:
    """`exc` (a library's error, often many lines) as a DataError: its first line."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return DataError(f"data '{spec}' cannot be read: {first}")


def embedded_corpus(max_bytes: int = 4_000_000) -> bytes:
    """The running Python's stdlib ``.py`` sources, in sorted path order, up to ``max_bytes``.

    Always available offline. Test suites and site-packages are skipped because they differ
    between installs; what remains is the same for every node on the same Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place steers os.walk; sorting makes the walk order deterministic.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                data = (Path(dirpath) / name).read_bytes()
            except OSError:
                continue
            parts.append(data)
            total += len(data)
            if total >= max_bytes:
                return b"".join(parts)[:max_bytes]
    return b"".join(parts)[:max_bytes]


def _read_jsonl(path: Path) -> bytes:
    texts: list[bytes] = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise DataError(f"data file '{path}' line {lineno}: not valid JSON ({exc})") from exc
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f"data file '{path}' line {lineno}: no string field 'text'")
            texts.append(text.encode("utf-8"))
    return b"\n".join(texts)


def _read_directory(path: Path) -> bytes:
    parts: list[bytes] = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(dirnames)
        for name in sorted(filenames):
            file = Path(dirpath) / name
            if not file.is_file():
                continue
            data = file.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                logger.debug("skipping non-UTF-8 file path=%s", file)
                continue
            parts.append(data)
    return b"\n".join(parts)


def load_corpus(path: str | None) -> bytes:
    """Load the training corpus; ``None`` means the embedded stdlib corpus."""
    if path is None:
        corpus = embedded_corpus()
        source = "embedded stdlib corpus"
    else:
        p = Path(path)
        if not p.exists():
            raise DataError(f"data path '{path}' does not exist")
        try:
            if p.is_dir():
                corpus = _read_directory(p)
            elif p.suffix == ".jsonl":
                corpus = _read_jsonl(p)
            else:
                corpus = p.read_bytes()
        except OSError as exc:
            raise DataError(f"data path '{path}' cannot be read: {exc.strerror}") from exc
        source = f"data path '{path}'"
    if not corpus:
        raise DataError(f"{source} is empty")
    if len(corpus) < MIN_CORPUS_BYTES:
        raise DataError(
            f"{source} is too small: {len(corpus)} bytes (need at least {MIN_CORPUS_BYTES})"
        )
    logger.info("loaded corpus source=%r bytes=%d", source, len(corpus))
    return corpus


def _quiet_datasets() -> Any:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def column_texts(dataset: Any, column: str, spec: str) -> Iterator[str]:
    """The text column's values, in order; DataError when the column is missing or not text."""
    names = list(dataset.column_names or [])
    if column not in names:
        raise DataError(f"data '{spec}' has no text column '{column}' (columns: {', '.join(names) or 'none'}; "
                        "choose one with --text-column)")
    for batch in dataset.select_columns([column]).iter(batch_size=TOKENIZE_CHUNK):
        for value in batch[column]:
            if value is None:
                continue
            if not isinstance(value, str):
                raise DataError(f"data '{spec}' column '{column}' holds {type(value).__name__}, not text")
            yield value


def _local_dataset(fmt: str, files: list[Path], spec: str) -> Any:
    datasets = _quiet_datasets()
    try:
        return datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train")
    except Exception as exc:  # pyarrow and datasets raise many types for a file they cannot parse
        raise data_error(spec, exc) from None


def files_under(root: Path) -> list[Path]:
    """The files under `root`, hidden ones skipped, in sorted order (directory by directory)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found.extend(Path(dirpath) / name for name in sorted(filenames) if not name.startswith("."))
    return found


def _text_documents(files: list[Path]) -> Iterator[str]:
    for file in files:
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise DataError(f"data file '{file}' cannot be read: {exc.strerror}") from None
        try:
            yield data.decode("utf-8")
        except UnicodeDecodeError:
            logger.debug("skipping non-UTF-8 file path=%s", file)


def parse_hub(spec: str) -> tuple[str, str | None, str]:
    """hf:NAME[:CONFIG][:SPLIT] → (name, config, split); split defaults to train."""
    parts = spec[len(HUB_PREFIX):].split(":")
    if not parts[0] or len(parts) > 3 or any(not p for p in parts[1:]):
        raise DataError(f"data '{spec}' is not hf:NAME[:CONFIG][:SPLIT]")
    return parts[0], parts[1] if len(parts) > 1 else None, parts[2] if len(parts) > 2 else "train"


def _check_hub(spec: str) -> None:
    """DataError at once when the hub cannot be reached (datasets itself retries for about 25 s)."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    fix = "download it where the hub is reachable and pass local files (parquet, jsonl, arrow or shards) to --data"
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise DataError(f"data '{spec}' is a hub dataset and the hub is switched off (HF_HUB_OFFLINE): {fix}")
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # the hub is reached through the proxy: datasets itself finds out
    url = urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=HUB_TIMEOUT).close()
    except OSError as exc:
        raise DataError(f"data '{spec}': the hub ({url.hostname}) cannot be reached ({exc.strerror or exc}): "
                        f"{fix}") from None


def hub_loader(spec: str) -> Callable[[], Any]:
    """A function that opens the hub dataset `spec` as a stream (datasets' IterableDataset)."""
    name, config, split = parse_hub(spec)
    _check_hub(spec)
    datasets = _quiet_datasets()

    def load() -> Any:
        try:
            return datasets.load_dataset(name, config, split=split, streaming=True)
        except Exception as exc:
            raise data_error(spec, exc) from None
    load()  # fails here, at start-up, when the name, config or split is wrong
    return load


def documents(spec: str | None, text_column: str = "text",
              expect: Callable[[int], None] | None = None) -> Iterator[str]:
    """The documents of a local text source (what `tokenizer train` reads); DataError when unusable.
    `expect` is told how many there are, where the source knows before reading them (local
    files: a dataset's rows, or one document per text file), for a progress bar's total."""
    expect = expect or (lambda total: None)
    if spec is None:
        expect(1)
        yield embedded_corpus().decode("utf-8", errors="replace")
        return
    if spec.startswith(HUB_PREFIX):
        stream = hub_loader(spec)()
        yield from column_texts(stream, text_column, spec)
        return
    path = Path(spec)
    if not path.exists():
        raise DataError(f"data path '{spec}' does not exist")
    files = files_under(path) if path.is_dir() else [path]
    if any(f.suffix == shards.SUFFIX for f in files):
        raise DataError(f"data '{spec}' holds token shards, not text")
    formats = {DATASET_FORMATS[f.suffix] for f in files if f.suffix in DATASET_FORMATS}
    if len(formats) > 1:
        raise DataError(f"data directory '{spec}' mixes {', '.join(sorted(formats))} files: keep one format")
    if formats:
        fmt = formats.pop()
        dataset = _local_dataset(fmt, [f for f in files if DATASET_FORMATS.get(f.suffix) == fmt], spec)
        expect(len(dataset))
        yield from column_texts(dataset, text_column, spec)
    else:
        expect(len(files))
        yield from _text_documents(files)
