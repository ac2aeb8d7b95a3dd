"""Tables and progress bars for the benchmarks (rich when installed, plain text otherwise)."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


def table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is in the `bench` extra
        print(title)
        print("\t".join(headers))
        for row in rows:
            print("\t".join(row))
        return
    out = Table(title=title)
    for h in headers:
        out.add_column(h, justify="right")
    for row in rows:
        out.add_row(*row)
    # Off a terminal (CI logs, pipes) rich would squeeze the table to 80 columns.
    Console(width=None if sys.stdout.isatty() else 240).print(out)


@contextlib.contextmanager
def progress_bar(total: int, label: str) -> Iterator[Callable[..., None]]:
    """A callable that advances a rich progress bar by one (or by ``n``); silent without rich."""
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        yield lambda n=1: None
        return
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   transient=True)
    task = bar.add_task(label, total=total)
    with bar:
        yield lambda n=1: bar.advance(task, n)
