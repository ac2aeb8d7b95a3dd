"""Ahead-of-time compile into the grammar store: ``precompile()`` and ``outlines-maskcache compile``.

A deploy step compiles the schemas it will serve once (into an image, or a
shared volume), from JSON Schema files, ``.regex`` files, folders of them,
and MaskBench / JSONSchemaBench data files.  It needs no installed patches:
the vocabulary is converted by stock's own function and stored under
exactly the keys outlines' patched backend looks up.  Every compile, the
schema -> regex conversion included, runs in a guarded worker
(:mod:`outlines_maskcache.guard`), so a schema that would run for minutes
or exhaust memory fails alone, with its reason.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from outlines_maskcache import compiled
from outlines_maskcache import outlines_core_calls as core
from outlines_maskcache.guard import CompileFailed, Worker
from outlines_maskcache.runtime import RUNTIME


@dataclass
class Grammar:
    """One thing to compile: a JSON schema or a regex, with where it came from."""

    name: str
    kind: str  # "json" | "regex"
    spec: str
    #: MaskBench instances: (valid, data)
    tests: list[tuple[bool, Any]] = field(default_factory=list)


@dataclass
class Outcome:
    name: str
    #: compiled | stored (already in the store) | timeout | oom | error | crash
    status: str
    seconds: float
    message: str = ""
    regex: str | None = None
    index: bytes | None = None


@dataclass
class Report:
    outcomes: list[Outcome]
    seconds: float

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    def summary(self) -> dict[str, Any]:
        return {s: self.count(s) for s in ("compiled", "stored", "timeout", "oom", "error", "crash")} | {
            "schemas": len(self.outcomes), "seconds": round(self.seconds, 1)}


def read_grammars(paths: Iterable[str | os.PathLike[str]]) -> Iterator[Grammar]:
    """Grammars from files and folders (``*.json`` schemas or MaskBench files, ``*.regex``), sorted by name."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.suffix in (".json", ".regex") and p.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"no schema file or folder at {path}")
    for path in files:
        if path.suffix == ".regex":
            yield Grammar(path.stem, "regex", path.read_text(encoding="utf-8").strip())
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not JSON: {err}") from None
        if isinstance(data, dict) and "schema" in data and isinstance(data.get("tests", []), list):
            tests = [(bool(t.get("valid")), t.get("data")) for t in data.get("tests", []) if "data" in t]
            yield Grammar(path.stem, "json", json.dumps(data["schema"]), tests)
        else:
            yield Grammar(path.stem, "json", json.dumps(data))


def outlines_vocabulary(hf_tokenizer: Any) -> tuple[Any, str]:
    """(Vocabulary, its content key) exactly as outlines' backend converts *hf_tokenizer* (via the store)."""
    from outlines.backends.outlines_core import OutlinesCoreBackend

    from outlines_maskcache.patching import original
    from outlines_maskcache.targets.outlines.backend import transformers_vocabulary

    return transformers_vocabulary(hf_tokenizer, original(OutlinesCoreBackend, "create_outlines_core_vocabulary"))


def compile_all(grammars: list[Grammar], vocabulary: Any, vocab_key: str, *, workers: int = 1,
                timeout: float | None = None, max_bytes: int | None = None, keep_index: bool = False,
                progress: Callable[[], None] | None = None) -> Report:
    """Compile each grammar in guarded workers and save it in the store (when on); never raises for one grammar."""
    store = RUNTIME.store()
    start = time.perf_counter()
    pool = [Worker(max_bytes) for _ in range(max(1, workers))]
    free = list(pool)

    def one(grammar: Grammar) -> Outcome:
        began = time.perf_counter()

        def left() -> float | None:  # one time limit for the conversion and the compile together
            return None if timeout is None else max(0.0, timeout - (time.perf_counter() - began))

        regex: str | None = None
        worker = free.pop()
        try:
            # A JSON schema's regex is built in the worker too: for some real
            # schemas the conversion alone exhausts memory.
            regex = grammar.spec if grammar.kind == "regex" else worker.regex(grammar.spec, left())
            key = compiled.store_key("index", vocab_key, regex)
            data = store.get(key) if store is not None else None
            if data is not None:
                return Outcome(grammar.name, "stored", time.perf_counter() - began, regex=regex,
                               index=data if keep_index else None)
            data, _ = worker.compile("regex", regex, vocab_key, vocabulary, left())
        except CompileFailed as err:
            return Outcome(grammar.name, err.reason, time.perf_counter() - began, err.message, regex=regex)
        finally:
            free.append(worker)
        if store is not None:
            store.put(key, data)
        return Outcome(grammar.name, "compiled", time.perf_counter() - began, regex=regex,
                       index=data if keep_index else None)

    def tracked(grammar: Grammar) -> Outcome:
        try:
            return one(grammar)
        finally:
            if progress:
                progress()

    try:
        with ThreadPoolExecutor(max_workers=len(pool)) as threads:
            outcomes = list(threads.map(tracked, grammars))
    finally:
        for worker in pool:
            worker.close()
    return Report(outcomes, time.perf_counter() - start)


def precompile(tokenizer: Any, schemas: Iterable[Any], *, workers: int | None = None, timeout: float | None = 600.0,
               max_bytes: int | None = 8 << 30, progress: Callable[[], None] | None = None) -> Report:
    """Compile *schemas* for *tokenizer* (a Hugging Face tokenizer) into the grammar store.

    *schemas*: JSON schemas (dicts or JSON strings), :class:`Grammar` objects,
    or paths of files/folders.  Each compile runs in a worker process killed
    past *timeout* seconds or *max_bytes* of memory; failures are reported in
    the returned :class:`Report`, never raised.
    """
    if RUNTIME.store() is None:
        raise RuntimeError("the grammar store is off (OUTLINES_MASKCACHE_STORE=0 or configure(store=False)); nothing to fill")
    grammars: list[Grammar] = []
    for i, item in enumerate(schemas):
        if isinstance(item, Grammar):
            grammars.append(item)
        elif isinstance(item, (str, os.PathLike)) and Path(item).exists():
            grammars.extend(read_grammars([item]))
        elif isinstance(item, dict):
            grammars.append(Grammar(f"schema-{i}", "json", json.dumps(item)))
        elif isinstance(item, str):
            json.loads(item)  # a clear error for a string that is neither a path nor JSON
            grammars.append(Grammar(f"schema-{i}", "json", item))
        else:
            raise TypeError(f"cannot compile {type(item).__name__}: pass schemas as dicts, JSON strings or paths")
    vocabulary, vocab_key = outlines_vocabulary(tokenizer)
    report = compile_all(grammars, vocabulary, vocab_key, workers=workers or max(1, (os.cpu_count() or 2) // 2),
                         timeout=timeout, max_bytes=max_bytes, progress=progress)
    if core.has_python_index():  # the lazy Index's token table, so a new process need not build it
        from outlines_maskcache.lazy_compile import store_token_table

        store_token_table(vocabulary)
    RUNTIME.settle()  # the vocabulary's (and table's) store writes run on a background thread
    return report

