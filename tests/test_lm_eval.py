"""lm-evaluation-harness scores a served model exactly: `lm_eval` itself, `local-completions` against the
tiny server subprocess (tests/server_process.py), and its own `hf` backend on the same weights (float32)
give the same acc / acc_norm and every per-choice loglikelihood within 1e-3, on a local multiple-choice
task file (offline). lm_eval sends `echo: true, logprobs: 1` to /v1/completions and reads the prompt's
token logprobs (tp_jax/server/echo.py)."""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

QUESTIONS = [
    ("The capital of France is", ["Paris", "London", "a small village near the sea", "Rome"], 0),
    ("Water boils at", ["100 degrees Celsius", "ten", "the top of a very high mountain", "noon"], 0),
    ("The opposite of hot is", ["cold", "warm weather in the summer", "blue", "fast"], 0),
    ("Two plus two equals", ["four", "five", "a number larger than one hundred", "zero"], 0),
    ("Cats like to", ["sleep", "fly to the moon on Tuesdays", "sing", "read"], 1),
    ("The sky is", ["blue", "made of green cheese and old socks", "down", "loud"], 0),
]

TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def write_task(root: str) -> str:
    data = os.path.join(root, "tiny_mc.jsonl")
    with open(data, "w") as f:
        for q, choices, label in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": [" " + c for c in choices], "label": label}) + "\n")
    with open(os.path.join(root, "tiny_mc.yaml"), "w") as f:
        f.write(TASK.format(data=data))
    return root


def run_lm_eval(model: str, model_args: str, tasks_dir: str, out: str, *extra: str) -> tuple[dict, list]:
    """`lm_eval run` in a subprocess, offline; (its metrics for tiny_mc, its per-request samples)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": os.path.join(out, "datasets"), "HF_HOME": os.path.join(out, "hf")}
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args, "--tasks", "tiny_mc",
           "--include_path", tasks_dir, "--output_path", out, "--log_samples", "--batch_size", "1", *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    results = json.load(open(max(glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True))))
    samples = [json.loads(line) for path in glob.glob(os.path.join(out, "**", "samples_tiny_mc_*.jsonl"),
                                                       recursive=True) for line in open(path)]
    return results["results"]["tiny_mc"], sorted(samples, key=lambda s: s["doc_id"])


def loglikelihoods(samples: list) -> list[list[float]]:
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


@pytest.mark.slow
def test_lm_eval_scores_the_server_as_its_hf_backend(tiny_server, tiny_path, tmp_path):
    assert importlib.util.find_spec("lm_eval"), "lm_eval is missing: install the test extra, pip install -e '.[test]'"
    tasks = write_task(str(tmp_path))
    served, served_samples = run_lm_eval(
        "local-completions", f"model=tiny,base_url={tiny_server.base}/completions,tokenizer_backend=huggingface,"
                             f"tokenizer={tiny_path},max_retries=1,num_concurrent=1", tasks, str(tmp_path / "served"))
    hf, hf_samples = run_lm_eval("hf", f"pretrained={tiny_path},dtype=float32", tasks, str(tmp_path / "hf"),
                                 "--device", "cpu")
    got, want = loglikelihoods(served_samples), loglikelihoods(hf_samples)
    assert len(got) == len(want) == len(QUESTIONS) and all(len(g) == 4 for g in got)
    worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
    print(f"lm_eval tiny_mc: served acc={served['acc,none']} acc_norm={served['acc_norm,none']}; "
          f"hf acc={hf['acc,none']} acc_norm={hf['acc_norm,none']}; max |loglikelihood diff|={worst:.2e}")
    assert worst <= 1e-3, worst
    for (_, choices, _), g in zip(QUESTIONS, want):   # in the reference the best choice, raw (acc) and per byte
        for score in (g, [x / len(" " + c) for x, c in zip(g, choices)]):     # (acc_norm), leads by more than the
            first, second = sorted(score, reverse=True)[:2]                   # tolerance: acc cannot flip within it
            assert first - second > 2e-3, score
    assert served["acc,none"] == hf["acc,none"] and served["acc_norm,none"] == hf["acc_norm,none"]
    assert [s["acc"] for s in served_samples] == [s["acc"] for s in hf_samples]
