"""Tensor fingerprints: which weights a checkpoint holds, from every byte of every tensor.

A checkpoint's fingerprint is `tensors <hex>`: sha256 (first 128 bits) over its tensors in name
order, each one line `name \\0 dtype \\0 shape \\0 sha256(bytes)`, the bytes in C order, little-endian,
as safetensors stores them.  It depends on the tensors only — names, dtypes, shapes and values —
not on the files: a re-saved checkpoint (another header or metadata, another sharding, `.bin`
instead of `.safetensors`) has the same fingerprint; any changed byte of any tensor gives another.

The files read are those `from_pretrained` loads (`weight_files`).  A safetensors file is read
without loading anything: its header gives each tensor's byte range, hashed straight from the file
(one thread per tensor, each with its own file descriptor, so the disk streams and hashlib, which
releases the GIL, runs on every core).  A `.bin` / `.pt` file is opened with
`torch.load(weights_only=True, mmap=True)` and each tensor's bytes hashed from the mapping.

Each file's tensor list is cached in the user's cache directory (`cache_dir()/tensor-fingerprints/`,
one small file per key, so a lookup reads one file however many the cache holds), keyed by the
file's absolute path, size, mtime, ctime and inode — rewriting a file changes the key,
so it is hashed again — and, for a blob of the Hugging Face hub cache (whose file name is the
sha256 of its bytes, checked by the hub on download), by that sha256 as well: the same blob under
another revision, path or inode costs nothing.  A cache file that does not parse or whose checksum
(over the key looked up and the records) is wrong is ignored, never trusted.

`state_dict_fingerprint` is the same over a model's state_dict in memory (a tensor tied to an
earlier name once, under its first name): it equals the file fingerprint when the file holds exactly
those tensors under those names (e.g. `save_pretrained` of a model whose state_dict names are its
file's — not where loading renames keys or the file holds tensors the model drops).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.errors import UserError
from warehouse.store import cache_dir

PREFIX = "tensors "
CACHE_DIR = "tensor-fingerprints"  # one file per key, under cache_dir()
CACHE_MAX_FILES = 4096  # the older half removed beyond this
CHUNK = 8 << 20  # bytes per read
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
                      "U64": "uint64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                      "C64": "complex64"}
HUB_BLOB = re.compile(r"[0-9a-f]{64}")

# Bytes of tensors read and hashed by this process (what a cached fingerprint does not cost).
READ = {"bytes": 0, "files": 0}
_lock = threading.Lock()
MEMO: dict[str, list] = {}  # cache key (JSON) → tensor records, this process


# ---------------------------------------------------------------- which files


def weight_files(directory: Path) -> list[Path]:
    """The files `from_pretrained` loads the weights from: a safetensors index's shards, else
    model.safetensors, else every *.safetensors; without safetensors the same for pytorch_model.bin
    (and *.bin / *.pt).  [] when the directory holds none."""
    directory = Path(directory)
    files = {p.name: p for p in directory.iterdir() if p.is_file()}
    for index, single, suffixes in (("model.safetensors.index.json", "model.safetensors", (".safetensors",)),
                                    ("pytorch_model.bin.index.json", "pytorch_model.bin", (".bin", ".pt"))):
        if index in files:
            try:
                shards = sorted(set(json.loads(files[index].read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise UserError(f"{files[index]}: not a valid index of weight shards (no weight_map)") from None
            missing = [s for s in shards if s not in files]
            if missing:
                raise UserError(f"{files[index]}: names shard {missing[0]}, which is not in {directory}")
            return [files[s] for s in shards]
        if single in files:
            return [files[single]]
        found = sorted(p for n, p in files.items() if n.endswith(suffixes))
        if found:
            return found
    return []


# ---------------------------------------------------------------- one tensor, one file


def _hash_range(path: Path, begin: int, end: int) -> str:
    """sha256 of bytes [begin, end) of the file, read in chunks through a descriptor of its own."""
    h = hashlib.sha256()
    buf = bytearray(min(CHUNK, max(end - begin, 1)))
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_SEQUENTIAL)
        pos = begin
        while pos < end:
            n = os.preadv(fd, [view[:min(len(buf), end - pos)]], pos)
            if n <= 0:
                raise UserError(f"{path}: ends inside a tensor (byte {pos} of {end})")
            h.update(view[:n])  # (releases the GIL)
            pos += n
    finally:
        os.close(fd)
    with _lock:
        READ["bytes"] += end - begin
    return h.hexdigest()


def _safetensors_layout(path: Path) -> list[tuple[str, str, list[int], int, int]]:
    """(name, dtype, shape, begin, end) of each tensor, from the file's header (absolute offsets)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise UserError(f"{path}: not a safetensors file (header length {n}, file {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise UserError(f"{path}: not a safetensors file (its header is not JSON)") from None
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (8 + n + int(x) for x in info["data_offsets"])
            dtype, shape = info["dtype"], [int(s) for s in info["shape"]]
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path}: tensor {name!r} has no valid dtype, shape and data_offsets") from None
        if not 8 + n <= begin <= end <= size:
            raise UserError(f"{path}: tensor {name!r} lies outside the file (bytes {begin}-{end} of {size})")
        out.append((name, SAFETENSORS_DTYPES.get(dtype, dtype.lower()), shape, begin, end))
    return out


