"""What checksums cost: blake2b in memory, a file written through TableWriter (hashed
while its bytes go out) against the same table written by pyarrow alone, and `storage.verify`
(the extra read pass a fold or `validate` makes over a file).  One core, page cache warm.

    python bench/bench_checksum.py [--mb 256]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from warehouse import schema, store
from warehouse.storage import HashingStream, open_storage, verify


def best(f, repeats=3):
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        out.append(time.perf_counter() - t)
    return min(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    args = ap.parse_args()
    n = args.mb << 20
    buf = os.urandom(n)
    for name in ("blake2b", "sha256"):
        dt = best(lambda: hashlib.new(name, buf).digest())
        print(f"{name} in memory: {n / dt / 1e6:,.0f} MB/s")
    d, rows = 512, n // (4 * 512)
    vec = np.random.default_rng(0).standard_normal((rows, d)).astype(np.float32)
    cols = {"model": ["m"] * rows, "checkpoint": ["c"] * rows, "step": [0] * rows, "source": ["s"] * rows,
            "shard": ["1-of-1"] * rows, "layer": np.zeros(rows, np.int16), "token_id": np.arange(rows, dtype=np.int32),
            "n": np.ones(rows, np.int64), "sum_sq": np.ones(rows), "vec": store.list_array(vec)}
    sch = schema.TOKEN_SUMS
    table = pa.table({k: cols[k] for k in sch.names}, schema=sch)
    with tempfile.TemporaryDirectory() as tmp:
        st = open_storage(tmp)
        rels = []

        def through_writer():
            w = store.TableWriter(st, "token_sums", {"model": "m", "checkpoint": "c", "source": "s",
                                                     "shard": "1-of-1"}, store.new_run_id())
            w.write({k: table.column(k) for k in sch.names})
            rels.append(w.close())

        def plain():
            pq.write_table(table, os.path.join(tmp, "plain.parquet"), **schema.write_options("token_sums", sch))

        def sink(hashed: bool):
            def go():
                with pa.OSFile(os.path.join(tmp, "sink.parquet"), "wb") as f:
                    out = pa.PythonFile(HashingStream(f), mode="w") if hashed else f
                    pq.write_table(table, out, **schema.write_options("token_sums", sch))
            return go

        t_raw, t_hs = best(sink(False)), best(sink(True))
        print(f"the same Parquet write into a file: {t_raw:.2f} s; through HashingStream: {t_hs:.2f} s "
              f"(+{(t_hs - t_raw) / t_raw * 100:.0f} %)")
        t_plain, t_hashed = best(plain), best(through_writer)
        size = os.path.getsize(os.path.join(tmp, rels[-1]))
        print(f"token_sums file of {size / 1e6:,.0f} MB: pyarrow alone {t_plain:.2f} s, TableWriter "
              f"(temp + fsync + rename + blake2b while writing) {t_hashed:.2f} s")
        want = store.written_checksum(st, rels[-1])

        def check():
            verify(st, rels[-1], want)

        dt = best(check)
        print(f"verify (one sequential read + blake2b): {size / dt / 1e6:,.0f} MB/s")


if __name__ == "__main__":
    main()
