"""Session fixtures: tiny models saved to disk, text sources, and warehouses built once; the fork server
for command-line children (tests/zygote.py).  How to write a fast test: tests/README.md."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _temporary_files_in_memory() -> None:
    """Temporary files (pytest's tmp_path, tempfile, the children's) on tmpfs where the machine has one with
    room: every commit fsyncs its files, which costs a disk write each and next to nothing in memory (an
    extract commits ~40).  ISO_TEST_TMPDIR chooses the directory; ISO_TEST_TMPDIR= (empty) keeps TMPDIR."""
    chosen = os.environ.get("ISO_TEST_TMPDIR")
    if chosen is None:
        try:
            st = os.statvfs("/dev/shm")
            if st.f_bavail * st.f_frsize < 4 << 30 or not os.access("/dev/shm", os.W_OK):
                return
        except OSError:
            return
        chosen = f"/dev/shm/isotropy-tests-{os.getuid()}"
    if not chosen:
        return
    os.makedirs(chosen, exist_ok=True)
    os.environ["TMPDIR"] = chosen
    os.environ.setdefault("ISO_TEST_TMPDIR", chosen)  # the same for xdist's workers
    tempfile.tempdir = None  # computed again from TMPDIR


_temporary_files_in_memory()
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch.compile's code generation in this process, not in a pool of worker processes that each import torch
# first (the compiled step's graph is tiny: the pool's start-up would be most of its cost).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Plain progress lines (stderr is no terminal under pytest) only when a test asks: a test that counts
# stderr's lines (one `error:` line) must not see a 10 % line of a slow machine (tests/test_progress.py).
os.environ.setdefault("ISO_PROGRESS_INTERVAL", "3600")


def _run_dir(variable: str, prefix: str) -> None:
    """A directory for this test run alone, named in `variable` for every process the run starts (the
    xdist workers, the children): made unless `variable` is set already, removed at exit by the process
    that made it (also where no session runs: --help), not by a child it forked."""
    if variable in os.environ:
        return
    path = os.environ[variable] = tempfile.mkdtemp(prefix=prefix)

    @atexit.register
    def _remove(maker: int = os.getpid()) -> None:
        if os.getpid() == maker:
            shutil.rmtree(path, ignore_errors=True)


# The partition-function tables (V·d² float64 work per matrix each) cached per checkpoint for the whole run: each
# distinct model's is computed once (test_extract.py checks the cache, and `off`, on their own).
_run_dir("ISO_PARAMS_CACHE", "iso-params-")
# Inductor's precompiled header of torch's headers (`_scalar_cpu_kernels`): built once per run, and never read
# from a run that was killed while it was written.
_run_dir("ISO_TEST_HEADERS", "iso-headers-")

import zygote_server  # noqa: E402  (it imports only the standard library)

# (Not in the fork server, which imports a test module, and so this file, for call_all: probing CUDA there would
# initialise the driver in a process that forks.)
if "TRITON_INTERPRET" not in os.environ and zygote_server.ENV_THREADS not in os.environ:
    import torch  # the Triton kernels (extract/accumulate/fused.py) in Triton's interpreter where there is no
    # GPU to compile them for (read when Triton is imported)

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
# Under pytest-xdist the workers already fill the cores: each worker (and every process it starts)
# gets cores ÷ workers intra-op threads, instead of each worker's OpenMP pool spinning on every core.
# Set OMP_NUM_THREADS to choose otherwise.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

import tiny  # noqa: E402
import zygote  # noqa: E402

# `python cli.py …` in a child process, forked from a server that has imported everything (subprocess's
# interface; see tests/zygote.py).  Use them instead of subprocess for the command line.
fork_popen = zygote.Popen
fork_run = zygote.run
call_all = zygote.call_all  # functions in processes of their own (multiprocessing's Pool, forked)


# ---------------------------------------------------------------- the order the tests run in

# The files that take longest, longest first (CPU seconds measured per file): under `-n 2` each file goes
# whole to one worker (its module fixtures built once), and these start first, so that no worker is left
# running a long file alone at the end.  test_s3_faults.py goes first though it is not the longest: its
# worker's core idles through most of it (the S3 clients' back-off sleeps), and test_scaleout.py, which
# starts beside it, runs torchrun's ranks in parallel on that core.  The other files follow in their
# usual order.  Any order must pass: a test never relies on another having run.
LONGEST_FIRST = ("test_s3_faults.py", "test_scaleout.py", "test_fold_adversarial.py", "test_reliability.py",
                 "test_s3.py", "test_repair.py", "test_extract.py", "test_accumulate.py", "test_report.py",
                 "test_triton.py", "test_discovery.py", "test_merge.py", "test_identity.py", "test_demo.py",
                 "test_operator_faults.py", "test_families.py", "test_spill.py", "test_peers.py", "test_fold.py",
                 "test_cli.py", "test_attention.py", "test_api.py")


def _file_rank(nodeid: str) -> int:
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: _file_rank(item.nodeid))  # stable: a file's tests keep their order


class _ByFile:
    """`-n N` (xdist's default distribution, "load"): whole files to the workers, in the order above."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") != "load":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class ByFile(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return nodeid.split("::", 1)[0]

        config.option.loadscopereorder = False  # keep the order above (not: the files with most tests first)
        return ByFile(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):  # (its hook is unknown under -p no:xdist)
        config.pluginmanager.register(_ByFile(), "iso-tests-by-file")
        if (not hasattr(config, "workerinput") and config.getvalue("dist") != "no" and config.getvalue("numprocesses")
                and not config.getvalue("collectonly")):
            zygote.SERVER.start()  # one fork server for every worker, importing while they start
            config.add_cleanup(zygote.SERVER.stop)  # (also where no session runs: --help, --markers)


@pytest.fixture(scope="session")
def python_shim(workdir) -> Path:
    """A `python` for launchers that start the command line themselves (Slurm array scripts: `$PYTHON cli.py …`;
    torchrun: `--no-python SHIM cli.py …`): `python SCRIPT …` forked from the fork server, anything else
    the real interpreter."""
    zygote.SERVER.ensure()
    return zygote.write_python_shim(workdir / "bin")


def pytest_collection_finish(session):
    """Import what the command line's work imports lazily (transformers' model classes: the largest), then
    move every imported object out of the garbage collector's way: each extract calls gc.collect()
    (extract/memory.py), which would otherwise walk them all each time in this process."""
    _scalar_cpu_kernels()
    zygote_server.preload(quiet=True)


def _scalar_cpu_kernels() -> None:
    """Inductor's C++ kernels without SIMD in the test processes, on a precompiled header.  The tests
    compile the GPU path's steps (kernels.py, qk_kernels.py) on the CPU to check their graphs — sums equal
    to the eager path's, no recompile — which the C++ kernels' vectorisation does not change; scalar C++
    builds faster (each distinct graph is built once per run, from a cold cache in CI)."""
    if "torch._dynamo" in sys.modules:  # imported by the test modules that compile (else not worth importing)
        import torch._inductor.config as inductor

        inductor.cpp.simdlen = 1
        # torch's headers precompiled once per run (inductor's default; it hashes them with the `openssl`
        # command): each kernel's build then skips parsing them, most of its g++ time.  Inductor keeps the
        # header in one directory for every run and checks only that it exists, so a run killed while g++
        # wrote it would leave every later run's kernels failing: here the run's own directory instead.
        from torch._inductor import codecache

        headers = os.environ.get("ISO_TEST_HEADERS", "")
        ours = bool(headers) and hasattr(codecache, "_HEADER_DIR") and hasattr(codecache, "_HEADER_LOCK_DIR")
        if ours:
            codecache._HEADER_DIR = headers
            codecache._HEADER_LOCK_DIR = os.path.join(headers, "locks")
        inductor.cpp_cache_precompile_headers = ours and shutil.which("openssl") is not None
        # No SIMD ISA is 1 element wide, so inductor picks none whatever ISAs the CPU has; finding them
        # costs a probe build per ISA (g++ with torch's headers), which would then decide nothing.
        from torch._inductor import cpu_vec_isa

        if hasattr(cpu_vec_isa, "valid_vec_isa_list") and hasattr(cpu_vec_isa, "pick_vec_isa"):
            cpu_vec_isa.valid_vec_isa_list = lambda: []


def pytest_sessionfinish(session):
    zygote.SERVER.stop()


_CPU_LOG = os.environ.get("ISO_TEST_CPU_LOG")  # a file: each test's worker, wall and CPU seconds (this process,
# its waited children, the fork server and its children) and its run_cli commands appended as TSV, for measuring the suite
# on a loaded machine
_CALLS: dict[str, int] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Every object alive now (the session's fixtures, caches, what earlier tests kept) out of the garbage
    # collector's way: the gc.collect() calls of each extract (extract/memory.py) then walk only what this
    # test makes.  Garbage cycles alive now are never collected (a test process's few megabytes).
    gc.freeze()
    if not _CPU_LOG:
        yield
        return

    def now():
        me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return (time.perf_counter(), me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime, zygote.SERVER.cpu())

    _CALLS.clear()
    start = now()
    yield
    end = now()
    calls = ",".join(f"{k}:{v}" for k, v in sorted(_CALLS.items()))
    with open(_CPU_LOG, "a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "-") + "\t" + item.nodeid + "\t" + "\t".join(f"{b - a:.2f}" for a, b in zip(start, end)) + f"\t{calls}\n")


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("iso")


@pytest.fixture(scope="session")
def sources(workdir) -> dict[str, Path]:
    return tiny.write_sources(workdir / "sources")


@pytest.fixture(scope="session")
def model_factory(workdir):
    """model_factory(family, tied) → directory of a saved tiny random model (built once)."""
    cache: dict = {}

    def make(family: str, tied: bool = False, **kw) -> Path:
        key = (family, tied, tuple(sorted(kw.items())))
        if key not in cache:
            name = f"{family}-{'tied' if tied else 'untied'}" + "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
            cache[key] = tiny.make_model(workdir / "models" / name, family, tied, **kw)
        return cache[key]

    return make


_COMMAND = []  # the command line's click command, built from cli.app once per test process


def run_cli(*args: str):
    """Run cli.py in-process (as typer's CliRunner does, on a command built once); returns (exit code,
    stdout, stderr).  An exception other than SystemExit propagates to the test."""
    from typer.main import get_command
    from typer.testing import CliRunner

    import cli

    if not _COMMAND:
        _COMMAND.append(get_command(cli.app))
    if _CPU_LOG:
        _CALLS[str(args[0])] = _CALLS.get(str(args[0]), 0) + 1
    gc.freeze()  # what the test made so far, out of the way of this command's gc.collect() calls
    with CliRunner().isolation() as (out, err, _):
        try:
            _COMMAND[0].main(args=[str(a) for a in args], prog_name="cli.py")
            code = 0
        except SystemExit as e:
            code = 0 if e.code is None else e.code
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        stdout, stderr = out.getvalue(), err.getvalue()
    assert isinstance(code, int), code  # the command line exits with a number
    return code, *(b.decode("utf-8", "replace").replace("\r\n", "\n") for b in (stdout, stderr))


# ---------------------------------------------------------------- one extract, and its views compared

VIEWS = ["inter_sim", "inter_sim_by_source", "intra_sim", "avg_intra_sim", "inter_sim_by_frequency",
         "dim_contrib", "drift", "intra_sentence_sim", "anisotropy", "linearity", "inter_sim_types",
         "layer_change", "random_word_sim"]


@contextlib.contextmanager
def one_thread():
    """torch's intra-op threads at 1 while inside (float32 sums then add in the order a one-thread process's
    do: torchrun's ranks, the moments' background worker); the count before comes back."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def views(wh) -> dict:
    from warehouse.query import connect

    con = connect(wh, views=[*VIEWS, "runs"])  # only these (and what they read): a faster start
    out = {v: sorted(con.execute(f"SELECT * FROM {v}").fetchall()) for v in VIEWS}
    out["shards"] = sorted(con.execute("SELECT checkpoint, source, shard FROM runs WHERE kind = 'data'").fetchall())
    con.close()
    return out


def same_rows(a: list, b: list, name: str, tol: float) -> None:
    """Equal rows; floats to `tol` relative (at least absolute)."""
    assert len(a) == len(b), name
    for r, s in zip(a, b):
        assert len(r) == len(s), name
        for x, y in zip(r, s):
            if isinstance(x, float) and isinstance(y, float):
                assert abs(x - y) <= tol * max(1.0, abs(y)), (name, r, s)
            else:
                assert x == y, (name, r, s)


def same_numbers(a: dict, b: dict, tol: float = 1e-6) -> None:
    """Equal views; floats to `tol` (float32-stored vectors of split tokens merge to ~1e-8)."""
    for v in VIEWS:
        same_rows(a[v], b[v], v, tol)


@pytest.fixture(scope="session")
def single(workdir, sources, model_factory):
    model = model_factory("gpt_neox", tied=False)
    args = ["--model", str(model), "--source", f"alpha={sources['alpha']}", "--source", f"beta={sources['beta']}",
            "--max-length", "32", "--batch-size", "2", "--moments", "--cross-moments"]
    wh = workdir / "scale-single"
    code, _, err = run_cli("extract", *args, "--warehouse", wh)
    assert code == 0, err
    return {"args": args, "wh": wh, "views": views(wh)}


# ---------------------------------------------------------------- S3: one moto server a session

@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """moto's S3 server on loopback with IAM auth (tests/s3_faults.py): env, client, endpoint, port."""
    from s3_faults import moto_server

    with moto_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(scope="session")
def s3_proxy(s3):
    """A fault-injecting proxy in front of the session's moto server (relays everything until a test
    gives it rules: `with s3_proxy.faults(Rule(...)):`)."""
    from s3_faults import FaultProxy

    proxy = FaultProxy(s3["port"])
    yield proxy
    proxy.close()
