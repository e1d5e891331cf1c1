"""The tests' fork server (run by tests/zygote.py as `python tests/zygote_server.py SOCKET`): it imports
the command line, torch, transformers and the warehouse once, never runs a torch op (no thread pool exists
to break across a fork), freezes the imported objects out of the garbage collector's way, and then forks
one child per request.  A request (from tests/zygote.py's `Popen` or its `python` stand-in) carries an
argv, an environment, a working directory and stdin/stdout/stderr (file descriptors passed over the Unix
socket); the child takes them, runs the script or module as `python SCRIPT ARGS` / `python -m MODULE ARGS`
would, and exits as a fresh interpreter exits (non-daemon threads joined, atexit handlers run, an uncaught
Ctrl-C ends it by SIGINT).  The server answers `pid N` when it forks and `exit CODE CPU` when the child ends.

The socket's path appears once the server listens; the server ends (killing its children) when its stdin
closes.  `python tests/zygote_server.py --call IN OUT` runs one pickled call (tests/zygote.py's call_all).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import weakref
from pathlib import Path

# The server imports with one intra-op thread (an import that runs a torch op would otherwise start OpenMP's
# pool, whose threads a fork cannot carry); a child without OMP_NUM_THREADS gets this count, the one a
# fresh interpreter would take.
ENV_THREADS = "ISO_TEST_ZYGOTE_THREADS"
PRELOAD = ("cli", "isotropy_warehouse.cli", "isotropy_warehouse.extract_options", "extract.run", "extract.run.driver",
           "extract.options", "extract.launch", "extract.reduce", "extract.sweep", "extract.models", "extract.sources",
           "extract.api", "warehouse.query", "warehouse.merge", "warehouse.validate", "warehouse.pull",
           "warehouse.storage.s3", "torch.distributed", "torch.distributed.distributed_c10d",
           "transformers", "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
           "transformers.models.gpt_neox.modeling_gpt_neox", "transformers.models.llama.modeling_llama",
           "transformers.tokenization_utils_fast", "safetensors.torch", "tokenizers", "pyarrow.parquet",
           "pyarrow.dataset", "duckdb", "boto3", "botocore.session", "botocore.client", "zstandard",
           "typer._adapters")  # (typer's option coercion: imported when a command first runs)

# Threads the imports start that survive a fork by design: jemalloc's background purger (pyarrow's bundled
# jemalloc; its pthread_atfork handlers reset it in the child) and pyarrow's thread pool (re-created
# after a fork).  Anything more means a library this server should not preload.
FORK_SAFE_THREADS = ("jemalloc_bg_thd",)


def preload(quiet: bool = False) -> None:
    """Import PRELOAD, then freeze every object so far out of the garbage collector's generations: a
    gc.collect() (each extract calls a few) then walks only what was made since, and a forked child
    leaves the imported objects' pages shared."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # a module this checkout lacks: imported when used (slower, still right)
            if not quiet:
                print(f"zygote: preload {name}: {type(e).__name__}: {e}", file=sys.stderr)
    try:  # transformers builds its table of checkpoint conversions at a process's first from_pretrained
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        get_checkpoint_conversion_mapping("gpt_neox")
    except Exception:
        pass
    gc.collect()
    # A forked child need not take down, one by one at its exit, the operator libraries (torch.library) the
    # imports registered: their finalizers stay out of its exit.  (weakref.finalize keeps
    # its instances in a registry only; they are not objects the garbage collector lists.)
    for fin, info in list(weakref.finalize._registry.items()):
        if getattr(info.func, "__name__", "") == "_del_library":
            fin.atexit = False
    gc.freeze()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """A request: 4-byte length with the three descriptors attached, then that many bytes of JSON."""
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    if len(head) < 4:
        head += _recv_exact(conn, 4 - len(head))
    (n,) = struct.unpack("!I", head)
    return json.loads(_recv_exact(conn, n)), list(fds)


