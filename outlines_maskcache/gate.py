"""The one gate every patched function passes: cached while active, stock otherwise, stock again on any fault.

Two halves, used by every adapter:

* :func:`when_active` wraps a replacement so that, outside an install or
  inside :func:`~outlines_maskcache.disabled`, the original runs with the
  caller's arguments untouched: ``disabled()`` means stock whatever
  happened at install.
* :func:`cached_or_stock` runs the cached computation of one call and, if
  it raises, counts the fault, logs it once per place and error type, and
  runs the stock computation instead, so nothing of ours reaches the
  caller's result except a result stock would have given.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

from outlines_maskcache.kernels import LogitsLost
from outlines_maskcache.runtime import RUNTIME

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def when_active(stock: Callable[..., Any]) -> Callable[[F], F]:
    """Decorator: the replacement runs only while the cache is active; else *stock*, with the same arguments."""

    def wrap(replacement: F) -> F:
        active = RUNTIME.active

        @functools.wraps(replacement)
        def gated(*args: Any, **kwargs: Any) -> Any:
            if not active():
                return stock(*args, **kwargs)
            return replacement(*args, **kwargs)

        # Introspection (inspect.signature, help) sees stock's signature.
        gated.__wrapped__ = stock  # type: ignore[attr-defined]
        return gated  # type: ignore[return-value]

    return wrap


def cached_or_stock(where: str, cached: Callable[[], T], stock: Callable[[], T]) -> T:
    """Run the cached path; on any fault run the stock one instead.

    Safe because every cached application is idempotent under the stock one
    that follows: allowed logits are untouched, blocked ones are -inf (or NaN
    that stock then overwrites with -inf), so a half-applied batch re-masked
    by stock equals stock.  The one exception is a sparse row caught between
    its fill and its put-back; the kernel repairs that itself or raises
    :class:`~outlines_maskcache.kernels.LogitsLost`, which is re-raised here.
    """
    try:
        return cached()
    except LogitsLost as err:  # the logits are damaged: stock would mask garbage
        RUNTIME.fault(where, err)
        raise
    except Exception as err:  # noqa: BLE001 - any fault must reach stock, never the logits
        RUNTIME.fault(where, err)
        return stock()


def verify_served(key: tuple, served: Any, fresh: Any, equal: Callable[[Any, Any], bool]) -> None:
    """``verify=True``: a served mask must equal a fresh build.

    A mismatch drops the entry and raises, so the adapter runs stock for the
    step: a corrupted row is never applied.
    """
    cache = RUNTIME.cache
    if not equal(served, fresh):
        cache.reject(key)
        raise AssertionError(f"cached mask for state {key[2]!r} differs from a fresh build")
    cache.count("verified")
