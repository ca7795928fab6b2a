"""Parquet corpus fixtures written by pyarrow (the writer real datasets come from), for data/tests/it/corpus.rs.

    python -m venv .venv && .venv/bin/pip install pyarrow==26.0.1
    .venv/bin/python scripts/golden/corpus_fixtures.py
"""
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

OUT = Path(__file__).resolve().parents[2] / "data" / "tests" / "fixtures"
DOCS = [
    "Shall I compare thee to a summer's day?",
    "Thou art more lovely and more temperate: caf\u00e9, na\u00efve, \u4e2d\u6587.",
    "Rough winds do shake the darling buds of May,",
]


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    # The Hugging Face datasets layout: string column + an id, snappy, two row groups.
    table = pa.table({"id": pa.array([0, 1, 2], pa.int64()), "text": pa.array(DOCS, pa.string())})
    pq.write_table(table, OUT / "sonnet_snappy.parquet", compression="snappy", row_group_size=2)
    # large_string, zstd: the codec k3mini's own shards use.
    table = pa.table({"content": pa.array(DOCS, pa.large_string())})
    pq.write_table(table, OUT / "sonnet_large_zstd.parquet", compression="zstd")
    # A null row: must be refused with its row number.
    table = pa.table({"text": pa.array([DOCS[0], None], pa.string())})
    pq.write_table(table, OUT / "with_null.parquet", compression="snappy")
    for p in sorted(OUT.glob("*.parquet")):
        print(p.name, p.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
