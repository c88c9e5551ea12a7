"""Small offline corpora the tests train tokenizers and nodes on (no hub is reachable here), and a real
one the benchmarks train on: the Python standard library's sources."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import sysconfig
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def parquet_files(root: Path) -> dict[str, Path]:
    """Two parquet files of 300 short documents under `root`: one with a `text` column (what a
    dataset usually names it) and the same documents under `content` (a dataset --text-column names)."""
    rng = random.Random(1)
    words = "a river of small stones runs under seven old bridges and the birds count them".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(10, 50))) for _ in range(300)]
    pq.write_table(pa.table({"text": docs}), root / "docs.parquet")
    pq.write_table(pa.table({"content": docs}), root / "content.parquet")
    return {"root": root, "parquet": root / "docs.parquet", "content": root / "content.parquet"}


# --- real text present on every machine: the Python standard library's sources (benchmarks/deep.py) ---

def held_out(relative: str, every: int) -> bool:
    """Whether the file at `relative` (a path under the corpus root, '/'-separated) is held out: about one
    file in `every`, chosen by a hash of its path, so the choice is the same on every machine and does not
    depend on which other files exist."""
    return zlib.crc32(relative.encode()) % every == 0


def order_by_file(relatives: list[str], every: int) -> list[str]:
    """The files in the order the corpus is written: the training files sorted by path, then the held-out
    files sorted by path. The node holds out the last 5 % of a corpus's tokens (docs/models.md, Train your
    own model), so with about 1/every > 5 % of the text in held-out files the eval split is made of held-out
    files only (of which the first, in part, and any beyond the last 5 % are trained on as well)."""
    ordered = sorted(relatives)
    return [r for r in ordered if not held_out(r, every)] + [r for r in ordered if held_out(r, every)]


HELD_OUT_SHARE = 0.08  # of the corpus's text in held-out files: above the node's 5 % eval tail


def write_stdlib_corpus(out: Path, max_bytes: int, every: int = 8, root: Path | None = None) -> dict[str, int]:
    """The standard library's *.py files (site-packages and caches left out) as a jsonl corpus at `out`,
    one document per file in `order_by_file`'s order: training files up to `max_bytes`, then held-out
    files until they hold HELD_OUT_SHARE of the text, so the node's eval split (the last 5 % of the
    tokens) lies in held-out files. Files that are not UTF-8 are skipped. Returns counts."""
    base = root if root is not None else Path(sysconfig.get_paths()["stdlib"])
    files = [p.relative_to(base).as_posix() for p in base.rglob("*.py")
             if "site-packages" not in p.parts and "__pycache__" not in p.parts]
    written = {"train_files": 0, "train_bytes": 0, "held_out_files": 0, "held_out_bytes": 0}
    with out.open("w", encoding="utf-8") as sink:
        for relative in order_by_file(files, every):
            kind = "held_out" if held_out(relative, every) else "train"
            try:
                text = (base / relative).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if kind == "train" and written["train_bytes"] + len(text) > max_bytes:
                continue
            total = written["train_bytes"] + written["held_out_bytes"]
            if kind == "held_out" and written["held_out_bytes"] >= HELD_OUT_SHARE * total:
                break
            sink.write(json.dumps({"text": text, "path": relative}) + "\n")
            written[f"{kind}_files"] += 1
            written[f"{kind}_bytes"] += len(text)
    return written


def stdlib_shards(cache_dir: Path, corpus_mb: float, vocab_size: int) -> dict[str, Any]:
    """The standard library's corpus (at most `corpus_mb` MB of training files), a byte-level BPE of
    `vocab_size` trained on it and its token shards, made with the project's own CLI (`diloco-node
    tokenizer train`, `diloco-node tokenize`) once and cached under `cache_dir` (no download, ever):
    the data of benchmarks/deep.py and benchmarks/learning.py."""
    root = cache_dir / f"stdlib-{corpus_mb:g}mb-v{vocab_size}"
    tokenizer, shards = root / "tokenizer", root / "shards"
    if not (shards / "done").exists():
        root.mkdir(parents=True, exist_ok=True)
        corpus = root / "corpus.jsonl"
        counts = write_stdlib_corpus(corpus, int(corpus_mb * 1e6))
        (root / "corpus.json").write_text(json.dumps(counts))
        for argv in (["tokenizer", "train", "--data", str(corpus), "--vocab-size", str(vocab_size), str(tokenizer)],
                     ["tokenize", "--data", str(corpus), "--tokenizer", str(tokenizer), str(shards)]):
            done = subprocess.run([sys.executable, "-m", "diloco_node", *argv], capture_output=True, text=True,
                                  check=False)
            if done.returncode != 0:
                raise SystemExit(f"`diloco-node {' '.join(argv)}` failed: {done.stderr.strip()[-2000:]}")
            print(f"  {done.stdout.strip() or done.stderr.strip().splitlines()[-1]}", flush=True)
        (shards / "done").write_text("")
    return {"cache": str(root), "tokenizer": str(tokenizer), "shards": str(shards),
            "corpus": json.loads((root / "corpus.json").read_text())}
