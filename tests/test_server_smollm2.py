"""The server with the real SmolLM2-135M-Instruct (the embedded default: no MODEL argument) at tp = 2 on
2 simulated devices (9 query / 3 KV heads: padded heads), against `LLM.chat` / `LLM.generate` in this
process; and the README's five-line `openai` example, run as written against it."""

import os
import re
import subprocess
import sys

import pytest
from openai import OpenAI

from tests.server_process import ROOT, ServerProcess
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

# its server subprocess mostly runs the real model: LLVM -O1 (tests/conftest.py), measured 58 s at the suite's -O0
# and 32 s at -O1 for this file
pytestmark = [pytest.mark.slow, pytest.mark.llvm_level(1)]
NAME = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    args = ["--tp", "2", "--simulate-devices", "2", "--max-model-len", "512", "--max-num-seqs", "8"]
    with ServerProcess(args, str(tmp_path_factory.mktemp("smollm2_server")), name="smollm2") as srv:
        yield srv.wait_ready()


@pytest.fixture(scope="module")
def ref(smollm2_path):
    return LLM(None, tensor_parallel_size=2, max_model_len=512, max_num_seqs=8, progress=False)


def readme_example(index: int = 0) -> str:
    """The serve section's python blocks: the chat client, the Responses call, the LangChain agent loop."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("## Serve it (OpenAI-compatible)", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)[index]


def run_against(server, code: str) -> str:
    assert 'base_url="http://127.0.0.1:8000/v1"' in code
    r = subprocess.run([sys.executable, "-c", code.replace("http://127.0.0.1:8000/v1", server.base)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_chat_and_completions_equal_the_engine(server, ref):
    client = OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=600)
    assert [m.id for m in client.models.list().data] == [NAME]
    exp = ref.chat(QUESTION, SamplingParams(max_tokens=24, temperature=0.0))[0].outputs[0].text
    assert "Paris" in exp
    whole = client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == exp
    stream = client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=24, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == exp
    story = ref.generate("Once upon a time", SamplingParams(max_tokens=20, temperature=0.0))[0].outputs[0]
    got = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=20, temperature=0)
    assert got.choices[0].text == story.text and got.usage.completion_tokens == len(story.token_ids)


def test_readme_client_example_runs_as_written(server, ref):
    code = readme_example()
    assert len(code.strip().splitlines()) == 5, "the README promises a five-line example"
    exp = ref.chat(QUESTION, SamplingParams(max_tokens=32, temperature=0.0))[0].outputs[0].text
    assert run_against(server, code) == exp + "\n"


def test_readme_responses_example_is_the_chat_of_its_instructions_and_input(server, ref):
    conv = [{"role": "system", "content": "Answer in a few words."}, *QUESTION]
    exp = ref.chat(conv, SamplingParams(max_tokens=32, temperature=0.0))[0].outputs[0].text
    assert run_against(server, readme_example(1)) == exp + "\n"


def test_readme_langchain_agent_loop_calls_the_tool_and_answers(server):
    """SmolLM2 (135M) makes the forced call with the right arguments; what it answers after the tool's result
    is its own (it repeats the result): the loop must end with text."""
    code = readme_example(2).replace("print(reply.content)", "print(messages[1].tool_calls)\nprint(reply.content)")
    out = run_against(server, code)
    first, answer = out.split("\n", 1)
    assert "'name': 'add', 'args': {'a': 2, 'b': 3}" in first
    assert answer.strip()
