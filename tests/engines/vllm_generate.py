"""Offline vLLM generation for tests/engines/test_vllm.py, run as a subprocess.

A subprocess because stock and cached runs need different environments
(``OUTLINES_MASKCACHE=0`` keeps the plugin from patching, in every process
vLLM starts) and because vLLM's EngineCore runs in a child process that must
be able to re-import this module (hence the ``__main__`` guard).

Usage: python vllm_generate.py MODEL_DIR OUT_JSON [--speculative]
Writes {"pid": ..., "outputs": [{"kind", "spec", "prompt", "text", "finish_reason"}],
"edge": [{"case", "request", "texts", "finish_reasons"}]}; with ``--speculative``
(engine in process, ngram speculative decoding) {"ids": [...], "texts": [...],
"grammar_calls": {...}} instead.

Besides plain greedy batches it runs the cases where vLLM's accept path
differs: requests that stop (EOS) at different steps of one batch, requests
cut off by ``max_tokens``, ``n > 1`` seeded samples sharing one prompt, and a
request aborted mid-generation while the others continue.
"""

from __future__ import annotations

import json
import os
import sys

#: (kind, spec) pairs; JSON fields are all bounded so a random model finishes them.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "role": {"enum": ["admin", "user"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "role", "active"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}@(ab|cd)\.(com|org)"
CONSTRAINTS = [("json", json.dumps(SCHEMA)), ("regex", REGEX)]
PROMPTS = ["Describe a user:", "Another one:", "Hello world, here is a record"]
MAX_TOKENS = 48


def main(model_dir: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=8,
        seed=0,
        structured_outputs_config={"backend": "outlines"},
    )
    outputs = []
    for kind, spec in CONSTRAINTS:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            structured_outputs=StructuredOutputsParams(**{kind: spec}),
        )
        # Twice: the second round's requests compile the same spec again and must hit.
        for _ in range(2):
            for prompt, result in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
                completion = result.outputs[0]
                outputs.append(
                    {"kind": kind, "spec": spec, "prompt": prompt, "text": completion.text,
                     "finish_reason": completion.finish_reason}
                )
    edge = _edge_cases(llm, SamplingParams, StructuredOutputsParams)
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump({"pid": os.getpid(), "outputs": outputs, "edge": edge}, fh)
    del llm  # shuts the EngineCore down, which then writes its stats file


def _edge_cases(llm, SamplingParams, StructuredOutputsParams) -> list[dict]:
    json_spec = StructuredOutputsParams(json=CONSTRAINTS[0][1])
    regex_spec = StructuredOutputsParams(regex=REGEX)
    found = []

    def record(case: str, results) -> None:
        for result in results:
            found.append({"case": case, "request": str(result.request_id).split("-")[0],
                          "texts": [o.text for o in result.outputs],
                          "token_ids": [list(o.token_ids) for o in result.outputs],
                          "finish_reasons": [o.finish_reason for o in result.outputs]})

    # Cut off mid-grammar at several lengths in one batch (finish_reason "length").
    record("max_tokens", [llm.generate(p, SamplingParams(temperature=0.0, max_tokens=n, structured_outputs=json_spec),
                                       use_tqdm=False)[0] for p, n in zip(PROMPTS, (3, 7, 11))])
    # Seeded sampling, several completions per prompt, EOS at different steps.
    record("n>1", llm.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
                                                       structured_outputs=regex_spec), use_tqdm=False))
    # One of three requests aborted after a few steps; the others finish.
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=json_spec)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"abort{i}-req", prompt, params)
    finished, steps = [], 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 4:
            engine.abort_request(["abort1-req"])
        finished.extend(o for o in engine.step() if o.finished)
    record("abort", sorted(finished, key=lambda o: o.request_id))
    return found


#: prompts that repeat a record the grammar accepts, so ngram drafts pass the
#: grammar (validate_tokens) and the random model then rejects some (rollback)
_RECORD = '{"name":"aa","tags":["aa","ab","aa"]}'
SPEC_PROMPTS = [_RECORD + "\n" + _RECORD + "\n", "Records:\n" + _RECORD + "\n", '{"name":"M","tags":[]}\n' * 3, "Hello"]
SPEC_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "tags": {"type": "array", "items": {"enum": ["aa", "ab"]}, "maxItems": 6}},
               "required": ["name", "tags"]}


def speculative(model_dir: str, out_path: str) -> None:
    """Greedy structured generation with ngram speculative decoding; counts the grammar's validate/rollback calls.

    Run with the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    so the counting wrappers see the grammar calls.
    """
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output import backend_outlines

    calls = {"validate_tokens": 0, "validated": 0, "rollback": 0, "rolled_back": 0}
    grammar = backend_outlines.OutlinesGrammar
    validate, rollback = grammar.validate_tokens, grammar.rollback

    def counted_validate(self, tokens):
        valid = validate(self, tokens)
        calls["validate_tokens"] += 1
        calls["validated"] += len(valid)
        return valid

    def counted_rollback(self, num_tokens):
        calls["rollback"] += 1
        calls["rolled_back"] += num_tokens
        return rollback(self, num_tokens)

    grammar.validate_tokens, grammar.rollback = counted_validate, counted_rollback
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0,
              structured_outputs_config={"backend": "outlines"},
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(json=json.dumps(SPEC_SCHEMA)))
    results = llm.generate(SPEC_PROMPTS, params, use_tqdm=False)
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump({"pid": os.getpid(), "ids": [list(r.outputs[0].token_ids) for r in results],
                   "texts": [r.outputs[0].text for r in results], "grammar_calls": calls}, fh)


if __name__ == "__main__":
    if "--speculative" in sys.argv[3:]:
        speculative(sys.argv[1], sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])