def serve(path: str) -> None:
    global _THREADS
    _THREADS = os.environ.get(ENV_THREADS, "1")  # (a child's os.environ becomes its caller's before it reads this)
    preload()
    threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    others = [t for t in threads[1:] if t not in FORK_SAFE_THREADS]
    import threading

    if threading.active_count() > 1 or len(others) > 1:  # pyarrow's one pool thread, no other
        # a Python thread, or a native one of a library not known here, could hold a lock forever in a child
        print(f"zygote: threads after the imports {threads}; forking is not safe", file=sys.stderr)
        sys.exit(3)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the path appears once the server listens (clients wait for it)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    by_pid: dict[int, socket.socket] = {}
    by_conn: dict[socket.socket, int] = {}
    stdin = sys.stdin.fileno()
    while True:
        try:
            ready, _, _ = select.select([listener, wake_r, stdin, *by_conn], [], [])
        except InterruptedError:
            continue
        if stdin in ready and not os.read(stdin, 4096):  # the pytest process is gone: so are we
            for pid in by_pid:
                _kill(pid)
            return
        if wake_r in ready:
            try:
                while os.read(wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        while True:  # reap every child that ended; tell its client how
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = by_pid.pop(pid, None)
            if conn is not None:
                by_conn.pop(conn, None)
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)} "
                                 f"{usage.ru_utime + usage.ru_stime:.3f}\n".encode())
                except OSError:
                    pass
                conn.close()
        for conn in [c for c in ready if c in by_conn]:  # a client hung up before its child ended
            try:
                gone = not conn.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK)
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                _kill(by_conn.pop(conn))
                conn.close()
        if listener in ready:
            conn, _ = listener.accept()
            try:
                request, fds = _read_request(conn)
            except (EOFError, OSError, ValueError):
                conn.close()
                continue
            _import(request.get("modules", ()))
            pid = os.fork()
            if pid == 0:
                _child(request, fds, close=[listener.fileno(), wake_r, wake_w, conn.fileno(),
                                            *(c.fileno() for c in by_conn)])
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(f"pid {pid}\n".encode())
            except OSError:  # the client is gone already (killed while it started): so is its child
                _kill(pid)
                conn.close()
                continue
            by_pid[pid] = conn
            by_conn[conn] = pid


def _import(modules) -> None:
    """Import a request's modules here, once (the module of a call_all function: a test module), so that
    this child and the next find them imported; one that fails to import is left to the child (its
    error goes to its caller)."""
    new = [name for name in modules if name not in sys.modules]
    path = list(sys.path)  # (a test module adds its folders: not for the later children)
    for name in new:
        try:
            importlib.import_module(name)
        except KeyboardInterrupt:
            raise
        except BaseException:  # (a skip or exit at import too)
            sys.modules.pop(name, None)
    sys.path[:] = path
    if new:  # as preload: what they made, out of the children's garbage collections
        gc.collect()
        gc.freeze()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _child(request: dict, fds: list[int], close: list[int]) -> None:
    """In the forked child: become `python ARGV…` in the caller's environment, run it, exit as it would."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in close:  # the listener, the clients' connections
            os.close(fd)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _fresh_state(request["env"])
        argv = request["argv"]
        import io

        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                                       line_buffering=os.isatty(1), write_through=False)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                                       errors="backslashreplace", line_buffering=True)
        code = _run(argv)
    except BaseException:  # the server's own code failed in the child: say so
        import traceback

        traceback.print_exc()
        code = 1
    os._exit(code)


_THREADS = "1"  # a child's intra-op threads where its request sets no OMP_NUM_THREADS (serve sets it)


def _fresh_state(env: dict) -> None:
    """What a fresh interpreter would have that the imports in the server fixed: the thread count from
    OMP_NUM_THREADS, unseeded global random generators.  (The warehouse reads the pid a lease or a commit
    record names when it writes it, so a forked child is its own writer.)"""
    import torch

    n = env.get("OMP_NUM_THREADS")
    if not (n and n.isdigit() and int(n) > 0):  # unset: a fresh interpreter's own count (the server ran on one)
        n = _THREADS
    torch.set_num_threads(int(n))
    import numpy as np

    np.random.seed()


def _run(argv: list[str]) -> int:
    """Run `python ARGV` in this process; its exit code (an uncaught Ctrl-C: this process ends by SIGINT)."""
    import atexit
    import runpy
    import threading

    interrupted = False
    try:
        sys.argv = list(argv)
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()  # where the server's script directory was
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = str(Path(argv[0]).resolve().parent)
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        code, interrupted = 130, True
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # as at interpreter exit: wait for non-daemon threads
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    if interrupted:  # as CPython does: end by the signal, so the parent sees -SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    try:
        print(value, file=sys.stderr)
    except Exception:
        pass
    return 1


def _call(src: str, dest: str) -> None:
    """In a child of call_all: run the pickled call, pickle what it returned or raised."""
    import pickle

    fn, args = pickle.loads(Path(src).read_bytes())
    try:
        result = ("returned", fn(*args))
    except Exception as e:
        import traceback

        traceback.print_exc()
        result = ("raised", e)
    try:
        data = pickle.dumps(result)
    except Exception as e:  # an exception or a value that does not pickle: its text
        data = pickle.dumps(("raised", RuntimeError(f"{result[0]} {result[1]!r}, which does not pickle: {e}")))
    tmp = Path(dest + ".tmp")
    tmp.write_bytes(data)
    tmp.rename(dest)


if __name__ == "__main__":
    if sys.argv[1] == "--call":
        _call(sys.argv[2], sys.argv[3])
    else:
        serve(sys.argv[1])
