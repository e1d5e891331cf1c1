"""Merge at commit (warehouse/merge/): merged tables against the pairwise definition with 1, 2
and 8 partials, after replacing a partial, after compaction; incremental = from scratch for the
moments and samples; validate against tampering; kills during merge and compaction; layering."""

from __future__ import annotations

import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from common.errors import UserError
from conftest import ROOT, call_all, run_cli
from warehouse import merge, schema, store
from warehouse.merge import commits, fold_tokens
from warehouse.merge import fold as fold_module
from warehouse.store import log as store_log
from warehouse.query import connect
from warehouse.validate import validate

sys.path.insert(0, str(ROOT / "bench"))
from bench_query import write_partial, write_vocab  # noqa: E402

V, L, D = 300, 3, 16


def random_partial(root, rng, source, shard, step=None, checkpoint="c"):
    """A partial of model m written into `root` (not committed): a random subset of the V types, so
    that partials overlap sparsely."""
    types = rng.choice(V, size=int(rng.integers(V // 3, V)), replace=False)  # overlapping sparse subsets
    return write_partial(root, "m", checkpoint, source, shard, L, V, D, rng, types=types, step=step, chunk=37)


def oracle(root: Path, entries: list[dict]) -> dict:
    """Per group: (layer, token) → (n, sum_sq) by the pairwise definition Σ_p sum_sq_p + 2 Σ_{p<q}
    ⟨v_p, v_q⟩ over the stored vectors (float64), the merged Σû per (layer, token), and per layer
    (n, sum_sq) from layer_sums the same way."""
    out = {}
    for group in sorted({e["source"] for e in entries}) + ["all"]:
        members = [e for e in entries if group == "all" or e["source"] == group]
        parts = defaultdict(list)
        for e in members:
            t = pq.read_table(root / e["files"]["token_sums"]).to_pylist()
            for r in t:
                parts[(r["layer"], r["token_id"])].append((r["n"], r["sum_sq"], np.asarray(r["vec"], np.float64)))
        tokens, vecs = {}, {}
        for k, ps in parts.items():
            sq = sum(p[1] for p in ps) + 2 * sum(float(ps[i][2] @ ps[j][2]) for i in range(len(ps))
                                                 for j in range(i + 1, len(ps)))
            tokens[k] = (sum(p[0] for p in ps), sq)
            vecs[k] = np.sum([p[2] for p in ps], axis=0)
        layers = defaultdict(list)
        for e in members:
            for r in pq.read_table(root / e["files"]["layer_sums"]).to_pylist():
                layers[r["layer"]].append((r["n"], r["sum_sq"], np.asarray(r["vec"])))
        lay = {l: (sum(p[0] for p in ps), sum(p[1] for p in ps) + 2 * sum(
            float(ps[i][2] @ ps[j][2]) for i in range(len(ps)) for j in range(i + 1, len(ps))))
            for l, ps in layers.items()}
        out[group] = {"tokens": tokens, "vecs": vecs, "layers": lay}
    return out


def close(a, b, rtol=1e-9):
    return abs(a - b) <= rtol * max(abs(b), 1.0)


def check_against(root: Path, want: dict) -> None:
    con = connect(root, views=["intra_sim", "layer_metrics", "layer_norms", "frequency_buckets", "token_stats"])
    for group, w in want.items():
        got = {(r[0], r[1]): (r[2], r[3]) for r in con.execute(
            "SELECT layer, token_id, n, sum_sq FROM token_stats WHERE source = ? AND checkpoint = 'c'", [group]).fetchall()}
        assert set(got) == set(w["tokens"]), group
        for k, (n, sq) in w["tokens"].items():
            assert got[k][0] == n and close(got[k][1], sq), (group, k, got[k], (n, sq))
        lay = {r[0]: (r[1], r[2]) for r in con.execute(
            "SELECT layer, n, sum_sq FROM layer_norms WHERE source = ? AND checkpoint = 'c'", [group]).fetchall()}
        assert set(lay) == set(w["layers"])
        for l, (n, sq) in w["layers"].items():
            assert lay[l][0] == n and close(lay[l][1], sq)
        # frequency buckets and frequency-debiased Inter-Sim from the merged per-type vectors
        buckets = defaultdict(lambda: [0, 0, np.zeros(D)])
        unit = defaultdict(lambda: [0, np.zeros(D)])
        for (l, t), (n, _) in w["tokens"].items():
            S = w["vecs"][(l, t)]
            b = buckets[(l, int(np.floor(np.log2(n))))]
            b[0] += 1
            b[1] += n
            b[2] += S
            unit[l][0] += 1
            unit[l][1] += S / np.linalg.norm(S)
        fb = {(r[0], r[1]): r[2:] for r in con.execute(
            "SELECT layer, bucket, types, n, sum_sq FROM frequency_buckets WHERE source = ? AND checkpoint = 'c'", [group]).fetchall()}
        assert set(fb) == set(buckets)
        for k, (types, n, S) in buckets.items():
            assert fb[k][0] == types and fb[k][1] == n and close(fb[k][2], float(S @ S))
        ts = {r[0]: r[1:] for r in con.execute(
            "SELECT layer, types, types_sum_sq FROM layer_metrics WHERE source = ? AND checkpoint = 'c'", [group]).fetchall()}
        for l, (types, u) in unit.items():
            assert ts[l][0] == types and close(ts[l][1], float(u @ u))
    # the user-facing views read the merged tables
    intra = {(r[0], r[1]): r[2] for r in con.execute("SELECT layer, token_id, intra_sim FROM intra_sim WHERE checkpoint = 'c'").fetchall()}
    for k, (n, sq) in want["all"]["tokens"].items():
        if n >= 2:
            assert close(intra[k], (sq - n) / (n * n - n))
    con.close()


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(fold_tokens, "CHUNK_BYTES", 64 * 8 * D)  # 64 token ids per chunk: several per layer


@pytest.mark.parametrize("layout", [(1, 1), (1, 2), (4, 2)])
def test_merged_equals_pairwise(tmp_path, small_chunks, layout):
    sources, shards = layout
    rng = np.random.default_rng(sum(layout))
    root = tmp_path / "wh"
    merge.commit(root, [write_vocab(root, "m", "c", V, D)])
    entries = [random_partial(root, rng, f"s{s}", f"{k + 1}-of-{shards}") for s in range(sources) for k in range(shards)]
    half = max(1, len(entries) // 2)
    for e in entries[:half]:  # one commit each, then the rest in one commit of several partials
        merge.commit(root, [e])
    if entries[half:]:
        merge.commit(root, entries[half:])
    manifest = store.read_manifest(root)
    assert sum(e["kind"] == "merged" for e in manifest["entries"].values()) == sources + 1
    check_against(root, oracle(root, entries))
    assert validate(root) == []
    for e in manifest["entries"].values():  # the token state is kept only where it is not one partial's
        if e["kind"] == "merged":
            assert ("token_vectors" in e["files"]) == (e["stats"]["partials"] > 1), e["key"]


def test_a_group_of_one_partial_folds_from_that_partial(tmp_path, small_chunks):
    """A first commit writes no token_vectors (the group's state is its partial's token_sums); a re-run
    of that one partial replaces it; the next shard's fold starts from the partial and gives the
    merged Σû exactly (float64 s₁ + s₂) and the pairwise ‖Σû‖²."""
    rng = np.random.default_rng(11)
    root = tmp_path / "wh"
    first = random_partial(root, rng, "s0", "1-of-2")
    merge.commit(root, [first])
    merged = [e for e in store.read_manifest(root)["entries"].values() if e["kind"] == "merged"]
    assert len(merged) == 2 and not any("token_vectors" in e["files"] for e in merged)
    assert not list((root / "tables" / "token_vectors").rglob("*.parquet"))
    check_against(root, oracle(root, [first]))
    first = random_partial(root, rng, "s0", "1-of-2")  # a re-run of the same key: replaced, not added
    merge.commit(root, [first])
    check_against(root, oracle(root, [first]))
    second = random_partial(root, rng, "s0", "2-of-2")
    merge.commit(root, [second])
    want = oracle(root, [first, second])
    check_against(root, want)
    con = connect(root)
    for group in ("s0", "all"):
        rows = con.execute("SELECT layer, token_id, vec FROM token_vectors WHERE source = ?", [group]).fetchall()
        assert len(rows) == len(want[group]["vecs"])
        for layer, token, vec in rows:
            assert np.array_equal(np.asarray(vec), want[group]["vecs"][(layer, token)]), (group, layer, token)
    con.close()
    assert validate(root) == []


def test_a_lone_partials_rows_give_the_same_tables_as_folding_them(tmp_path, small_chunks, monkeypatch):
    """A chunk holding one added partial's rows alone is taken as it is (no fold onto zeros); its
    merged tables equal, number for number, those of the fold (forced here by an empty removal)."""
    rng = np.random.default_rng(5)
    root = tmp_path / "wh"
    e = random_partial(root, rng, "s0", "1-of-1")

    def tables(dest):
        st = merge.open_storage(dest)
        out = merge.fold_group(root, "m", "c", "s0", None, [e], [], [e], dest=dest)
        return {t: st.read_table(f).drop_columns(["source"]).sort_by(
            [(c, "ascending") for c in ("layer", "token_id", "bucket") if c in st.read_table(f).column_names])
            for t, f in out["files"].items()}

    fold, token_folds = fold_tokens.fold_rows, []

    def spy(S, *a):  # the layer totals fold one row; a chunk of token rows many
        token_folds.append(len(S) > 1)
        return fold(S, *a)

    monkeypatch.setattr(fold_tokens, "fold_rows", spy)
    monkeypatch.setattr(fold_module, "fold_rows", spy)
    fast = tables(tmp_path / "fast")
    assert token_folds and not any(token_folds)
    general = fold_tokens._merge_chunk

    def folded(o_stats, o_vecs, r_parts, a_parts, d, old):
        empty = next(t for t in a_parts if t is not None).slice(0, 0)
        return general(o_stats, o_vecs, [*r_parts, empty], a_parts, d, old)

    monkeypatch.setattr(fold_tokens, "_merge_chunk", folded)
    slow = tables(tmp_path / "slow")
    assert any(token_folds)
    assert set(fast) == set(slow) >= {"token_stats", "frequency_buckets", "layer_metrics"}
    for t in fast:
        assert fast[t].num_rows > 0 and fast[t].equals(slow[t]), t


def test_replacing_a_partial_never_double_counts(tmp_path, small_chunks):
    rng = np.random.default_rng(7)
    root = tmp_path / "wh"
    entries = [random_partial(root, rng, f"s{s}", f"{k + 1}-of-2") for s in range(4) for k in range(2)]
    for e in entries:
        merge.commit(root, [e])
    for i in (3, 3, 0):  # re-runs of the same keys with other content (the second time: twice in a row)
        e = entries[i]
        entries[i] = random_partial(root, rng, e["source"], e["shard"])
        merge.commit(root, [entries[i]])
    manifest = store.read_manifest(root)
    assert sum(e["kind"] == "data" for e in manifest["entries"].values()) == 8
    check_against(root, oracle(root, entries))
    assert validate(root) == []


def _two_shards(root: Path, seed: int) -> list[dict]:
    """Two shards of one source, committed one after the other."""
    rng = np.random.default_rng(seed)
    entries = [random_partial(root, rng, "s0", f"{k + 1}-of-2") for k in range(2)]
    for e in entries:
        merge.commit(root, [e])
    return entries


def test_validate_finds_a_wrong_merged_table_and_fixes_it(tmp_path):
    root = tmp_path / "wh"
    entries = _two_shards(root, 3)
    manifest = store.read_manifest(root)
    rel = manifest["entries"][merge.group_key("m", "c", "all")]["files"]["token_stats"]
    t = pq.read_table(root / rel)
    sq = t.column("sum_sq").to_numpy().copy()
    sq[5] *= 1 + 1e-6
    pq.write_table(t.set_column(t.schema.get_field_index("sum_sq"), "sum_sq", [sq]), root / rel)
    problems = validate(root)  # caught by its checksum (tests/test_repair.py: by re-deriving it, too)
    assert len(problems) == 1 and rel in problems[0] and "commit record" in problems[0]
    assert validate(root, fix=True) == []
    check_against(root, oracle(root, entries))


def rounded_views(root: Path) -> dict:
    """The rows of the views a merge feeds, sorted, floats rounded to 12 places: equal for equal data."""
    views = ["inter_sim", "inter_sim_by_source", "intra_sim", "avg_intra_sim", "inter_sim_by_frequency",
             "inter_sim_types", "dim_contrib", "drift", "intra_sentence_sim", "anisotropy", "linearity",
             "intrinsic_dim", "isoscore", "qk_sums", "qk_geometry_by_source", "qk_direction", "attention_sink"]
    con = connect(root, views=views)
    out = {v: sorted(tuple(round(x, 12) if isinstance(x, float) else x for x in r)
                     for r in con.execute(f"SELECT * FROM {v}").fetchall()) for v in views}
    con.close()
    return out


def test_compaction_keeps_every_view_and_closes_the_checkpoint(tmp_path):
    rng = np.random.default_rng(11)
    root = tmp_path / "wh"
    entries = [random_partial(root, rng, f"s{s}", f"{k + 1}-of-2") for s in range(2) for k in range(2)]
    merge.commit(root, [write_vocab(root, "m", "c", V, D)])
    for e in entries:
        merge.commit(root, [e])
    before = rounded_views(root)
    want = oracle(root, entries)
    res = merge.compact(root)
    assert res["after"]["bytes"] < res["before"]["bytes"] / 10
    assert rounded_views(root) == before
    manifest = store.read_manifest(root)
    for e in manifest["entries"].values():
        assert not {"token_sums", "token_vectors", "moments", "samples", "moments_merged", "samples_merged"} & set(e["files"])
    assert not list((root / "tables" / "token_sums").rglob("*.parquet"))
    assert not list((root / "tables" / "token_vectors").rglob("*.parquet"))
    assert validate(root) == []
    con = connect(root)
    got = {(r[0], r[1]): r[2] for r in con.execute(
        "SELECT layer, token_id, sum_sq FROM token_stats WHERE source = 'all'").fetchall()}
    assert all(close(got[k], sq) for k, (_, sq) in want["all"]["tokens"].items())
    with pytest.raises(UserError, match="was compacted"):  # a new shard: refused, nothing written
        merge.commit(root, [random_partial(root, rng, "s0", "1-of-3")])
    with pytest.raises(UserError, match="was compacted"):  # a re-run of a compacted partial: refused
        merge.commit(root, [random_partial(root, rng, "s0", "1-of-2")])
    assert rounded_views(root) == before
    assert validate(root, fix=True, grace_s=0) == [] and validate(root) == []  # the refused runs' files are orphans


@pytest.fixture(scope="session")
def moments_wh(workdir, sources, model_factory):
    """Three commits of a tiny model with --moments --cross-moments --sample and the attention sums (with
    their second moments and sinks): alpha in 2 shards, then beta."""
    model = model_factory("gpt_neox", tied=False)
    wh = workdir / "merge-moments"
    common = ["--model", model, "--warehouse", wh, "--max-length", 32, "--moments", "--cross-moments", "--sample", 40,
              "--attention-moments", "--attention-sinks"]
    for args in (["--source", f"alpha={sources['alpha']}", "--shard", "1/2"],
                 ["--source", f"alpha={sources['alpha']}", "--shard", "2/2"],
                 ["--source", f"beta={sources['beta']}"]):
        code, _, err = run_cli("extract", *common, *args)
        assert code == 0, err
    return {"wh": wh, "model": model, "common": common}


def test_incremental_moments_and_samples_equal_a_merge_from_scratch(moments_wh, workdir, sources):
    wh = workdir / "merge-moments-rerun"
    shutil.copytree(moments_wh["wh"], wh)
    code, _, err = run_cli("extract", *moments_wh["common"][:2], "--warehouse", wh, *moments_wh["common"][4:],
                           "--source", f"alpha={sources['alpha']}", "--shard", "1/2")  # replaces a partial
    assert code == 0, err
    for root in (moments_wh["wh"], wh):
        incremental = rounded_views(root)
        manifest = store.read_manifest(root)
        keys = [k for k, e in manifest["entries"].items() if e["kind"] == "merged"]
        assert merge.rebuild(root, keys) == len(keys) == 3
        assert_same(incremental, rounded_views(root))
    assert_same(rounded_views(wh), rounded_views(moments_wh["wh"]))  # the re-run of the same data changed nothing


def assert_same(got: dict, want: dict) -> None:
    """Equal views, floats to 1e-9 relative."""
    for view, rows in want.items():
        assert len(got[view]) == len(rows), view
        for a, b in zip(got[view], rows):
            for x, y in zip(a, b):
                assert (close(x, y) if isinstance(x, float) else x == y), (view, a, b)


def test_cli_compact_then_a_new_shard_is_refused(moments_wh, workdir, sources):
    wh = workdir / "merge-compact-cli"
    shutil.copytree(moments_wh["wh"], wh)
    before = rounded_views(wh)
    code, out, err = run_cli("compact", "--warehouse", wh)
    assert code == 0, err
    assert "B per (layer, token type)" in out
    assert rounded_views(wh) == before
    code, _, err = run_cli("extract", *moments_wh["common"][:2], "--warehouse", wh, "--max-length", 32,
                           "--source", f"gamma={sources['alpha']}")
    assert code == 2 and "was compacted" in err and len(err.strip().splitlines()) == 1, err
    assert rounded_views(wh) == before
    assert run_cli("validate", "--warehouse", wh)[0] == 0


@pytest.mark.parametrize("point,after", [("compact", False), ("manifest", False), ("gc", True)])
def test_kill_9_during_compaction(moments_wh, workdir, point, after):
    from test_reliability import run_subprocess

    wh = workdir / f"merge-kill-compact-{point}"
    shutil.copytree(moments_wh["wh"], wh)
    before = rounded_views(wh)
    done = workdir / f"merge-kill-compact-{point}-done"
    shutil.copytree(moments_wh["wh"], done)
    assert run_cli("compact", "--warehouse", done)[0] == 0
    proc = run_subprocess(["compact", "--warehouse", str(wh)], fault=f"{point}:1")
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert rounded_views(wh) == before  # the views answer exactly as before or as after (same numbers)
    compacted = merge.is_compacted(store.read_manifest(wh), "gpt_neox-untied", "main")
    assert compacted == after
    assert run_cli("validate", "--warehouse", wh, "--fix", "--grace", "0")[0] == 0
    assert run_cli("validate", "--warehouse", wh)[0] == 0
    if after:
        files = lambda r: sorted(str(p.relative_to(r)) for p in (r / "tables").rglob("*.parquet"))  # noqa: E731
        assert len(files(wh)) == len(files(done))


# ---------------------------------------------------------------- the lock-free commit log


def test_two_writers_of_one_record_exactly_one_wins(tmp_path):
    rng = np.random.default_rng(5)
    root = tmp_path / "wh"
    a, b = random_partial(root, rng, "s0", "1-of-1"), random_partial(root, rng, "s0", "1-of-1")
    seq, manifest = store.read_state(root)
    assert store.publish(root, seq, {**manifest, "entries": dict(manifest["entries"])}, [a]) is not None
    assert store.publish(root, seq, manifest, [b]) is None  # the same record number: refused
    state = store.read_manifest(root)
    assert state["entries"][a["key"]]["run_id"] == a["run_id"] and state["generation"] == 1
    assert sorted(p.name for p in (root / store.LOG_DIR).iterdir()) == [f"{1:020d}.json"]


@pytest.mark.parametrize("same_pair", [True, False])
def test_a_lost_race_refolds_or_rebases(tmp_path, monkeypatch, same_pair):
    """Writer A folds on state s; writer B commits first; A's record s+1 is refused.  Same
    (model, checkpoint): A folds again on B's state; another checkpoint: A's files are published
    on top of B's as they are."""
    rng = np.random.default_rng(9)
    root = tmp_path / "wh"
    first = random_partial(root, rng, "s0", "1-of-2")
    merge.commit(root, [first])
    a = random_partial(root, rng, "s0", "2-of-2")
    b = random_partial(root, rng, "s1", "1-of-1", checkpoint="c" if same_pair else "c2")
    real_publish, folds, raced = store.publish, [], []
    real_fold = commits.fold_groups

    def publish(root_, seq, manifest, entries, remove=()):
        if not raced:
            raced.append(True)
            merge.commit(root_, [b])  # B wins the next record
        return real_publish(root_, seq, manifest, entries, remove)

    monkeypatch.setattr(commits, "fold_groups", lambda *x: folds.append(1) or real_fold(*x))
    monkeypatch.setattr(store, "publish", publish)
    merge.commit(root, [a])
    assert len(folds) == (3 if same_pair else 2)  # A, B, (A again)
    manifest = store.read_manifest(root)
    assert manifest["generation"] == 3
    if same_pair:
        check_against(root, oracle(root, [first, a, b]))
    else:
        check_against(root, {g: w for g, w in oracle(root, [first, a]).items()})
    assert validate(root) == []


def _commit_one(args):
    root, source, shard, seed = args
    rng = np.random.default_rng(seed)
    entry = random_partial(Path(root), rng, source, shard)
    merge.commit(Path(root), [entry])
    return entry


def test_concurrent_commits_without_a_lock(tmp_path):
    """Six processes commit six partials of one checkpoint at the same time: every one lands once."""
    root = tmp_path / "wh"
    jobs = [(str(root), f"s{i % 3}", f"{i // 3 + 1}-of-2", 100 + i) for i in range(6)]
    entries = call_all([(_commit_one, [job]) for job in jobs])  # six processes at once
    manifest = store.read_manifest(root)
    assert sum(e["kind"] == "data" for e in manifest["entries"].values()) == 6
    assert manifest["generation"] == 6  # one record per commit: retries never add records
    check_against(root, oracle(root, entries))
    assert validate(root) == []


def test_a_first_commit_landing_between_the_listing_and_the_manifest_read_is_read(tmp_path, monkeypatch):
    """A reader lists an empty log, then the first commit's record and manifest.json land before it looks
    for manifest.json (the race of the test above, made certain): it reads that commit, not a lost log."""
    root = tmp_path / "wh"
    entry = _commit_one((str(root), "s0", "1-of-1", 7))
    real, calls = store_log.latest_seqs, []

    def listing(*args, **kwargs):  # the first listing: before the record landed
        calls.append(1)
        return [] if len(calls) == 1 else real(*args, **kwargs)

    monkeypatch.setattr(store_log, "latest_seqs", listing)
    seq, manifest = store_log.read_state(root)
    assert (seq, len(calls)) == (1, 2) and entry["key"] in manifest["entries"]
    shutil.rmtree(root / "_log")  # a log really lost: still an error that says so
    with pytest.raises(UserError, match="lost; restore it from a backup"):
        store_log.read_state(root)
    legacy = tmp_path / "legacy"  # manifest.json alone, no generation: an earlier version's warehouse
    legacy.mkdir()
    (legacy / "manifest.json").write_text(json.dumps({"schema_version": schema.SCHEMA_VERSION, "entries": {}}))
    with pytest.raises(UserError, match="without a commit log .written by an earlier version"):
        store_log.read_state(legacy)


def test_views_refuse_a_manifest_whose_merged_tables_are_stale(tmp_path):
    """A merged entry that holds a partial the manifest no longer lists (a hand-edited manifest, a
    warehouse restored in parts) is stale: views refuse it, validate --fix re-merges."""
    root = tmp_path / "wh"
    entries = _two_shards(root, 13)
    seq, manifest = store.read_state(root)
    assert store.publish(root, seq, manifest, [], remove=[entries[0]["key"]]) is not None
    with pytest.raises(UserError, match="merged tables do not match"):
        connect(root)
    assert any("out of date" in p for p in validate(root))
    assert validate(root, fix=True) == []
    check_against(root, oracle(root, entries[1:]))


def test_a_lost_merged_entry_is_pending_not_stale(tmp_path):
    """A group with no merged entry holds none of its partials: pending, not stale; views answer for
    the other groups, validate is clean, `fold_pending` rebuilds it exactly."""
    root = tmp_path / "wh"
    entries = _two_shards(root, 13)
    seq, manifest = store.read_state(root)
    assert store.publish(root, seq, manifest, [], remove=[merge.group_key("m", "c", "all")]) is not None
    manifest = store.read_manifest(root)
    assert sorted(merge.pending(manifest)) == [merge.group_key("m", "c", "all")]
    con = connect(root)
    assert con.execute("SELECT DISTINCT source FROM token_stats").fetchall() == [("s0",)]
    con.close()
    assert validate(root) == []
    assert merge.fold_pending(root) == 2
    check_against(root, oracle(root, entries))


def test_companions_written_out_of_order_are_rewritten(tmp_path):
    """Two writers' companion writes can land in either order; readers rewrite the older ones."""
    rng = np.random.default_rng(17)
    root = tmp_path / "wh"
    merge.commit(root, [random_partial(root, rng, "s0", "1-of-2")])
    old = {f: (root / f).read_bytes() for f in (store.MANIFEST, store.RUNS_FILE)}
    merge.commit(root, [random_partial(root, rng, "s0", "2-of-2")])
    con = connect(root)  # writes views.sql of generation 2
    con.close()
    for f, data in old.items():  # the first writer's companions land late
        (root / f).write_bytes(data)
    con = connect(root)
    assert con.execute("SELECT count(*) FROM runs WHERE kind = 'data'").fetchone()[0] == 2
    con.close()
    assert json.loads((root / store.MANIFEST).read_text())["generation"] == 2


def test_an_interrupt_after_the_record_keeps_the_commit(tmp_path, monkeypatch):
    """Ctrl-C while the companions are written: the record exists, so its files must stay."""
    rng = np.random.default_rng(19)
    root = tmp_path / "wh"
    entries = [random_partial(root, rng, "s0", "1-of-1")]

    def interrupt(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(store_log, "write_companions", interrupt)
    with pytest.raises(KeyboardInterrupt):
        merge.commit(root, entries)
    monkeypatch.undo()
    assert store.read_manifest(root)["generation"] == 1
    check_against(root, oracle(root, entries))
    assert validate(root) == []
