"""connect() with every view against connect(views=[...]) on one warehouse: best and median of 20, seconds.

Usage: python bench/bench_connect.py WAREHOUSE
"""

import statistics
import sys
import time
import warnings

from warehouse.query import connect, view_closure

FIVE = ["inter_sim", "intra_sim", "avg_intra_sim", "anisotropy", "drift"]


def main(wh: str) -> None:
    warnings.simplefilter("ignore")  # (pending partials)
    for views in (None, ["inter_sim"], FIVE, ["runs"]):
        connect(wh, views=views).close()
        times = []
        for _ in range(20):
            t = time.perf_counter()
            connect(wh, views=views).close()
            times.append(time.perf_counter() - t)
        bound = "every view" if views is None else f"{len(view_closure(views))} views"
        print(f"views={views}: {bound} bound, best {min(times):.4f} s, median {statistics.median(times):.4f} s")


if __name__ == "__main__":
    main(sys.argv[1])
