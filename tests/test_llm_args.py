"""`LLM(...)` checks its arguments' types and ranges (EngineArgs) before any device work or load; the flags, LLM's
signature and the docs' table all come from EngineArgs and cannot drift from it."""

import dataclasses
import inspect
import os

import numpy as np
import pytest

from tp_jax.serving import engine_args
from tp_jax.serving.engine_args import EngineArgs
from tp_jax.serving.llm import LLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NO_SUCH_MODEL = "/nonexistent/model/dir"          # reached only if the arguments pass


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(tensor_parallel_size=2.0), TypeError,
     "tensor_parallel_size=2.0 must be an int >= 1 (devices that split each layer), got float; "
     "pass tensor_parallel_size=2"),
    (dict(tensor_parallel_size="2"), TypeError, "tensor_parallel_size='2' must be an int >= 1 (devices that "
     "split each layer), got str; pass tensor_parallel_size=2"),
    (dict(tensor_parallel_size=True), TypeError, "tensor_parallel_size=True must be an int >= 1"),
    (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size=0 must be >= 1 (devices that split each layer)"),
    (dict(pipeline_parallel_size=-1), ValueError, "pipeline_parallel_size=-1 must be >= 1 (stages"),
    (dict(data_parallel_size=1.5), TypeError, "data_parallel_size=1.5 must be an int >= 1 (model replicas), "
     "got float"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs=0 must be >= 1 (the most sequences generated "
     "together)"),
    (dict(max_num_seqs=-3), ValueError, "max_num_seqs=-3 must be >= 1"),
    (dict(max_model_len=0), ValueError, "max_model_len=0 must be >= 1 (tokens per sequence, prompt included; None: the model's limit"),
    (dict(max_model_len="512"), TypeError, "max_model_len='512' must be None or an int >= 1"),
    (dict(num_microbatches=0), ValueError, "num_microbatches=0 must be >= 1 (pipeline micro-batches; None: pipeline_parallel_size)"),
    (dict(seed=1.0), TypeError, "seed=1.0 must be an int, got float; pass seed=1"),
    (dict(seed=None), TypeError, "seed=None must be an int, got NoneType"),
    (dict(dtype=np.float32), TypeError, "must be a string, one of 'auto', 'float32', 'bfloat16', 'float16'"),
    (dict(progress="yes"), TypeError, "progress='yes' must be True or False, got str"),
    (dict(layer_loop=True), TypeError, "layer_loop=True must be a string, one of 'auto', 'scan', 'switch', "
     "got bool"),
    (dict(layer_loop="unrolled"), ValueError, "layer_loop='unrolled' is not a layer loop; choose one of 'auto', "
     "'scan', 'switch'"),
    (dict(attention_backend="split"), ValueError, "attention_backend='split' is not an attention backend; choose "
     "one of 'auto', 'reference', 'bf16'"),
    (dict(quantization="gguf_int8"), ValueError, "quantization='gguf_int8' is not a quantization method"),
    (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization=1.5 must be in (0, 1]"),
    (dict(tensor_parallel=2), TypeError, "unknown argument 'tensor_parallel'; did you mean 'tensor_parallel_size'?"),
    (dict(structured_outputs_config={"backend": "xgrammar"}), ValueError, "only 'guidance'"),
])
def test_bad_arguments_fail_before_the_load_naming_the_argument(kwargs, error, message):
    with pytest.raises(error) as e:
        LLM(NO_SUCH_MODEL, **kwargs)
    assert message in str(e.value)
    assert str(e.value).startswith("LLM: ")


def test_bad_model_argument_type():
    with pytest.raises(TypeError, match=r"model=3 must be a path \(str or os.PathLike\)"):
        LLM(3)


def test_good_arguments_pass_including_numpy_integers():
    args = EngineArgs(model=None, tensor_parallel_size=np.int64(2), max_num_seqs=np.int32(4), seed=-5,
                      progress=False, quantization=None)
    assert args.quantization == "none" and args.tensor_parallel_size == 2
    with pytest.raises(FileNotFoundError):                             # past the checks: the load itself
        LLM(NO_SUCH_MODEL, tensor_parallel_size=1, max_num_seqs=1)


def test_llm_signature_is_engine_args():
    """LLM's keywords are EngineArgs' fields with their defaults: nothing restates the list."""
    params = inspect.signature(LLM.__init__).parameters
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    assert [p for p in params if p != "self"] == list(fields)
    for name, f in fields.items():
        assert params[name].default == engine_args.default(name)
        assert name in LLM.__doc__ and f.metadata["help"] in LLM.__doc__


def test_every_command_line_field_is_a_flag_of_serve_and_generate_with_its_default():
    from tp_jax.server.cli import build_parser
    for command in ("serve", "generate"):
        ns = build_parser().parse_args([command])
        for f in dataclasses.fields(EngineArgs):
            if f.metadata["cli"]:
                assert getattr(ns, f.name) == engine_args.default(f.name), (command, f.name)
        assert engine_args.from_cli(ns) == EngineArgs()
    ns = build_parser().parse_args(["generate", "--tp", "2", "--structured-outputs-config",
                                    '{"disable_any_whitespace": true}', "--no-enable-prefix-caching", "-q", "none"])
    args = engine_args.from_cli(ns)
    assert (args.tensor_parallel_size, args.structured_outputs_config, args.enable_prefix_caching,
            args.quantization) == (2, {"disable_any_whitespace": True}, False, "none")


def test_help_shows_the_defaults():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "tp_jax.server.cli", "generate", "--help"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "200"}).stdout
    assert "--max-num-seqs MAX_NUM_SEQS" in out and "(default: 256)" in out and "--structured-outputs-config" in out


def test_docs_table_is_engine_args():
    """docs/serving.md's argument table is `engine_args.markdown_table()`, and design.md's rules are `RULES`."""
    from tp_jax.serving.resolve import rules_markdown
    assert engine_args.markdown_table() in open(os.path.join(ROOT, "docs", "serving.md")).read()
    assert rules_markdown() in open(os.path.join(ROOT, "docs", "design.md")).read()
