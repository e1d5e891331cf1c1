"""At the sweep's scale: the views bind without opening every partial (start-up constant in the
number of uncompacted partials), locally and on S3; a sweep compacts each finished checkpoint."""

from __future__ import annotations

import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import ROOT, call_all

sys.path.insert(0, str(ROOT / "bench"))
from bench_scale import write_partial, write_vocab  # noqa: E402  (the extract writer, synthetic sums)

DTYPES = ("float16", "float32", "float64")


def many_partials(wh, n: int) -> list[dict]:
    """n tiny partials (3 sources × n/3 shards, one vector dtype per source: the dtype is part of a partial's
    identity), through the extract writer, one commit."""
    from warehouse import merge

    merge.commit(wh, [write_vocab(wh, "m", "main", None, 64, 8)])
    entries = [write_partial(wh, "m", "main", None, f"s{i % 3}", (i // 3 + 1, n // 3), 2, 64, 8, seed=i, types=0.5,
                             vector_dtype=DTYPES[i % 3]) for i in range(n)]
    merge.commit(wh, entries)
    return entries


def first_bound(wh) -> str:
    """The token_sums file the view binds by (the first of the list)."""
    from warehouse import query, store

    manifest = store.read_manifest(wh)
    return query.bound_files("token_sums", [e for e in manifest["entries"].values() if "token_sums" in e["files"]])[0]


def test_views_bind_by_one_file_and_read_every_dtype_exactly(tmp_path, monkeypatch):
    """Views are created from one footer: every other partial's token_sums file broken (not a
    Parquet file any more) still lets `connect`, SELECT 1 and the views over merged tables work —
    with union_by_name the views' creation read every footer (and failed here).  Before breaking
    them: token_sums returns every partial's stored vectors exactly, float16/float32/float64 mixed,
    whichever file sorts first.  connect() itself now refuses the broken files (it verifies every
    listed file's checksum), so the binding is checked with that verification switched off."""
    from common.errors import UserError
    from warehouse import query
    from warehouse.query import connect

    wh = tmp_path / "wh"
    entries = many_partials(wh, 48)
    con = connect(wh)
    assert con.execute("SELECT typeof(vec) FROM token_sums LIMIT 1").fetchone()[0] == "DOUBLE[]"
    for e in entries[:6]:  # each dtype twice: the view's values are the file's, widened exactly
        want = pq.read_table(wh / e["files"]["token_sums"]).sort_by([("layer", "ascending"), ("token_id", "ascending")])
        got = con.execute("SELECT vec FROM token_sums WHERE source = ? AND shard = ? ORDER BY layer, token_id",
                          [e["source"], e["shard"]]).fetchall()
        assert [r[0] for r in got] == [list(map(float, np.asarray(v, dtype=np.float64))) for v in
                                       want.column("vec").to_pylist()]
    before = con.execute("SELECT * FROM avg_intra_sim ORDER BY ALL").fetchall()
    con.close()
    keep = first_bound(wh)
    for e in entries:
        if e["files"]["token_sums"] != keep:
            (wh / e["files"]["token_sums"]).write_bytes(b"not parquet")
    with pytest.raises(UserError, match="token_sums.*its commit record says"):
        connect(wh)  # connect() verifies every listed file (warehouse/query/checks.py) ...
    monkeypatch.setattr(query, "verify_listed", lambda root, manifest: 0)  # ... here: the binding alone
    con = connect(wh)
    assert con.execute("SELECT 1").fetchone() == (1,)
    assert con.execute("SELECT * FROM avg_intra_sim ORDER BY ALL").fetchall() == before  # merged tables only
    with pytest.raises(Exception):
        con.execute("SELECT sum(n) FROM token_sums").fetchall()  # the broken files are read only by a query
    con.close()


def compacted(wh) -> dict[str, bool]:
    from warehouse import merge, store

    manifest = store.read_manifest(wh)
    pairs = sorted({(e["model"], e["checkpoint"]) for e in manifest["entries"].values() if e["kind"] == "data"})
    return {c: merge.is_compacted(manifest, m, c) for m, c in pairs}


def disk(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*.parquet"))


def test_sweep_compacts_each_finished_checkpoint(workdir, sources, model_factory):
    """`cli.py sweep` compacts each checkpoint once its units (2 shards) are in; --no-compact keeps them
    open; every view is the same either way, and `extract --compact` does the same for its checkpoint."""
    import shutil

    from conftest import run_cli, same_numbers, views
    from warehouse import merge, store

    root = workdir / "models" / "sweep-compact"
    for step in ("step0", "step5"):
        if not (root / step).exists():
            shutil.copytree(model_factory("gpt_neox", tied=True), root / step)
    config = workdir / "sweep-compact.toml"
    config.write_text(f'models = [{{ model = "{root}", checkpoints = "all" }}]\nshards = 2\n'
                      f'[sources]\nalpha = "{sources["alpha"]}"\n[settings]\nmax_length = 32\nbatch-size = 2\n')
    wh, open_wh = workdir / "sweep-compact-wh", workdir / "sweep-compact-open"
    code, _, err = run_cli("sweep", config, "--warehouse", wh)
    assert code == 0, err
    for step in ("step0", "step5"):  # the units appended; each checkpoint folded once, then compacted
        assert f"sweep-compact@{step}: every unit in; folded 2 partial(s)" in err, err
        assert f"sweep-compact@{step}: compacted" in err
    assert compacted(wh) == {"step0": True, "step5": True}
    code, _, err = run_cli("sweep", config, "--warehouse", open_wh, "--no-compact")
    assert code == 0, err
    assert compacted(open_wh) == {"step0": False, "step5": False}
    assert merge.pending(store.read_manifest(open_wh)) == {}  # folded all the same
    assert disk(wh) < disk(open_wh)
    same_numbers(views(wh), views(open_wh), tol=1e-12)
    code, _, err = run_cli("sweep", config, "--warehouse", open_wh)  # nothing left to run: the finished ones compacted
    assert code == 0 and compacted(open_wh) == {"step0": True, "step5": True}, err

    one = workdir / "extract-compact"
    code, _, err = run_cli("extract", "--model", root, "--checkpoint", "step5", "--source", f"alpha={sources['alpha']}",
                           "--max-length", 32, "--batch-size", 2, "--compact", "--warehouse", one)
    assert code == 0, err
    assert compacted(one) == {"step5": True}
    code, _, err = run_cli("extract", "--model", root, "--checkpoint", "step5", "--source", f"alpha={sources['alpha']}",
                           "--max-length", 32, "--batch-size", 2, "--shard", "1/2", "--warehouse", one)
    assert code == 2 and "compact" in err  # a compacted checkpoint takes no new partial


def _reduce_worker(rank: int, world: int, store_path: str, out: str) -> None:
    """One rank of an in-test gloo group: its synthetic sums (its own half of the vocabulary, chunks of
    3 rows) reduced by ranges of 7 token ids; rank 0 saves what it would write."""
    import torch.distributed as dist

    from bench_scale import SyntheticSums
    from extract.reduce import Reducer
    from extract.run import SourceResult

    class Small(SyntheticSums):
        def layer_rows(self, layer, chunk_rows=None):
            return super().layer_rows(layer, 3)

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    red = Reducer(rank, world, "cpu")
    red._open, red.range_rows = True, 7
    src = type("Src", (), {"name": "s", "split_value": None})()
    acc = Small(3, 50, 4, seed=rank, types=0.5, moments=True)
    got = red.reduce([(src, SourceResult("s", tokens=10 + rank), acc)], missing=None)
    if rank == 0:
        (_, result, r), = got
        arrays = {"tokens": np.array(result.tokens), "sum_h": r.sum_h.numpy(), "n_mom": r.moments.n.numpy(),
                  "s2": np.stack([r.moments.s2(i) for i in range(3)])}
        for layer in range(3):
            rows = list(r.layer_rows(layer))
            arrays[f"ids{layer}"] = np.concatenate([x[0] for x in rows])
            arrays[f"n{layer}"] = np.concatenate([x[1] for x in rows])
            arrays[f"S{layer}"] = np.concatenate([x[2] for x in rows])
        np.savez(out, **arrays)
        r.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_by_token_ranges_equals_the_dense_sum(tmp_path, world):
    """The reduce's arithmetic against the slow, obvious way: each rank holds its own random half of 50
    token types (ranks see different types), yielded in chunks of 3 rows and reduced by ranges of 7 ids
    (chunks and ranges misaligned); rank 0's rows equal the dense float64 sum over the ranks (ids
    ascending, zero-count types left out, n exact), and so do Σh, the moments' n and Σhhᵀ."""
    from bench_scale import SyntheticSums

    out = tmp_path / "reduced.npz"
    call_all([(_reduce_worker, [rank, world, str(tmp_path / "store"), str(out)]) for rank in range(world)])
    got = np.load(out)
    accs = [SyntheticSums(3, 50, 4, seed=r, types=0.5, moments=True) for r in range(world)]
    assert int(got["tokens"]) == sum(10 + r for r in range(world))
    for layer in range(3):
        n, S = np.zeros(50, np.int64), np.zeros((50, 4))
        for acc in accs:
            for ids, cnt, rows in acc.layer_rows(layer, 3):
                np.add.at(n, ids, cnt)
                np.add.at(S, ids, rows)
        keep = np.flatnonzero(n)
        assert len(keep) > 25  # the ranks' types differ: the union is larger than each
        assert got[f"ids{layer}"].tolist() == keep.tolist() and got[f"n{layer}"].tolist() == n[keep].tolist()
        np.testing.assert_allclose(got[f"S{layer}"], S[keep], rtol=1e-15, atol=1e-15)
    np.testing.assert_allclose(got["sum_h"], sum(a.sum_h.numpy() for a in accs), rtol=1e-15)
    assert got["n_mom"].tolist() == sum(a.moments.n.numpy() for a in accs).tolist()
    np.testing.assert_allclose(got["s2"], np.stack([sum(a.moments.s2(i) for a in accs) for i in range(3)]), rtol=1e-14)
