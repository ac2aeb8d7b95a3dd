"""install/uninstall/disabled/stats: reversible, observable, idempotent."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

import outlines_maskcache as mc
from outlines_maskcache.contract import Target, UnsupportedVersionError
from support.versions import requires_outlines_core_backend


def _stock_attributes():
    from outlines.backends.outlines_core import OutlinesCoreBackend, OutlinesCoreLogitsProcessor

    return {
        "process_logits": OutlinesCoreLogitsProcessor.__dict__["process_logits"],
        # inherited from OutlinesLogitsProcessor in stock: must be absent again after uninstall
        "call": OutlinesCoreLogitsProcessor.__dict__.get("__call__"),
        "init": OutlinesCoreBackend.__dict__["__init__"],
        "vocab": OutlinesCoreBackend.__dict__["create_outlines_core_vocabulary"],
        "regex": OutlinesCoreBackend.__dict__["get_regex_logits_processor"],
    }


@requires_outlines_core_backend
def test_uninstall_restores_exact_originals_and_install_is_idempotent():
    mc.uninstall()
    stock = _stock_attributes()
    assert isinstance(stock["vocab"], staticmethod)
    installed = mc.install()
    # llamacpp-sampler joins it where llama-cpp-python is installed.
    assert installed == mc.install() and set(installed) - {"llamacpp-sampler"} == {"outlines-core-backend"}
    patched = _stock_attributes()
    assert stock["call"] is None and patched["call"] is not None
    assert all(patched[k] is not stock[k] for k in ("process_logits", "init", "regex", "vocab"))
    assert isinstance(patched["vocab"], staticmethod), "a staticmethod stays one (called on the class and instances)"
    mc.uninstall()
    mc.uninstall()  # twice is harmless
    assert _stock_attributes() == stock and not mc.is_installed()
    mc.install()
    assert mc.is_installed()


def test_import_before_outlines_installs_and_env_zero_does_not():
    code = (
        "import sys, outlines_maskcache as mc; assert 'outlines' in sys.modules; print(mc.installed_targets())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "outlines-core-backend" in out or "guide-processor" in out
    env = {"OUTLINES_MASKCACHE": "0", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", "import outlines_maskcache as mc; print(mc.is_installed())"],
                         capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == "False"
    out = subprocess.run([sys.executable, "-W", "always", "-c", "import outlines_maskcache as mc; print(mc.is_installed())"],
                         capture_output=True, text=True, check=True, env={"OUTLINES_MASKCACHE": "maybe"})
    assert out.stdout.strip() == "False" and "maybe" in out.stderr


def test_import_after_outlines_installs():
    code = "import outlines, outlines_maskcache as mc; print(mc.is_installed())"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "True"


def _fake_target(supported: str, adapter: str = "probe") -> Target:
    return Target(name="fake", distributions=("outlines",), supported=supported, module="json",
                  adapter=f"support.fake_adapters:{adapter}")


def test_unsupported_version_warns_and_patches_nothing(monkeypatch):
    import json

    monkeypatch.setattr("outlines_maskcache.targets.TARGETS", [_fake_target("<0.0.1")])
    mc.uninstall()
    with pytest.warns(RuntimeWarning, match="outside the supported range"):
        assert mc.install() == []
    assert not hasattr(json, "maskcache_probe") and not mc.is_installed()
    with pytest.raises(UnsupportedVersionError):
        mc.install(strict=True)
    with pytest.raises(UnsupportedVersionError):
        mc.install(targets=["fake"])
    with pytest.raises(ValueError, match="unknown targets"):
        mc.install(targets=["nope"])


@pytest.mark.parametrize("adapter", ["broken", "unknown_layout", "half_applicable"])
def test_unknown_layout_warns_once_and_patches_nothing(monkeypatch, adapter):
    import json

    monkeypatch.setattr("outlines_maskcache.targets.TARGETS", [_fake_target(">=0", adapter)])
    mc.uninstall()
    with pytest.warns(RuntimeWarning, match="cannot patch") as caught:
        assert mc.install() == []
    assert len(caught) == 1
    assert not hasattr(json, "maskcache_probe") and not hasattr(int, "maskcache_probe")
    with mc.disabled():
        assert json.loads("[1]") == [1]


def test_adapter_receives_the_installed_version(monkeypatch):
    import importlib.metadata

    from packaging.version import Version
    from support import fake_adapters

    monkeypatch.setattr("outlines_maskcache.targets.TARGETS", [_fake_target(">=0")])
    mc.uninstall()
    fake_adapters.received.clear()
    assert mc.install() == ["fake"]
    mc.uninstall()
    assert fake_adapters.received[-1][1] == Version(importlib.metadata.version("outlines"))


def test_inherited_attribute_is_deleted_on_uninstall(monkeypatch):
    import json

    monkeypatch.setattr("outlines_maskcache.targets.TARGETS", [_fake_target(">=0")])
    mc.uninstall()
    assert mc.install() == ["fake"] and json.maskcache_probe == 1
    mc.uninstall()
    assert not hasattr(json, "maskcache_probe")


@requires_outlines_core_backend
def test_disabled_nests_and_is_per_thread():
    from outlines_core import Index, Vocabulary
    from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor

    index = Index("a+", Vocabulary(1, {"a": [0]}))
    seen = {}

    def run(name):
        proc = OutlinesCoreLogitsProcessor(index, "torch")
        proc(torch.tensor([[0]]), torch.zeros(1, 4))
        seen[name] = mc.stats()["misses"]

    with mc.disabled():
        with mc.disabled():
            run("nested")
        run("outer")
        # another thread is not disabled by this block
        t = threading.Thread(target=run, args=("thread",))
        t.start()
        t.join()
    run("after")
    assert seen["nested"] == 0 and seen["outer"] == 0 and seen["thread"] == 1 and seen["after"] == 1


@requires_outlines_core_backend
def test_stats_and_clear():
    from outlines_core import Index, Vocabulary
    from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor

    index = Index("ab", Vocabulary(2, {"a": [0], "b": [1]}))
    for _ in range(2):
        proc = OutlinesCoreLogitsProcessor(index, "torch")
        proc(torch.tensor([[5], [5]]), torch.zeros(2, 4))
    stats = mc.stats()
    assert (stats["misses"], stats["hits"], stats["entries"]) == (1, 1, 1)
    assert stats["bytes"] == 4 * 4 and stats["bytes_by_device"] == {"cpu": 16}
    mc.clear()
    assert mc.stats()["entries"] == 0 and mc.stats()["misses"] == 1
    mc.reset_stats()
    assert mc.stats()["misses"] == 0


def test_configure_rejects_bad_values_and_changes_nothing():
    before = mc.settings()
    for bad in (dict(max_bytes=-1), dict(max_bytes="big"), dict(form="fastest"), dict(nan_guard="yes")):
        with pytest.raises(mc.ConfigError):
            mc.configure(**bad)
    assert mc.settings() == before
    assert mc.configure(max_bytes=1 << 20).max_bytes == 1 << 20
