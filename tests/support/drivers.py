"""Drive a stock and a cached outlines processor in lockstep and compare every step bit for bit.

torch is optional here: the torch-free sessions of the matrix (Python 3.10
and 3.13, where no CPU torch wheel is at hand) drive outlines' numpy
processor through the same walks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

import outlines_maskcache as mc

try:
    import torch
except ImportError:
    torch = None

#: the tensor library a walk uses unless told otherwise
DEFAULT_LIBRARY = "torch" if torch is not None else "numpy"


def is_tensor(x) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


def bits(x):
    if is_tensor(x):
        int_view = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
                    torch.bfloat16: torch.int16}
        return x.contiguous().view(int_view[x.dtype])
    return np.ascontiguousarray(x).view({4: np.int32, 2: np.int16, 8: np.int64}[x.dtype.itemsize])


def assert_bit_identical(stock, cached, where: str = "") -> None:
    if is_tensor(stock):
        assert stock.shape == cached.shape and stock.dtype == cached.dtype, where
        same = torch.equal(bits(stock), bits(cached))
    else:
        assert stock.shape == cached.shape and stock.dtype == cached.dtype, where
        same = np.array_equal(bits(stock), bits(cached))
    if not same:
        s, c = (np.asarray(t.float() if is_tensor(t) else t) for t in (stock, cached))
        diff = np.argwhere(np.asarray(bits(stock)) != np.asarray(bits(cached)))
        raise AssertionError(f"{where}: {len(diff)} logits differ, first at {diff[:5].tolist()}: stock={s[tuple(diff[0])]} cached={c[tuple(diff[0])]}")


def random_logits(rng: np.random.Generator, batch: int, width: int, dtype, library: str, specials: bool, nan: bool = False):
    data = rng.standard_normal((batch, width)).astype(np.float32) * 4
    if specials:
        for value in (0.0, -0.0, np.inf, -np.inf) + ((np.nan,) if nan else ()):
            pos = rng.integers(0, width, size=(batch, max(1, width // 50)))
            for r in range(batch):
                data[r, pos[r]] = value
    if library == "numpy":
        if torch is not None and dtype == torch.float16:
            return data.astype(np.float16)
        return data.astype(np.float16 if dtype == np.float16 else np.float32)
    return torch.from_numpy(data).to(dtype or torch.float32)


@contextlib.contextmanager
def numpy_blocked_below(fraction: float) -> Iterator[None]:
    """Set the numpy kernel's threshold for blocked-id rows (0: never, 1: every dense state)."""
    from outlines_maskcache.kernels.numpy import KERNEL

    previous = KERNEL.blocked_below
    KERNEL.blocked_below = fraction
    try:
        yield
    finally:
        KERNEL.blocked_below = previous


@dataclass
class Lockstep:
    """A stock processor (run under ``disabled()``) and a cached one over the same Index."""

    index: object
    library: str = DEFAULT_LIBRARY
    #: the cached processor's Index when it is not *index* (one loaded from the store)
    cached_index: object = None
    stock: object = field(init=False)
    cached: object = field(init=False)

    def __post_init__(self) -> None:
        from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor

        self.stock = OutlinesCoreLogitsProcessor(self.index, self.library)
        self.cached = OutlinesCoreLogitsProcessor(self.cached_index or self.index, self.library)

    def reset(self) -> None:
        self.stock.reset()
        self.cached.reset()

    def step(self, input_ids, logits):
        copy = (lambda t: t.clone()) if is_tensor(logits) else (lambda t: t.copy())
        stock_error = cached_error = None
        try:
            with mc.disabled():
                stock = self.stock(copy(input_ids), copy(logits))
        except Exception as err:  # noqa: BLE001
            stock, stock_error = None, err
        try:
            cached = self.cached(copy(input_ids), copy(logits))
        except Exception as err:  # noqa: BLE001
            cached, cached_error = None, err
        assert type(stock_error) is type(cached_error), (stock_error, cached_error)
        return stock, cached, stock_error


def walk(index, eos: int, rng: np.random.Generator, batch: int, steps: int, width: int, dtype=None,
         library: str = DEFAULT_LIBRARY, specials: bool = True, nan: bool = False, lockstep: Lockstep | None = None,
         eos_bias: float = 0.15) -> Lockstep:
    """Random allowed-token paths, rows diverging; assert equality at each step.

    Finished rows keep receiving EOS, as transformers pads finished sequences.
    *dtype* None means float32.
    """
    pair = lockstep or Lockstep(index, library)
    ids = rng.integers(0, width, size=(batch, 2))
    done = [False] * batch
    for step in range(steps):
        logits = random_logits(rng, batch, width, dtype, library, specials, nan)
        tensor_ids = torch.from_numpy(ids) if library == "torch" else ids.copy()
        stock, cached, error = pair.step(tensor_ids, logits)
        if error is not None:
            return pair
        assert_bit_identical(stock, cached, f"step {step}")
        stock_np = np.asarray(stock.float()) if is_tensor(stock) else np.asarray(stock, dtype=np.float32)
        nxt = []
        for r in range(batch):
            allowed = np.flatnonzero(stock_np[r] != -np.inf)
            if done[r] or allowed.size == 0:
                nxt.append(eos)
                continue
            if eos in allowed and rng.random() < eos_bias:
                token = eos
            else:
                token = int(rng.choice(allowed))
            done[r] = token == eos
            nxt.append(token)
        ids = np.concatenate([ids, np.asarray(nxt)[:, None]], axis=1)
    return pair
