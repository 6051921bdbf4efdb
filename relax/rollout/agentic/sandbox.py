"""Run model-written Python in a subprocess with time, memory and file limits, no network and a scratch directory.

``run_python(code, timeout_s, memory_mb)`` starts ``python -I -B -X utf8 sandbox.py`` (this file, which uses the
standard library only) in a new session, writes the code to its stdin and waits. The child, before the code runs:

- sets kernel limits: ``RLIMIT_AS`` (memory), ``RLIMIT_CPU`` (a backstop for the wall-clock timeout),
  ``RLIMIT_FSIZE`` (output and files), ``RLIMIT_NPROC`` 0 (no new processes or threads; the kernel ignores it for
  root), ``RLIMIT_NOFILE`` and no core dumps;
- installs an audit hook (PEP 578) that refuses network sockets, process creation, ctypes calls, writes, deletions and
  renames outside the scratch directory, reads outside the scratch directory and the Python installation (so
  ``/proc/<trainer pid>/environ`` or ``~/.netrc`` stay unreadable), ``os.chdir``, signals and ``gc`` introspection.

The parent runs the child with an environment of its own making (nothing of ``os.environ`` passes through, so no
secret does), in a fresh scratch directory that is removed afterwards, and kills the whole process group on
timeout. Where the kernel lets an unprivileged user create namespaces (``unshare --net --map-root-user`` works),
the child also gets an empty network namespace, which no Python code can undo.

An audit hook stops model mistakes and casual misuse, not an adversary who writes code to escape CPython (the
Python docs say so too); the kernel limits and the network namespace are the parts that hold regardless. Run the
trainer as a non-root user, or in a container, when the model is trained on adversarial tasks.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

FILE_SIZE_LIMIT_MB = 64  # the largest file the code may write; its stdout and stderr count as files
MAX_OPEN_FILES = 64
DEFAULT_MAX_OUTPUT_CHARS = 8192


@dataclass(frozen=True)
class SandboxResult:
    """What one run produced. ``exit_code`` is the child's (negative: killed by that signal); ``error`` is None on
    success, else one line saying why the run failed (timeout, memory, a refused operation, the exception)."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None