def _torch_records(path: Path, pool: ThreadPoolExecutor) -> list[list]:
    """[name, dtype, shape, sha256] of each tensor of a torch.save file (mapped, not read into memory)."""
    import torch

    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a file in the legacy (non-zip) format cannot be mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file: one line
        raise UserError(f"{path}: cannot read its tensors ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UserError(f"{path}: not a state dict (a mapping of names to tensors)")

    def one(item):
        name, t = item
        h = hashlib.sha256()
        flat = t.detach().contiguous().reshape(-1)
        if flat.numel():
            data = flat.view(torch.uint8).numpy()  # (the mapped bytes; a copy only for a strided view)
            for i in range(0, len(data), CHUNK):
                h.update(data[i:i + CHUNK])
        with _lock:
            READ["bytes"] += flat.numel() * flat.element_size()
        return [name, str(t.dtype).removeprefix("torch."), list(t.shape), h.hexdigest()]

    return list(pool.map(one, state.items()))


# ---------------------------------------------------------------- the cache


def _cache_root() -> Path:
    return cache_dir() / CACHE_DIR


def _entry_path(key: list) -> Path:
    """The one file that holds a key's records: named by the sha256 of the key, so a lookup reads
    one small file whatever the cache holds."""
    return _cache_root() / (hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32] + ".json")


def _line_check(key: list, tensors: list) -> str:
    return hashlib.sha256(json.dumps([key, tensors], sort_keys=True).encode()).hexdigest()[:32]


