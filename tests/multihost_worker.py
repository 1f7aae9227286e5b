"""One rank of the multi-process tests (started by tp_jax.multihost.launcher; see tests/test_multihost.py).

    multihost_worker.py MODEL REQUEST_JSON

REQUEST_JSON: {"prompts": [[ids]], "max_tokens": n, "runs": [{"tp", "dp", "pp"?, "rank1_tp"?}],
"logits": [[ids]] (optional), "loop": bool}. For each run every rank prints one line
`RESULT {"rank", "run", "tokens" | "error", "bytes_read", "layers_read", "logits"}`: tokens
are what `LLM.generate` returned on that rank, bytes_read and layers_read what its loader
read from the safetensors files. Only rank 0 passes the real request: the others pass junk, which the driver
semantics must ignore. With "loop", the ranks then print `READY pid` and keep generating
with the last run's model until killed.
"""

import json
import os
import sys

from tp_jax.multihost.distributed import initialize, is_driver

initialize()

import jax  # noqa: E402

from tp_jax.serving.llm import LLM  # noqa: E402
from tp_jax.loaders import safetensors as st  # noqa: E402
from tp_jax.serving.sampling import SamplingParams  # noqa: E402

BYTES_READ, LAYERS_READ = [0], set()
_getitem = st.SafetensorsTensor.__getitem__


def _counting_getitem(self, index):
    out = _getitem(self, index)
    BYTES_READ[0] += out.nbytes
    if self.name.startswith("model.layers."):
        LAYERS_READ.add(int(self.name.split(".")[2]))
    return out


st.SafetensorsTensor.__getitem__ = _counting_getitem


def one_run(model: str, req: dict, run: dict) -> tuple[dict, LLM | None]:
    BYTES_READ[0] = 0
    LAYERS_READ.clear()
    rank = jax.process_index()
    tp = run.get("rank1_tp", run["tp"]) if rank == 1 else run["tp"]
    try:
        llm = LLM(model, tensor_parallel_size=tp, data_parallel_size=run["dp"], pipeline_parallel_size=run.get("pp", 1),
                  progress=False)
    except ValueError as e:
        return {"error": str(e), "bytes_read": BYTES_READ[0]}, None
    loaded = BYTES_READ[0]
    if is_driver():
        prompts, params = req["prompts"], SamplingParams(max_tokens=req["max_tokens"], temperature=0.0)
    else:                                        # ignored: process 0's request is broadcast
        prompts, params = [[1, 2]], SamplingParams(max_tokens=1, temperature=0.9)
    outs = llm.generate(prompts, params)
    result = {"tokens": [o.outputs[0].token_ids for o in outs], "bytes_read": loaded, "layers_read": sorted(LAYERS_READ)}
    if req.get("logits"):
        ids = req["logits"] if is_driver() else [[0]]
        result["logits"] = llm.get_logits(ids).tolist()
    return result, llm


def main() -> None:
    model, req = sys.argv[1], json.loads(sys.argv[2])
    for i, run in enumerate(req["runs"]):
        result, llm = one_run(model, req, run)
        print("RESULT " + json.dumps({"rank": jax.process_index(), "run": i, **result}), flush=True)
    print(f"READY {os.getpid()}", flush=True)
    while req.get("loop"):                       # mid-run, until the test kills a rank
        llm.generate(req["prompts"] if is_driver() else [[1]], SamplingParams(max_tokens=req["max_tokens"]))


if __name__ == "__main__":
    main()
