"""Compile grammars in a child process with a time limit and a memory cap.

Some real JSON schemas make outlines_core's compile run for minutes or
allocate tens of GB (one drove a 24 GB machine into the OOM killer).  Code
that compiles schemas it did not write must survive that, so the compile
runs in a worker whose address space is capped (``RLIMIT_AS``) and which
is killed at a deadline; the Index comes back as bytes for
``Index.from_binary`` (never ``pickle``).  The worker imports outlines_core
alone, so it starts fast, and keeps the vocabularies it was sent.

Protocol over the worker's stdin/stdout, one frame per message: an 8-byte
little-endian header length, a JSON header, an 8-byte payload length, the
payload bytes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Callable

from outlines_maskcache import outlines_core_calls as core

_LEN = struct.Struct("<Q")
#: how the child reports a failed allocation: Rust's ``handle_alloc_error``
#: and CPython's MemoryError
_OOM_MARKS = ("memory allocation of", "MemoryError", "std::bad_alloc", "Cannot allocate memory")


class CompileFailed(RuntimeError):
    """A guarded compile that produced no grammar; ``reason`` is timeout, oom, error or crash."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


def _write_frame(fh: IO[bytes], header: dict[str, Any], payload: bytes = b"") -> None:
    head = json.dumps(header).encode()
    fh.write(_LEN.pack(len(head)) + head + _LEN.pack(len(payload)))
    fh.write(payload)
    fh.flush()


