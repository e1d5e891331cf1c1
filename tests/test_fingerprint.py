"""Which weights a checkpoint holds, from every byte: the tensor fingerprint.

A re-saved checkpoint (other header, other sharding, .bin instead of .safetensors) has the same
fingerprint; one changed byte anywhere in a tensor gives another; MiniLM with one matrix scaled is
other weights, refused under the same name; an unchanged file is not read twice (the cache), a
touched one is; a hub blob of a known sha256 is not read at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_cli, views
from test_identity import one_line_error, tree

ARGS = ["--max-length", "32", "--batch-size", "4"]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """A fingerprint cache of the test's own, and no memo of this process."""
    from extract import fingerprint as fp

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fp.MEMO.clear()
    yield fp
    fp.MEMO.clear()


def copy_config(src: Path, dst: Path) -> Path:
    """dst holding links to every file of src but its weights."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and not f.name.endswith("index.json"):
            os.symlink(f, dst / f.name)
    return dst


def test_a_resaved_checkpoint_has_the_same_fingerprint_and_one_changed_byte_another(model_factory, tmp_path, cache):
    from extract.fingerprint import tensor_fingerprint

    src = model_factory("gpt_neox", tied=False)
    want = tensor_fingerprint(src)
    assert want.startswith("tensors ")
    state = load_file(src / "model.safetensors")
    names = sorted(state)

    header = copy_config(src, tmp_path / "header")  # another header: metadata, another tensor order
    save_file({n: state[n] for n in reversed(names)}, header / "model.safetensors", metadata={"format": "pt", "by": "x"})
    assert (header / "model.safetensors").read_bytes() != (src / "model.safetensors").read_bytes()

    sharded = copy_config(src, tmp_path / "sharded")  # three shards and an index
    parts = [names[i::3] for i in range(3)]
    for i, part in enumerate(parts):
        save_file({n: state[n] for n in part}, sharded / f"model-0000{i + 1}-of-00003.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f"model-0000{i + 1}-of-00003.safetensors" for i, part in enumerate(parts) for n in part}}))

    pickled = copy_config(src, tmp_path / "bin")  # torch.save, read with torch.load(mmap=True)
    torch.save(state, pickled / "pytorch_model.bin")

    for d in (header, sharded, pickled):
        assert tensor_fingerprint(d) == want, d.name

    flipped = copy_config(src, tmp_path / "flipped")  # one byte of one tensor, in the middle of the file
    raw = bytearray((src / "model.safetensors").read_bytes())
    raw[len(raw) // 2] ^= 1
    (flipped / "model.safetensors").write_bytes(bytes(raw))
    assert tensor_fingerprint(flipped) != want
    dtype = copy_config(src, tmp_path / "dtype")  # the same values in another dtype are other weights
    save_file({n: t.double() for n, t in state.items()}, dtype / "model.safetensors")
    assert tensor_fingerprint(dtype) != want
    with pytest.raises(Exception, match="not a safetensors file"):
        bad = copy_config(src, tmp_path / "bad")
        (bad / "model.safetensors").write_bytes(b"\xff" * 64)
        tensor_fingerprint(bad)


def test_the_in_memory_fingerprint_is_the_files_where_the_names_are(model_factory, cache):
    """weights_fingerprint(model) hashes the state_dict as the files are hashed: equal where the file
    holds exactly the state_dict's tensors under its names (a tied model saved by save_pretrained),
    not where loading renames a key (GPT-NeoX's embed_out is lm_head in memory)."""
    from transformers import AutoModelForCausalLM

    from extract import weights_fingerprint
    from extract.fingerprint import tensor_fingerprint

    tied = model_factory("gpt_neox", tied=True)
    assert weights_fingerprint(AutoModelForCausalLM.from_pretrained(tied)) == tensor_fingerprint(tied)
    untied = model_factory("gpt_neox", tied=False)
    assert weights_fingerprint(AutoModelForCausalLM.from_pretrained(untied)) != tensor_fingerprint(untied)


def test_the_cache_reads_an_unchanged_file_never_again_and_a_touched_one_again(model_factory, tmp_path, cache):
    fp = cache
    src = model_factory("gpt_neox", tied=True)
    d = copy_config(src, tmp_path / "m")
    shutil.copy(src / "model.safetensors", d / "model.safetensors")
    size = sum(t.numel() * t.element_size() for t in load_file(d / "model.safetensors").values())
    reads = fp.READ["bytes"]
    want = fp.tensor_fingerprint(d)
    assert fp.READ["bytes"] - reads == size  # every tensor's bytes, once
    fp.MEMO.clear()  # another process: only the cache file
    reads = fp.READ["bytes"]
    assert fp.tensor_fingerprint(d) == want and fp.READ["bytes"] == reads  # nothing read
    st = os.stat(d / "model.safetensors")
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: a new mtime
    fp.MEMO.clear()
    assert fp.tensor_fingerprint(d) == want and fp.READ["bytes"] - reads == size  # hashed again
    # a cache file that does not parse, and one whose check is wrong (claiming other tensors), are ignored
    mine = str((d / "model.safetensors").resolve())

    def entries():  # the cache files of this path's keys (the file before and after the touch)
        out = []
        for f in (Path(os.environ["XDG_CACHE_HOME"]) / "isotropy-warehouse" / fp.CACHE_DIR).glob("*.json"):
            try:
                if json.loads(f.read_text())["key"][0] == mine:
                    out.append(f)
            except ValueError:
                pass
        return out

    files = entries()
    assert len(files) == 2
    for f in files:
        forged = json.loads(f.read_text())
        forged["tensors"][0][3] = "0" * 64
        f.write_text(json.dumps(forged))
    fp.MEMO.clear()
    reads = fp.READ["bytes"]
    assert fp.tensor_fingerprint(d) == want and fp.READ["bytes"] - reads == size
    for f in files:
        f.write_text('{"key": [1, 2')
    fp.MEMO.clear()
    reads = fp.READ["bytes"]
    assert fp.tensor_fingerprint(d) == want and fp.READ["bytes"] - reads == size
    # a file under this key's name that holds another key's records (its own check right) is ignored too
    files = entries()
    assert files
    for f in files:
        item = json.loads(f.read_text())
        item["tensors"][0][3] = "0" * 64
        item["key"] = ["another", "file"]
        item["check"] = hashlib.sha256(json.dumps([item["key"], item["tensors"]], sort_keys=True).encode()
                                       ).hexdigest()[:32]  # the file's own check, right for what it holds
        f.write_text(json.dumps(item))
    fp.MEMO.clear()
    reads = fp.READ["bytes"]
    assert fp.tensor_fingerprint(d) == want and fp.READ["bytes"] - reads == size


def test_a_hub_blob_of_a_known_sha256_is_not_read(model_factory, tmp_path, cache):
    """The hub cache names an LFS file's blob by its sha256: two revisions that link one blob, or the
    same blob downloaded again (another inode), cost no read."""
    import hashlib

    fp = cache
    src = model_factory("gpt_neox", tied=True)
    data = (src / "model.safetensors").read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    repo = tmp_path / "hub" / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / sha).write_bytes(data)
    snaps = []
    for commit in ("a" * 40, "b" * 40):
        snap = copy_config(src, repo / "snapshots" / commit)
        os.symlink(f"../../blobs/{sha}", snap / "model.safetensors")
        snaps.append(snap)
    reads = fp.READ["bytes"]
    want = fp.tensor_fingerprint(snaps[0])
    assert fp.READ["bytes"] > reads and want == fp.tensor_fingerprint(src)
    fp.MEMO.clear()
    reads = fp.READ["bytes"]
    assert fp.tensor_fingerprint(snaps[1]) == want and fp.READ["bytes"] == reads  # the same blob
    other = tmp_path / "hub2" / "models--org--m"  # downloaded again elsewhere: a new inode, the same sha256
    (other / "blobs").mkdir(parents=True)
    (other / "blobs" / sha).write_bytes(data)
    snap = copy_config(src, other / "snapshots" / ("c" * 40))
    os.symlink(f"../../blobs/{sha}", snap / "model.safetensors")
    fp.MEMO.clear()
    assert fp.tensor_fingerprint(snap) == want and fp.READ["bytes"] == reads


