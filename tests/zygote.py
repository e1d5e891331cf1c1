"""A fork server for the tests' command-line children: `python cli.py …` without importing everything again.

A test that is about processes (kill -9 at a fault point, Ctrl-C, racing writers, Slurm array tasks,
torchrun and its ranks) needs the CLI in a process of its own, and a fresh interpreter pays torch's and
transformers' imports every time.  The server (tests/zygote_server.py) is that interpreter, started once
per test run: it imports everything once and forks one child per request, a real process the caller may
signal, whose exit status comes back on the connection.

This module is the client side: `Server` (starting the server, or finding the one pytest-xdist's
controller started), `Popen` / `run` (subprocess-like, used by the tests through conftest.py),
`call_all` (functions in forked processes) and the `python` stand-in written by `write_python_shim`
(for launchers that start `python cli.py …` themselves: the Slurm array scripts, torchrun with
`--no-python`).  A command the server cannot run the same way (another interpreter option, an
environment variable that only takes effect at import) falls back to a real `subprocess`.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zygote_server import ENV_THREADS

ROOT = Path(__file__).resolve().parent.parent
SERVER_SCRIPT = Path(__file__).resolve().parent / "zygote_server.py"
ENV_SOCKET = "ISO_TEST_ZYGOTE"  # where a client finds the server (set in the pytest process's environment)
ENV_SHARED = "ISO_TEST_ZYGOTE_SERVER"  # [pid, socket path, log path] of a server started by another process
# Read by a library when it is imported, so a child cannot change them: a request that sets one of them
# to another value than the server's runs in a real interpreter instead.
IMPORT_TIME = ("ISOTROPY_WAREHOUSE", "HF_HUB_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "TRANSFORMERS_OFFLINE",
               "TRANSFORMERS_CACHE", "HF_DATASETS_OFFLINE", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONWARNINGS",
               "PYTHONDONTWRITEBYTECODE", "CUDA_VISIBLE_DEVICES", "MKL_NUM_THREADS", "PYTORCH_ENABLE_MPS_FALLBACK",
               "ISO_TEST_NO_ZYGOTE")


class Server:
    """The fork server of this pytest process: started at the first request (once), or, under pytest-xdist,
    started by the controller when the session starts (`start`, not waiting for its imports) and shared
    by every worker, which finds it through ENV_SHARED and waits for its socket at its first request."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.path: str | None = None
        self.failed: str | None = None
        self.dir: str | None = None  # the socket's and the log's directory, where this process started the server

    def start(self) -> None:
        """Start the server in the background and name it in this process's environment (which the
        processes started after inherit)."""
        if os.environ.get("ISO_TEST_NO_ZYGOTE") or self.proc is not None:
            return
        import torch

        tmp = self.dir = tempfile.mkdtemp(prefix="iso-zygote-")
        path, log = os.path.join(tmp, "s"), os.path.join(tmp, "log")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]),
            "OMP_NUM_THREADS": "1", ENV_THREADS: str(torch.get_num_threads())}
        with open(log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, str(SERVER_SCRIPT), path], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT)
        self.pid = self.proc.pid
        os.environ[ENV_SHARED] = json.dumps([self.pid, path, log])

    def ensure(self) -> str | None:
        """The server's socket path (starting it if needed, waiting for it to listen), or None where it
        cannot run."""
        if self.path or self.failed:
            return self.path
        if os.environ.get("ISO_TEST_NO_ZYGOTE"):
            self.failed = "ISO_TEST_NO_ZYGOTE is set"
            return None
        if ENV_SHARED not in os.environ:
            self.start()
        self.pid, path, log = json.loads(os.environ[ENV_SHARED])
        while not os.path.exists(path):  # it appears when the server listens (serve: bound, then renamed)
            if not _alive(self.pid):
                self.failed = f"fork server did not start: {open(log).read()[-2000:]}"
                raise RuntimeError(self.failed)
            time.sleep(0.02)
        self.path = path
        os.environ[ENV_SOCKET] = path  # for the `python` stand-in in grandchildren (Slurm scripts)
        return path

    def cpu(self) -> float:
        """CPU seconds of the server and its children that ended (every forked child, however it was
        started: Popen here, the `python` stand-in, torchrun's ranks).  A server shared by xdist's workers
        counts both workers' children: measure with `-p no:xdist` (tests/README.md)."""
        if self.pid is None:
            return 0.0
        try:
            fields = open(f"/proc/{self.pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """End the server if this process started it (a worker leaves a shared one to the controller)."""
        if self.proc is not None:
            if not os.path.exists(os.path.join(self.dir, "s")):  # still importing (never used): no need to wait
                self.proc.kill()
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.dir, ignore_errors=True)
            os.environ.pop(ENV_SHARED, None)
            self.proc = None
        os.environ.pop(ENV_SOCKET, None)


def _alive(pid: int) -> bool:
    """Whether the process runs (not ended, not a zombie its parent has yet to reap)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


SERVER = Server()


def _resolve_argv(cmd) -> list[str] | None:
    """`[python, SCRIPT|-m MODULE, ARGS…]` → the argv the child runs (its argv[0] the script), else None."""
    cmd = [os.fspath(c) for c in cmd]
    if len(cmd) < 2 or os.path.realpath(cmd[0]) != os.path.realpath(sys.executable):
        return None
    rest = cmd[1:]
    if rest[0] == "-u":
        rest = rest[1:]
    if not rest:
        return None
    if rest[0] == "-m":
        return rest if len(rest) >= 2 else None
    if rest[0].startswith("-") or not rest[0].endswith(".py"):
        return None
    return rest


def forkable(argv: list[str] | None, env: dict) -> bool:
    if argv is None:
        return False
    return all(env.get(k) == os.environ.get(k) for k in IMPORT_TIME if k != "PYTHONPATH") and \
        all(p in sys.path or p == "" for p in env.get("PYTHONPATH", "").split(os.pathsep))


def _connect(path: str, argv: list[str], env: dict, cwd: str, fds: list[int],
             modules: tuple[str, ...] = ()) -> tuple[socket.socket, int]:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    body = json.dumps({"argv": argv, "env": env, "cwd": cwd, "modules": list(modules)}).encode()
    socket.send_fds(conn, [struct.pack("!I", len(body))], fds)
    conn.sendall(body)
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            raise RuntimeError("the fork server closed the connection")
        reply += chunk
    kind, value = reply.decode().split()
    assert kind == "pid", reply
    return conn, int(value)


class Popen:
    """`subprocess.Popen` for `[sys.executable, SCRIPT|-m MODULE, ARGS…]`, forked from the server: the
    same arguments (stdin/stdout/stderr: None, PIPE, DEVNULL, a file or a descriptor; text; env; cwd),
    the same pid, poll/wait/communicate/send_signal/terminate/kill and returncode (-N: killed by
    signal N).  Output asked for with PIPE goes through temporary files, read by communicate().
    Anything else runs in a real interpreter (`self.forked` False).  `modules`: imported by the server
    (once, kept there) before it forks this child, which then finds them imported."""

    def __init__(self, cmd, stdin=None, stdout=None, stderr=None, text=False, env=None, cwd=None,
                 universal_newlines=None, modules: tuple[str, ...] = (), **kw):
        env = dict(os.environ if env is None else env)
        argv = _resolve_argv(cmd)
        text = bool(text or universal_newlines)
        self.args, self.text, self.returncode = cmd, text, None
        self._conn = None
        path = SERVER.ensure() if forkable(argv, env) and not kw else None
        self.forked = path is not None
        if not self.forked:
            self._proc = subprocess.Popen(cmd, stdin=stdin, stdout=stdout, stderr=stderr, text=text, env=env,
                                          cwd=cwd, **kw)
            self.pid = self._proc.pid
            self.stdout, self.stderr = self._proc.stdout, self._proc.stderr
            return
        self._files, opened = {}, []

        def fd_for(spec, name, mode):
            if spec is None:
                return name  # inherit this process's
            if spec == subprocess.PIPE:
                f = tempfile.TemporaryFile(mode="w+b")
                self._files[name] = f
                opened.append(f)
                return f.fileno()
            if spec == subprocess.DEVNULL:
                f = open(os.devnull, mode)
                opened.append(f)
                return f.fileno()
            if spec == subprocess.STDOUT:
                return "stdout"
            return spec if isinstance(spec, int) else spec.fileno()

        fds = [fd_for(stdin, 0, "rb"), fd_for(stdout, 1, "wb"), fd_for(stderr, 2, "wb")]
        if fds[2] == "stdout":
            fds[2] = fds[1]
        self._conn, self.pid = _connect(path, argv, env, os.fspath(cwd or os.getcwd()), fds, modules)
        for f in opened:
            if f not in self._files.values():
                f.close()
        self.stdout = self.stderr = None

    # -------------------------------------------------------- subprocess.Popen's interface

    def poll(self):
        if not self.forked:
            self.returncode = self._proc.poll()
            return self.returncode
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._finish()
        return self.returncode

    def wait(self, timeout=None):
        if not self.forked:
            self.returncode = self._proc.wait(timeout)
            return self.returncode
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._finish()
        return self.returncode

    def _finish(self) -> None:
        data = b""
        while True:
            chunk = self._conn.recv(64)
            if not chunk:
                break
            data += chunk
        self._conn.close()
        words = data.decode().split()
        if len(words) != 3 or words[0] != "exit":
            raise RuntimeError(f"the fork server lost child {self.pid}: {data!r}")
        self.returncode = int(words[1])

    def communicate(self, input=None, timeout=None):
        if not self.forked:
            out = self._proc.communicate(input, timeout)
            self.returncode = self._proc.returncode
            return out
        assert input is None, "input is not supported for a forked child"
        self.wait(timeout)
        return self._read(1), self._read(2)

    def _read(self, name):
        f = self._files.pop(name, None)
        if f is None:
            return None
        f.seek(0)
        data = f.read()
        f.close()
        return data.decode("utf-8", "replace") if self.text else data

    def send_signal(self, sig):
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.returncode is None:
            self.kill()
            self.wait()
        for f in self._files.values() if self.forked else ():
            f.close()


def run(cmd, capture_output=False, timeout=None, check=False, stdout=None, stderr=None, **kw):
    """`subprocess.run` through `Popen` above."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    p = Popen(cmd, stdout=stdout, stderr=stderr, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    result = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    if check:
        result.check_returncode()
    return result


def call_all(calls, processes: int | None = None, timeout: float = 600) -> list:
    """`fn(*args)` for each `(fn, args)` of `calls`, each in a process of its own forked from the server
    (`multiprocessing`'s Pool without a fresh interpreter's imports): at most `processes` at once (all
    when None), started in the given order.  Their return values in that order; the first exception
    raised in a child is raised here.  `fn` is pickled by name (a module-level function)."""
    import pickle

    tmp = Path(tempfile.mkdtemp(prefix="iso-call-"))
    todo, running, done = list(enumerate(calls)), {}, {}
    deadline = time.monotonic() + timeout
    try:
        while todo or running:
            while todo and (processes is None or len(running) < processes):
                i, (fn, args) = todo.pop(0)
                (tmp / f"{i}.in").write_bytes(pickle.dumps((fn, tuple(args))))
                running[i] = Popen([sys.executable, str(SERVER_SCRIPT), "--call", str(tmp / f"{i}.in"),
                                    str(tmp / f"{i}.out")], stderr=subprocess.PIPE, cwd=ROOT,
                                   modules=(fn.__module__,))  # (the function's module: imported once)
            for i, p in list(running.items()):
                if p.poll() is not None:
                    _, err = p.communicate()
                    del running[i]
                    out = tmp / f"{i}.out"
                    if not out.exists():
                        raise RuntimeError(f"call {i} ended with exit code {p.returncode} and no result:\n"
                                           f"{(err or b'').decode(errors='replace')[-3000:]}")
                    done[i] = pickle.loads(out.read_bytes())
                    if done[i][0] == "raised":
                        raise done[i][1]
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("call_all", timeout)
            time.sleep(0.02)
    finally:
        for p in running.values():
            p.kill()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return [done[i][1] for i in range(len(calls))]


SHIM = '''#!{python} -S
"""`python` for scripts the tests start (Slurm array tasks): `python SCRIPT ARGS` and `python -m MODULE
ARGS` are forked from the tests' fork server (tests/zygote.py) when one is running; anything else, and
everything outside the tests, execs the real interpreter."""
import json, os, signal, socket, struct, sys
REAL = {python!r}
args = sys.argv[1:]
path = os.environ.get({env!r})
ok = args and (args[0] == "-m" and len(args) > 1 or not args[0].startswith("-") and args[0].endswith(".py"))
if not path or not ok:
    os.execv(REAL, [REAL, *args])
try:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
except OSError:
    os.execv(REAL, [REAL, *args])
body = json.dumps({{"argv": args, "env": dict(os.environ), "cwd": os.getcwd()}}).encode()
socket.send_fds(conn, [struct.pack("!I", len(body))], [0, 1, 2])
conn.sendall(body)
f = conn.makefile("rb")
kind, pid = f.readline().split()
pid = int(pid)
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, lambda s, _: os.kill(pid, s))
words = f.readline().split()
code = int(words[1]) if len(words) == 3 else 1
if code < 0:  # end as the child ended: by its signal
    if -code in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
'''


def write_python_shim(directory: Path) -> Path:
    """A `python` executable in `directory` that forks from the server (see SHIM)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "python"
    path.write_text(SHIM.format(python=sys.executable, env=ENV_SOCKET))
    path.chmod(0o755)
    return path