def _cached(key: list) -> list | None:
    """The records cached under `key`, or None: absent, or a file that does not parse or whose
    checksum (over the key looked up and the records) is wrong — ignored, never trusted."""
    try:
        item = json.loads(_entry_path(key).read_bytes())
        tensors, check = item["tensors"], item["check"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return tensors if isinstance(tensors, list) and check == _line_check(key, tensors) else None


def _store(keys: list[list], tensors: list) -> None:
    """The records under each key, each in its own file written whole (a temporary file renamed over
    it); beyond CACHE_MAX_FILES the older half of the files is removed.  Best effort: a cache that
    cannot be written costs a re-hash."""
    root = _cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        for k in keys:
            path = _entry_path(k)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps({"key": k, "tensors": tensors, "check": _line_check(k, tensors)}))
            os.replace(tmp, path)
        files = list(root.glob("*.json"))
        if len(files) > CACHE_MAX_FILES:
            files.sort(key=lambda f: f.stat().st_mtime_ns)
            for f in files[: len(files) // 2]:
                f.unlink(missing_ok=True)
    except OSError:
        pass


def file_keys(path: Path) -> list[list]:
    """What identifies this version of the file: [path, size, mtime_ns, ctime_ns, inode] of its real
    path, and ["sha256", hex] for a blob of the hub cache (named by the sha256 of its bytes)."""
    real = Path(os.path.realpath(path))
    s = real.stat()
    keys = [[str(real), s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino]]
    if real.parent.name == "blobs" and HUB_BLOB.fullmatch(real.name):
        keys.append(["sha256", real.name])
    return keys


def file_tensors(path: Path, pool: ThreadPoolExecutor | None = None) -> list[list]:
    """[name, dtype, shape, sha256 of the bytes] of each tensor of one weight file, sorted by name:
    from this process's memo or the cache when the file is unchanged (or a hub blob of a known
    sha256), else read and hashed, then cached."""
    keys = file_keys(path)
    names = [json.dumps(k) for k in keys]
    for n in names:
        if n in MEMO:
            return MEMO[n]
    found = [_cached(k) for k in keys]
    hit = next((f for f in found if f is not None), None)
    if hit is None:
        own = pool is None
        pool = pool or ThreadPoolExecutor(workers())
        try:
            if str(path).endswith(".safetensors"):
                layout = sorted(_safetensors_layout(Path(path)), key=lambda t: t[3])  # in file order
                digests = pool.map(lambda t: _hash_range(Path(path), t[3], t[4]), layout)
                hit = [[name, dtype, shape, d] for (name, dtype, shape, _, _), d in zip(layout, digests)]
            else:
                hit = _torch_records(Path(path), pool)
        finally:
            if own:
                pool.shutdown()
        hit.sort(key=lambda r: r[0])
        with _lock:
            READ["files"] += 1
        _store(keys, hit)
    else:
        missing = [k for k, f in zip(keys, found) if f is None]
        if missing:  # e.g. a known blob under a new inode: its path key too
            _store(missing, hit)
    for n in names:
        MEMO[n] = hit
    return hit


def workers() -> int:
    """Hashing threads: one per core, at most 8 (beyond that the disk, not the CPU, sets the pace)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


# ---------------------------------------------------------------- fingerprints


def combine(records) -> str:
    """The fingerprint of tensor records [name, dtype, shape, sha256], whatever their order."""
    h = hashlib.sha256()
    for name, dtype, shape, digest in sorted(records, key=lambda r: r[0]):
        h.update(f"{name}\0{dtype}\0{','.join(map(str, shape))}\0{digest}\n".encode())
    return PREFIX + h.hexdigest()[:32]


def tensor_fingerprint(directory: Path) -> str | None:
    """The fingerprint of the weights a checkpoint directory holds (None: no weight file).  Files
    are hashed in parallel; an unchanged file (or known hub blob) is not read at all."""
    files = weight_files(Path(directory))
    if not files:
        return None
    records = []
    with ThreadPoolExecutor(workers()) as pool:
        for f in files:
            records += file_tensors(f, pool)
    return combine(records)


def state_dict_fingerprint(state_dict: dict) -> str:
    """The same fingerprint over tensors in memory (a model's state_dict): a tensor that is the same
    storage, offset, dtype, shape and stride as an earlier name's (tied weights) counted once, under
    the earlier name.  Copies one tensor at a time to the host."""
    import torch

    records, seen = [], set()
    for name, t in state_dict.items():
        t = t.detach()
        ident = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride())
        if t.numel() and ident in seen:
            continue
        seen.add(ident)
        h = hashlib.sha256()
        if t.numel():
            data = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
            for i in range(0, len(data), CHUNK):
                h.update(data[i:i + CHUNK])
        records.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), h.hexdigest()])
    return combine(records)


def hub_snapshot(repo: str, commit: str | None) -> Path | None:
    """The directory of the hub cache that holds `repo` at `commit` (its files link to blobs named by
    their sha256), or None when it is not cached."""
    if not commit:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, "config.json", revision=commit)
    except Exception:  # noqa: BLE001 - no hub library, or not a repo id: not cached
        return None
    return Path(found).parent if isinstance(found, str) else None