@pytest.fixture(scope="module")
def scaled_minilm(tmp_path_factory):
    """The real all-MiniLM-L6-v2 with one matrix (encoder.layer.0.output.dense.weight) scaled by 1.5."""
    from extract.models import minilm_dir

    src = minilm_dir()
    d = copy_config(src, tmp_path_factory.mktemp("minilm") / "minilm-edited")
    state = load_file(src / "model.safetensors")
    state["encoder.layer.0.output.dense.weight"] = state["encoder.layer.0.output.dense.weight"] * 1.5
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    return d


def test_minilm_with_one_matrix_scaled_is_other_weights_and_never_merged(scaled_minilm, sources, tmp_path):
    from extract.fingerprint import tensor_fingerprint
    from extract.models import minilm_dir

    assert tensor_fingerprint(scaled_minilm) != tensor_fingerprint(minilm_dir())
    alpha, beta = f"alpha={sources['alpha']}", f"beta={sources['beta']}"
    wh = tmp_path / "wh"
    assert run_cli("extract", "--model", "minilm", "--source", beta, *ARGS, "--warehouse", wh)[0] == 0
    before, clean = tree(wh), views(wh)  # the clean run: the original alone
    line = one_line_error(*run_cli("extract", "--model", scaled_minilm, "--name", "minilm", "--source", alpha, *ARGS,
                                   "--warehouse", wh)[::2])
    assert "other weights" in line and "minilm@main" in line and "--name" in line
    assert tree(wh) == before  # refused before any forward pass: nothing written
    # kept apart under another name: both models, the original's views as in the clean run
    assert run_cli("extract", "--model", scaled_minilm, "--name", "minilm-edited", "--source", beta, *ARGS,
                   "--warehouse", wh)[0] == 0
    got = views(wh)
    for v in ("inter_sim", "intra_sim", "avg_intra_sim"):
        assert [r for r in got[v] if r[0] == "minilm"] == clean[v]
        assert [r[1:] for r in got[v] if r[0] == "minilm-edited"] != [r[1:] for r in clean[v]]
