"""Small offline corpora the tests train tokenizers and nodes on (no hub is reachable here)."""

from __future__ import annotations

import random
from pathlib import Path

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
