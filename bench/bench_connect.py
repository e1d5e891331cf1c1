"""connect() with every view against connect(views=[...]) on one warehouse, alone and followed by one
query (`SELECT * FROM` the first named view, inter_sim for every view): best and median of 20, seconds.
The views are created unbound (DuckDB binds a view when a query reads it), so a view's binding cost
shows in the query's column.

Usage: python bench/bench_connect.py WAREHOUSE
"""

import statistics
import sys
import time
import warnings

from warehouse.query import connect, view_closure

FIVE = ["inter_sim", "intra_sim", "avg_intra_sim", "anisotropy", "drift"]


def timed(wh, views, query) -> list[float]:
    times = []
    for _ in range(21):  # the first is a warm-up
        t = time.perf_counter()
        con = connect(wh, views=views)
        if query:
            con.execute(query).fetchall()
        con.close()
        times.append(time.perf_counter() - t)
    return times[1:]


def main(wh: str) -> None:
    warnings.simplefilter("ignore")  # (pending partials)
    for views in (None, ["inter_sim"], FIVE, ["runs"]):
        bound = "every view" if views is None else f"{len(view_closure(views))} views"
        query = f"SELECT * FROM {(views or ['inter_sim'])[0]}"
        for q in (None, query):
            times = timed(wh, views, q)
            print(f"views={views}: {bound}{', then ' + q if q else ''}: best {min(times):.4f} s, "
                  f"median {statistics.median(times):.4f} s")


if __name__ == "__main__":
    main(sys.argv[1])
