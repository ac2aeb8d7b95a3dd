"""Offline vLLM generation for tests/engines/test_vllm.py, run as a subprocess.

A subprocess because stock and cached runs need different environments
(``OUTLINES_MASKCACHE=0`` keeps the plugin from patching, in every process
vLLM starts) and because vLLM's EngineCore runs in a child process that must
be able to re-import this module (hence the ``__main__`` guard).

Usage: python vllm_generate.py MODEL_DIR OUT_JSON
Writes {"pid": ..., "outputs": [{"kind", "spec", "prompt", "text", "finish_reason"}],
"edge": [{"case", "request", "texts", "finish_reasons"}]}.

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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
