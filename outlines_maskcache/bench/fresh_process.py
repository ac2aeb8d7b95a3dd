"""Run a benchmark step in a fresh Python process, with the plugin on or off and a given grammar store.

Cold-start figures only mean something in a new process (nothing memoized,
nothing imported yet), and ``OUTLINES_MASKCACHE=0`` must be set before
outlines is imported to leave it stock; every benchmark that compares
setups across processes goes through here so they all set the same
environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_fresh(module: str, args: list[str], *, plugin: bool, store: Path,
              capture: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m module args...`` with the plugin on or off and *store* as its grammar store."""
    env = dict(os.environ, OUTLINES_MASKCACHE="1" if plugin else "0", OUTLINES_MASKCACHE_STORE=str(store),
               TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", module, *args], env=env, check=not capture,
                          capture_output=capture, text=True)


def failure_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The last line a failed child wrote to stderr (its exception), or its exit status when it wrote none."""
    lines = (proc.stderr or "").strip().splitlines()
    return lines[-1] if lines else f"exit {proc.returncode}"
