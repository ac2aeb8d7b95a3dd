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
    """A callable that advances a rich progress bar by one (or by ``n``).

    Off a terminal (a log file, CI) and without rich it prints a plain line
    at every 5% instead, so a long run can be followed with ``tail``.
    """
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        Progress = None  # type: ignore[assignment]
    if Progress is None or not sys.stdout.isatty():
        done = [0]
        step = max(1, total // 20)

        def advance(n: int = 1) -> None:
            before, done[0] = done[0], done[0] + n
            if done[0] // step != before // step or done[0] == total:
                print(f"{label}: {done[0]}/{total}", file=sys.stderr, flush=True)

        yield advance
        return
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   transient=True)
    task = bar.add_task(label, total=total)
    with bar:
        yield lambda n=1: bar.advance(task, n)
