"""Offline vLLM generation for tests/engines/test_vllm.py, run as a subprocess.

A subprocess because stock and cached runs need different environments
(``OUTLINES_MASKCACHE=0`` keeps the plugin from patching, in every process
vLLM starts) and because vLLM's EngineCore runs in a child process that must
be able to re-import this module (hence the ``__main__`` guard).

Usage: python vllm_generate.py MODEL_DIR OUT_JSON
Writes {"pid": ..., "outputs": [{"kind", "spec", "prompt", "text", "finish_reason"}]}.
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
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump({"pid": os.getpid(), "outputs": outputs}, fh)
    del llm  # shuts the EngineCore down, which then writes its stats file


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
