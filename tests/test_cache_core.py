"""The cache core on its own: LRU order, byte budgets per device, counters, threads."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from outlines_maskcache.cache import MaskCache
from outlines_maskcache.config import ConfigError, Settings, enabled_from_env, parse_size, settings_from_env
from outlines_maskcache.fingerprint import Memo, Registry, digest


def size(value: bytes) -> int:
    return len(value)


def test_lru_evicts_oldest_within_a_device_budget():
    cache = MaskCache(max_bytes=10)
    for name in "abc":
        cache.get_or_build(("g", "cpu", name), lambda name=name: name.encode() * 4, size)
    # 3 x 4 bytes > 10: "a" went first
    assert cache.get(("g", "cpu", "a")) is None
    assert cache.get(("g", "cpu", "b")) == b"bbbb"
    cache.get_or_build(("g", "cpu", "d"), lambda: b"dddd", size)  # evicts c (b was just used)
    assert cache.get(("g", "cpu", "c")) is None and cache.get(("g", "cpu", "b")) is not None
    snap = cache.snapshot()
    assert snap["evictions"] == 2 and snap["bytes"] <= 10 and snap["entries"] == 2


def test_budgets_are_per_device():
    cache = MaskCache(max_bytes=8)
    cache.get_or_build(("g", "cpu", 1), lambda: b"x" * 8, size)
    cache.get_or_build(("g", "cuda:0", 1), lambda: b"y" * 8, size)
    snap = cache.snapshot()
    assert snap["entries"] == 2 and snap["bytes_by_device"] == {"cpu": 8, "cuda:0": 8} and snap["evictions"] == 0


def test_oversized_value_is_served_but_not_stored():
    cache = MaskCache(max_bytes=3)
    assert cache.get_or_build(("g", "cpu", 1), lambda: b"toolong", size) == b"toolong"
    assert len(cache) == 0 and cache.counters.bypasses == 1


def test_rejected_entry_is_dropped_and_counted_not_served():
    cache = MaskCache(max_bytes=100)
    cache.get_or_build(("g", "cpu", 1), lambda: b"old", size)
    assert cache.get_many([("g", "cpu", 1), ("g", "cpu", 2)]) == [b"old", None]
    cache.reject(("g", "cpu", 1))
    assert cache.get(("g", "cpu", 1)) is None and len(cache) == 0 and cache.snapshot()["bytes"] == 0
    assert cache.put(("g", "cpu", 1), b"new", 3) == b"new"
    c = cache.counters
    assert (c.hits, c.invalid, c.misses) == (0, 1, 2)


def test_put_keeps_the_first_value_a_racing_builder_stored():
    cache = MaskCache(max_bytes=100)
    first = bytearray(b"one")
    assert cache.put(("g", "cpu", 1), first, 3) is first
    assert cache.put(("g", "cpu", 1), bytearray(b"one"), 3) is first
    assert len(cache) == 1 and cache.counters.misses == 2


def test_shrinking_the_budget_evicts_now():
    cache = MaskCache(max_bytes=100)
    for i in range(10):
        cache.get_or_build(("g", "cpu", i), lambda: b"0123456789", size)
    cache.set_max_bytes(25)
    assert cache.snapshot()["bytes"] <= 25 and len(cache) == 2


def test_drop_forgets_one_grammar():
    cache = MaskCache(max_bytes=100)
    cache.get_or_build(("g1", "cpu", 1), lambda: b"a", size)
    cache.get_or_build(("g2", "cpu", 1), lambda: b"b", size)
    cache.drop(["g1"])
    assert cache.get(("g1", "cpu", 1)) is None and cache.get(("g2", "cpu", 1)) == b"b"


def test_threads_never_see_a_wrong_value_and_counters_add_up():
    cache = MaskCache(max_bytes=64)
    errors: list[str] = []
    calls = 2000

    def worker(seed: int) -> None:
        for i in range(calls):
            key = ("g", "cpu", (seed * 7 + i) % 37)
            value = cache.get_or_build(key, lambda k=key: str(k[2]).encode().ljust(8, b"."), size)
            if value != str(key[2]).encode().ljust(8, b"."):
                errors.append(f"{key} -> {value!r}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "deadlock"
    snap = cache.snapshot()
    assert not errors
    assert snap["hits"] + snap["misses"] == 8 * calls
    assert snap["bytes"] <= 64 and snap["entries"] * 8 == snap["bytes"]


class CacheModel(RuleBasedStateMachine):
    """Against a dict model: every value served equals the one its key builds; bytes never exceed the budget."""

    def __init__(self) -> None:
        super().__init__()
        self.budget = 40
        self.cache = MaskCache(self.budget)
        self.lookups = 0

    @rule(grammar=st.sampled_from(["g1", "g2"]), device=st.sampled_from(["cpu", "cuda:0"]), state=st.integers(0, 9))
    def lookup(self, grammar, device, state):
        expected = f"{grammar}/{device}/{state}".encode()
        assert self.cache.get_or_build((grammar, device, state), lambda: expected, size) == expected
        self.lookups += 1

    @rule(budget=st.integers(0, 80))
    def rebudget(self, budget):
        self.budget = budget
        self.cache.set_max_bytes(budget)

    @rule()
    def clear(self):
        self.cache.clear()

    @rule(grammar=st.sampled_from(["g1", "g2"]))
    def drop(self, grammar):
        self.cache.drop([grammar])

    @invariant()
    def bounded_and_consistent(self):
        snap = self.cache.snapshot()
        for device, used in snap["bytes_by_device"].items():
            assert used <= self.budget
        assert snap["hits"] + snap["misses"] == self.lookups
        assert snap["bytes"] == sum(len(v) for v, _ in self.cache._entries.values())


TestCacheModel = CacheModel.TestCase


# -- settings -----------------------------------------------------------------
@pytest.mark.parametrize("text,expected", [("1024", 1024), ("512MiB", 512 << 20), ("1G", 10**9), ("2 kib", 2048), ("7b", 7)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["-1", "1.5G", "lots", "", "12XB"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError):
        parse_size(text)


@pytest.mark.parametrize("change", [dict(max_bytes=-1), dict(max_bytes=1.5), dict(max_bytes="1G"), dict(max_bytes=True),
                                    dict(max_grammars=0), dict(form="fast"), dict(nan_guard=1), dict(colour="red"),
                                    dict(sparse_below=-0.1), dict(sparse_below=2), dict(sparse_below=True)])
def test_bad_settings_raise_clearly(change):
    with pytest.raises(ConfigError, match=next(iter(change))):
        Settings().updated(**change)


def test_env_switch_values():
    assert enabled_from_env({}) and enabled_from_env({"OUTLINES_MASKCACHE": "1"}) and enabled_from_env({"OUTLINES_MASKCACHE": "On"})
    assert not enabled_from_env({"OUTLINES_MASKCACHE": "0"}) and not enabled_from_env({"OUTLINES_MASKCACHE": "false"})
    with pytest.warns(RuntimeWarning, match="maybe"):
        assert not enabled_from_env({"OUTLINES_MASKCACHE": "maybe"})


def test_env_budget():
    assert settings_from_env({"OUTLINES_MASKCACHE_MAX_BYTES": "64MiB"}).max_bytes == 64 << 20
    with pytest.warns(RuntimeWarning, match="MAX_BYTES"):
        assert settings_from_env({"OUTLINES_MASKCACHE_MAX_BYTES": "-5"}).max_bytes == Settings().max_bytes


# -- fingerprints -------------------------------------------------------------
def test_registry_identity_tokens_are_never_reused():
    dropped: list[list[str]] = []
    registry = Registry(2, dropped.append)
    objs = [object() for _ in range(3)]
    tokens = [registry.of(o) for o in objs]
    assert len(set(tokens)) == 3 and registry.of(objs[2]) == tokens[2]
    assert dropped == [[tokens[0]]]
    assert registry.of(objs[0]) not in tokens  # came back: a fresh token, its old masks are gone


def test_content_fingerprints_survive_re_registration():
    registry = Registry(4, lambda fps: None)
    a, b = object(), object()
    registry.register(a, digest("index", "v", "abc"))
    registry.register(b, digest("index", "v", "abc"))
    assert registry.of(a) == registry.of(b)


def test_memo_builds_once_under_contention():
    memo = Memo(4)
    builds = []
    barrier = threading.Barrier(8)

    def build():
        builds.append(1)
        return object()

    results = []

    def worker():
        barrier.wait()
        results.append(memo.get_or_build("k", build))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(builds) == 1 and len({id(r) for r in results}) == 1


def test_memo_failed_build_does_not_poison():
    memo = Memo(2)
    with pytest.raises(ZeroDivisionError):
        memo.get_or_build("k", lambda: 1 / 0)
    assert memo.get_or_build("k", lambda: 5) == 5


@given(st.dictionaries(st.text(max_size=3), st.one_of(st.integers(0, 50), st.lists(st.integers(0, 50), max_size=3)),
                       max_size=20))
def test_vocabulary_memo_key_is_order_independent(vocab):
    """Hashable ids (a frozenset hash) and lists of ids (a sorted digest) alike."""
    from outlines_maskcache.fingerprint import vocabulary_hash

    assert vocabulary_hash(vocab) == vocabulary_hash(dict(reversed(list(vocab.items()))))