def run_python(code: str, timeout_s: float, memory_mb: int, scratch_dir: str | Path | None = None, *,
               max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> SandboxResult:
    """Run ``code`` in a sandboxed subprocess; wall-clock ``timeout_s`` seconds, ``memory_mb`` MiB of address space.

    Without ``scratch_dir`` the code runs in a fresh temporary directory removed afterwards; with it, in that
    directory, which the caller owns (files persist between calls, e.g. over one episode). Each of stdout and stderr
    is cut to ``max_output_chars`` characters."""
    if scratch_dir is not None:
        return _run_in(code, timeout_s, memory_mb, Path(scratch_dir).resolve(), max_output_chars)
    with tempfile.TemporaryDirectory(prefix="relax-sandbox-", ignore_cleanup_errors=True) as fresh:
        return _run_in(code, timeout_s, memory_mb, Path(fresh).resolve(), max_output_chars)


def _run_in(code: str, timeout_s: float, memory_mb: int, scratch: Path, max_output_chars: int) -> SandboxResult:
    cpu_limit_s = math.ceil(timeout_s) + 1
    command = [*network_isolation_prefix(), sys.executable, "-I", "-B", "-X", "utf8", __file__,
               str(scratch), str(memory_mb), str(cpu_limit_s)]
    # Output goes to unnamed temporary files, not pipes: RLIMIT_FSIZE then bounds it, and a child that prints
    # without end cannot fill the parent's memory.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=scratch,
                                   env=_child_environment(scratch), start_new_session=True)
        timed_out = False
        try:
            process.communicate(code.encode("utf-8", "surrogatepass"), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_process_group(process)
        stdout, stderr = _read_head(out, max_output_chars), _read_head(err, max_output_chars)
    error = _describe_failure(process.returncode, timed_out, stderr, timeout_s)
    return SandboxResult(stdout, stderr, process.returncode, timed_out, error)


def _child_environment(scratch: Path) -> dict[str, str]:
    """Built from nothing, so no variable of the trainer (tokens, keys, proxies) reaches the code. One thread per
    math library: RLIMIT_NPROC forbids more, and thread pools would spend the memory budget."""
    return {"PATH": os.defpath, "HOME": str(scratch), "TMPDIR": str(scratch), "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _kill_process_group(process: subprocess.Popen) -> None:
    """SIGKILL the child's session (it leads its own group), so nothing it started outlives the call."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already gone
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _read_head(handle, max_chars: int) -> str:
    size = os.fstat(handle.fileno()).st_size
    handle.seek(0)
    text = handle.read(max_chars * 4).decode("utf-8", "replace")  # at most 4 bytes per character
    if len(text) > max_chars or size > max_chars * 4:
        return text[:max_chars] + f"\n... [output truncated: {size} bytes in all]"
    return text


_SIGNAL_ERRORS = {
    signal.SIGXCPU: "CPU time limit exceeded",
    signal.SIGXFSZ: f"file size limit exceeded (output or a file over {FILE_SIZE_LIMIT_MB} MB)",
    signal.SIGKILL: "killed (SIGKILL; out of memory?)",
}


def _describe_failure(exit_code: int, timed_out: bool, stderr: str, timeout_s: float) -> str | None:
    if timed_out:
        return f"timed out after {timeout_s:g} s (the process was killed)"
    if exit_code == 0:
        return None
    if exit_code < 0:
        return _SIGNAL_ERRORS.get(-exit_code, f"killed by signal {signal.Signals(-exit_code).name}")
    last_lines = [line for line in stderr.splitlines() if line.strip()]
    return last_lines[-1].strip() if last_lines else f"exited with code {exit_code}"


@functools.cache
def network_isolation_prefix() -> tuple[str, ...]:
    """``("unshare", "--net", "--map-root-user")`` when that works here without privileges, else ``()`` (the audit
    hook alone then refuses sockets). Probed once per process."""
    command = ("unshare", "--net", "--map-root-user")
    if shutil.which("unshare") is None:
        return ()
    try:
        probe = subprocess.run([*command, "true"], check=False, capture_output=True, timeout=10,
                               env={"PATH": os.defpath})
    except (OSError, subprocess.SubprocessError):
        return ()
    return command if probe.returncode == 0 else ()


# ---------------------------------------------------------------------------------------------------------------
# The child side: runs as ``python -I -B -X utf8 sandbox.py SCRATCH MEMORY_MB CPU_LIMIT_S`` with the code on stdin.


def _child_main(scratch: str, memory_mb: str, cpu_limit_s: str) -> int:
    import io
    import linecache
    import traceback

    code = sys.stdin.buffer.read().decode("utf-8", "replace")
    sys.stdin = io.StringIO()  # input() sees end of file instead of the closed pipe
    _set_limits(int(memory_mb) * 2**20, int(cpu_limit_s))
    _disable_fork_exec()
    sys.addaudithook(_make_audit_guard(os.path.realpath(scratch), _python_installation_roots()))
    linecache.cache["<code>"] = (len(code), None, code.splitlines(keepends=True), "<code>")  # source in tracebacks
    try:
        exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except MemoryError:
        print(f"MemoryError: the sandbox's memory limit ({memory_mb} MB) was exceeded", file=sys.stderr)
        return 1
    except SystemExit:
        raise
    except BaseException as error:  # the code's own failure is its output, reported like Python does
        frames = error.__traceback__.tb_next if error.__traceback__ else None  # hide this bootstrap frame
        traceback.print_exception(type(error), error, frames, file=sys.stderr)
        return 1
    return 0


def _set_limits(memory_bytes: int, cpu_limit_s: int) -> None:
    import resource

    file_bytes = FILE_SIZE_LIMIT_MB * 2**20
    for limit, value in ((resource.RLIMIT_AS, memory_bytes), (resource.RLIMIT_CPU, cpu_limit_s),
                         (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_NOFILE, MAX_OPEN_FILES),
                         (resource.RLIMIT_NPROC, 0), (resource.RLIMIT_CORE, 0)):
        hard = resource.getrlimit(limit)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)  # a limit may be lowered, never raised past what the trainer got
        resource.setrlimit(limit, (value, value))


def _disable_fork_exec() -> None:
    """multiprocessing's spawn starts interpreters through ``_posixsubprocess.fork_exec``, which raises no audit
    event; replace it (a re-import of the module is refused by the guard)."""
    import _posixsubprocess

    def refuse(*_args, **_kwargs):
        raise PermissionError("sandbox: starting processes is not allowed")

    _posixsubprocess.fork_exec = refuse


def _python_installation_roots() -> tuple[str, ...]:
    """Directories the code may read files from besides its scratch directory: the standard library and the
    installed packages (so ``import numpy`` works), nothing else."""
    import sysconfig

    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[key]) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(sorted(roots))


def _make_audit_guard(scratch: str, read_roots: tuple[str, ...]):
    """The audit hook. Everything it uses is bound here, in its closure, so code that replaces module attributes
    (``os.path.realpath = ...``) does not change what the guard checks."""
    import socket

    realpath, join, getcwd, fsdecode, isdir = (os.path.realpath, os.path.join, os.getcwd, os.fsdecode,
                                               os.path.isdir)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    unix_family = getattr(socket, "AF_UNIX", None)
    unix_address_events = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg")
    readable_devices = ("/dev/null", "/dev/urandom", "/dev/random", "/dev/zero")
    refused_events = {
        "os.system": "starting processes", "os.exec": "starting processes", "os.fork": "starting processes",
        "os.forkpty": "starting processes", "os.posix_spawn": "starting processes", "os.spawn": "starting processes",
        "subprocess.Popen": "starting processes", "os.kill": "sending signals", "os.killpg": "sending signals",
        "signal.pthread_kill": "sending signals", "os.chdir": "changing directory", "sys.settrace": "tracing",
        "sys.setprofile": "tracing", "gc.get_objects": "gc introspection", "gc.get_referrers": "gc introspection",
        "gc.get_referents": "gc introspection", "ctypes.dlsym": "ctypes", "ctypes.call_function": "ctypes",
        "ctypes.cdata": "ctypes",
    }
    # event -> positions of the path arguments that must stay inside the scratch directory
    path_events = {
        "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
        "os.symlink": (1,), "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,), "os.utime": (0,),
        "os.chflags": (0,), "os.lchflags": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
        "shutil.rmtree": (0,),
    }

    def refuse(what: str, path: object = None) -> None:
        raise PermissionError(f"sandbox: {what} is not allowed" + (f" ({path})" if path is not None else ""))

    def resolve(path: object) -> str:
        return realpath(join(getcwd(), fsdecode(path)))

    def inside(path: str, root: str) -> bool:
        return path == root or path.startswith(root.rstrip("/") + "/")

    def check_open(path: object, mode: object, flags: object) -> None:
        if isinstance(path, int):
            return  # an already open descriptor: its path was checked when it was opened
        resolved = resolve(path)
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & write_flags)
        if inside(resolved, scratch):
            return
        if writing:
            refuse("writing outside the scratch directory", path)
        # Directories outside are not opened, so no descriptor can serve as a dir_fd base for a write.
        if resolved in readable_devices or (any(inside(resolved, root) for root in read_roots) and not isdir(resolved)):
            return
        refuse("reading outside the scratch directory and the Python installation", path)

    def check_socket(event: str, args: tuple) -> None:
        """Unix sockets stay allowed inside the scratch directory (asyncio's event loop makes a socket pair);
        every other socket, name lookup or address is refused."""
        if event == "socket.__new__" and args[1] == unix_family:
            return
        address = args[1] if len(args) > 1 else None
        if event in unix_address_events and isinstance(address, (str, bytes)) and address[:1] not in ("", "\0", b"\0") \
                and inside(resolve(address), scratch):
            return
        refuse("network access")

    def guard(event: str, args: tuple) -> None:
        if event == "open":
            check_open(*args[:3])
        elif event in path_events:
            for position in path_events[event]:
                if not isinstance(args[position], int) and not inside(resolve(args[position]), scratch):
                    refuse(f"{event} outside the scratch directory", args[position])
        elif event in refused_events:
            refuse(refused_events[event])
        elif event.startswith("socket."):
            check_socket(event, args)
        elif event == "ctypes.dlopen" and args[0] is not None:  # dlopen(None) happens at `import ctypes`
            refuse("loading native libraries", args[0])
        elif event == "import" and args[0] == "_posixsubprocess":
            refuse("starting processes")

    return guard


if __name__ == "__main__":
    sys.exit(_child_main(*sys.argv[1:4]))
