"""The tested matrix, as data: which releases of each target's distribution CI runs.

One place for it: the noxfile builds its sessions from :data:`TESTED`,
``outlines-maskcache status`` says whether the installed release is in it,
an install of an untested release inside a supported range logs one line,
and a test checks that docs/versions.md and the targets' ``supported``
ranges agree with it (each range's oldest and newest tested release lie
inside it).  Dependency-free, so the noxfile can read it without installing
anything, and the lane scripts run it as a script.
"""

from __future__ import annotations

import sys

#: target name -> releases CI runs (oldest first)
TESTED: dict[str, tuple[str, ...]] = {
    "outlines-core-backend": ("1.2.0", "1.2.3", "1.2.4", "1.3.3"),
    "guide-processor": ("0.1.1", "0.2.3", "1.0.4", "1.1.1"),
    "llamacpp-sampler": ("0.3.36",),
    "vllm-v1": ("0.27.0", "0.32.0", "0.34.0"),
    "sglang": ("0.5.21", "0.5.23"),
}

#: releases with no CPU build on the registry: CI installs the registry's (CUDA) wheel without its
#: dependencies over the environment of the newest CPU build of the line, and the session drives the
#: patched components directly (backend, grammars, the CPU worker's apply), no engine
WITHOUT_DEPENDENCIES: dict[str, tuple[str, ...]] = {
    "vllm-v1": ("0.34.0",),
}

#: libraries CI runs that have no target of their own: mlx-lm goes through
#: the outlines-core-backend target (mlx[cpu] on Linux), in the main session
ALSO_TESTED: dict[str, tuple[str, ...]] = {
    "mlx-lm": ("0.32.2",),
    "mlx": ("0.32.4",),
}

#: Python interpreters CI runs besides the main sessions' 3.11: the oldest
#: that ``requires-python`` admits and the newest outlines 1.3 admits, each
#: without torch (no CPU wheel of it is at hand for them; see .ci/lanes/70-python.sh)
PYTHONS: tuple[str, ...] = ("3.10.13", "3.13.0")


#: outlines_core releases whose lazy Index CI proves equal to the full one
#: (tests/test_lazy_index_equals_full.py runs in every outlines-core-backend
#: session: 0.2.11 under outlines 1.2.x, 0.2.14 under 1.3.3); the lazy Index
#: is on by default only for these
LAZY_INDEX_PROVEN: tuple[str, ...] = ("0.2.11", "0.2.14")


def is_tested(target: str, version: object) -> bool:
    """Whether CI runs *target* at *version* (a local label such as ``+cpu`` is ignored)."""
    text = str(version).split("+", 1)[0]
    return text in TESTED.get(target, ())


if __name__ == "__main__":
    # `python3 outlines_maskcache/versions.py [--without-dependencies] TARGET`: its releases, one a line (the lanes read this)
    table = WITHOUT_DEPENDENCIES if sys.argv[1] == "--without-dependencies" else {**TESTED, **ALSO_TESTED}
    print("\n".join(table.get(sys.argv[-1], ())))
