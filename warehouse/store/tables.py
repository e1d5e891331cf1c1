"""Writing table files: `TableWriter` streams one table's rows into one Parquet file that appears under
its final name only when closed (see warehouse.storage), hashed while its bytes go out and
protected by its run's lease from the first byte; plus whole small files replaced atomically.
A file becomes visible to queries only once a commit record lists it (log.publish).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from common import faults

from .. import schema
from ..storage import HashingStream, open_storage
from .leases import hold_lease
from .paths import partition_dir
from .verified import note_written


def atomic_write_bytes(root, rel: str, data: bytes) -> None:
    open_storage(root).replace(rel, data)


def list_array(M) -> pa.ListArray:
    """Rows of a (m, d) numpy array as an Arrow list column (the vector columns' layout)."""
    m, d = M.shape
    return pa.ListArray.from_arrays(pa.array(np.arange(0, (m + 1) * d, d, dtype=np.int32)), pa.array(M.reshape(-1)))


class TableWriter:
    """Streams record batches of one table into one Parquet file that appears (under its final
    name) only when `close` returns."""

    def __init__(self, root, table: str, values: dict[str, str], run_id: str,
                 arrow_schema: pa.Schema | None = None):
        self.storage = open_storage(root)
        self.rel = f"{partition_dir(table, values)}/{run_id}.parquet"
        self.schema = arrow_schema or schema.TABLES[table]
        hold_lease(self.storage, run_id)  # before the first byte: validate --fix leaves the file alone
        self._out = self.storage.output(self.rel)
        self._hash = HashingStream(self._out.stream)  # the checksum, computed while the bytes go out
        self._writer = pq.ParquetWriter(pa.PythonFile(self._hash, mode="w"), self.schema,
                                        **schema.write_options(table, self.schema))

    def write(self, columns: dict) -> None:
        self._writer.write_table(pa.table(columns, schema=self.schema))
        faults.hit("write")

    def close(self) -> str:
        self._writer.close()
        faults.hit("close")
        self._out.commit()
        note_written(self.storage, self.rel, self._hash.checksum())
        return self.rel

    def abort(self) -> None:
        try:
            self._writer.close()
        except Exception:
            pass
        self._out.abort()