def _read_exact(fh: IO[bytes], n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = fh.read(left)
        if not chunk:
            raise EOFError("worker closed its pipe")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(fh: IO[bytes]) -> tuple[dict[str, Any], bytes]:
    head = json.loads(_read_exact(fh, _LEN.unpack(_read_exact(fh, _LEN.size))[0]))
    payload = _read_exact(fh, _LEN.unpack(_read_exact(fh, _LEN.size))[0])
    return head, payload


class Worker:
    """One compile process; used by one thread at a time (a pool holds several)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self._vocabularies: set[str] = set()

    def _start(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stderr = tempfile.TemporaryFile()
        env = dict(os.environ, OUTLINES_MASKCACHE="0", RAYON_NUM_THREADS=os.environ.get("RAYON_NUM_THREADS", "1"))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "outlines_maskcache.guard", str(self.max_bytes or 0)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env,
        )
        self._vocabularies = set()
        return self._proc

    def compile(self, kind: str, spec: str, vocabulary_key: str, vocabulary: Any,
                timeout: float | None) -> tuple[bytes, float]:
        """(Index bytes, compile seconds) of *spec* (``regex`` or ``json``) over *vocabulary*.

        *vocabulary* is an outlines_core ``Vocabulary`` (sent once per worker,
        as its ``from_binary`` bytes) named by *vocabulary_key*.
        """
        def send(stdin: IO[bytes]) -> None:
            if vocabulary_key not in self._vocabularies:
                _write_frame(stdin, {"op": "vocabulary", "key": vocabulary_key}, core.binary_of(vocabulary))
                self._vocabularies.add(vocabulary_key)
            _write_frame(stdin, {"op": "index", "kind": kind, "spec": spec, "vocabulary": vocabulary_key})

        head, payload = self._ask(send, timeout)
        return payload, float(head.get("seconds", 0.0))

    def regex(self, schema: str, timeout: float | None, whitespace_pattern: str | None = None) -> str:
        """The regex outlines_core builds from the JSON *schema*, built in the worker.

        Guarded like a compile: for some real schemas the conversion alone asks
        for gigabytes, which would abort or OOM-kill the caller.
        """
        def send(stdin: IO[bytes]) -> None:
            _write_frame(stdin, {"op": "regex", "spec": schema, "whitespace": whitespace_pattern})

        return self._ask(send, timeout)[1].decode("utf-8")

    def _ask(self, send: Callable[[IO[bytes]], None], timeout: float | None) -> tuple[dict[str, Any], bytes]:
        """One request (*send* writes it) and its answer within *timeout*; any worker failure is a CompileFailed."""
        proc = self._start()
        assert proc.stdin is not None and proc.stdout is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            send(proc.stdin)
            self._wait(proc, deadline)
            head, payload = _read_frame(proc.stdout)
        except (EOFError, BrokenPipeError, OSError, ValueError) as err:
            raise self._died(err) from None
        if head.get("ok"):
            return head, payload
        raise CompileFailed("oom" if _is_oom(head.get("error", "")) else "error", head.get("error", "unknown error"))

    def _wait(self, proc: subprocess.Popen[bytes], deadline: float | None) -> None:
        assert proc.stdout is not None
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self.close()
                raise CompileFailed("timeout", "compile exceeded its time limit; the worker was killed")
            ready, _, _ = select.select([proc.stdout], [], [], 1.0 if left is None else min(left, 1.0))
            if ready:
                return

    def _died(self, err: BaseException) -> CompileFailed:
        proc = self._proc
        if proc is not None and proc.poll() is None:  # a garbled frame from a live worker: end it
            proc.kill()
        code = proc.wait() if proc is not None else None
        log_text = ""
        if self._stderr is not None:
            self._stderr.seek(0)
            log_text = self._stderr.read()[-2000:].decode("utf-8", "replace")
        self.close()
        capped = self.max_bytes is not None and self.max_bytes > 0
        if _is_oom(log_text) or (capped and code in (-signal.SIGABRT, -signal.SIGKILL, -signal.SIGSEGV)) \
                or code == -signal.SIGKILL:
            cap = f" (cap {self.max_bytes / 2**30:.1f} GiB)" if capped else ""
            return CompileFailed("oom", f"compile ran out of memory{cap}; the worker died with code {code}")
        return CompileFailed("crash", f"the compile worker died with code {code} ({err}): {log_text.strip()[-500:]}")

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for fh in (proc.stdin, proc.stdout) if proc is not None else ():
            if fh is not None:
                fh.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        self._vocabularies = set()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


def _is_oom(text: str) -> bool:
    return any(mark in text for mark in _OOM_MARKS)


_local = threading.local()


def _thread_worker(max_bytes: int | None) -> Worker:
    """This thread's worker for inline guarded work, restarted when the cap changes."""
    worker = getattr(_local, "worker", None)
    if worker is None or worker.max_bytes != max_bytes:
        if worker is not None:
            worker.close()
        worker = _local.worker = Worker(max_bytes)
    return worker


def compile_index(regex: str, vocabulary: Any, vocabulary_key: str, timeout: float | None,
                  max_bytes: int | None) -> Any:
    """An outlines_core ``Index`` compiled in this thread's guarded worker (inline ``configure(compile_timeout=...)``)."""
    data, _ = _thread_worker(max_bytes).compile("regex", regex, vocabulary_key, vocabulary, timeout)
    return core.load_index(data)


def regex_from_schema(schema: str, whitespace_pattern: str | None, timeout: float | None,
                      max_bytes: int | None) -> str:
    """outlines_core's regex for *schema*, built in this thread's guarded worker (the inline guard)."""
    return _thread_worker(max_bytes).regex(schema, timeout, whitespace_pattern)


# -- the child side ------------------------------------------------------------

def _serve(max_bytes: int) -> None:
    if max_bytes > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    vocabularies: dict[str, Any] = {}
    while True:
        try:
            head, payload = _read_frame(stdin)
        except EOFError:
            return
        if head["op"] == "vocabulary":
            vocabularies[head["key"]] = core.load_vocabulary(payload)
            continue
        start = time.perf_counter()
        try:
            spec = head["spec"]
            if head["op"] == "regex":
                regex = core.schema_regex(spec, head.get("whitespace"))
                _write_frame(stdout, {"ok": True, "seconds": time.perf_counter() - start}, regex.encode())
                continue
            regex = core.schema_regex(spec) if head["kind"] == "json" else spec
            index = core.new_index(regex, vocabularies[head["vocabulary"]])
            data = core.binary_of(index)
            del index
            _write_frame(stdout, {"ok": True, "seconds": time.perf_counter() - start}, data)
        except BaseException as err:  # noqa: BLE001 - every failure is reported, the worker lives on
            _write_frame(stdout, {"ok": False, "error": f"{type(err).__name__}: {err}"})


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
