"""What connect()'s checksum verification costs at start-up (warehouse/query/checks.py):
`cli.py sql "SELECT 1"` over tiny warehouses of N uncompacted partials, with a cold verified-files
cache (every listed file hashed once) and a warm one (stat() calls only), over the bare imports.

    python bench/bench_connect_verify.py --partials 8,512
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_scale import best, child, time_imports, tiny_warehouse  # noqa: E402

from warehouse import query, store  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--partials", default="8,512")
    a = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    imports = time_imports()
    print(f'python -c "import duckdb, pyarrow.dataset, typer": {imports[0]:.2f} s wall, {imports[1]:.2f} s CPU (best of 3)')
    print("cli.py sql 'SELECT 1', seconds over the imports, wall / CPU; in-process verify_listed() seconds")
    for n in [int(x) for x in a.partials.split(",")]:
        wh = base / f"wh-{n}"
        tiny_warehouse(wh, n)
        manifest = store.read_manifest(wh)
        files = sum(len(e["files"]) for e in manifest["entries"].values())
        size = sum(c["size"] for e in manifest["entries"].values() for c in (e.get("checksums") or {}).values())
        cli = [str(Path(__file__).resolve().parent.parent / "cli.py"), "sql", "SELECT 1", "--warehouse", str(wh),
               "--format", "csv"]
        colds = []
        for i in range(3):  # a fresh cache directory each time: every file hashed
            os.environ["XDG_CACHE_HOME"] = str(base / f"cold-{n}-{i}")
            colds.append(child(*cli))
        cold = (min(w for w, _ in colds), min(c for _, c in colds))
        warm = best(*cli)  # the last cold run filled this cache
        os.environ["XDG_CACHE_HOME"] = str(base / f"inproc-{n}")
        t0 = time.perf_counter()
        hashed = query.verify_listed(wh, manifest)
        t_cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert query.verify_listed(wh, manifest) == 0
        t_warm = time.perf_counter() - t0
        print(f"{n:4d} partials, {files} files, {size / 1e6:.1f} MB: cold {cold[0] - imports[0]:.2f}/"
              f"{cold[1] - imports[1]:.2f} s, warm {warm[0] - imports[0]:.2f}/{warm[1] - imports[1]:.2f} s; "
              f"verify_listed cold {t_cold:.3f} s ({hashed} hashed), warm {t_warm:.3f} s", flush=True)


if __name__ == "__main__":
    main()
