"""`LLM(...)` checks its arguments' types and ranges before any device work or load."""

import numpy as np
import pytest

from tp_jax.serving.args import validate_llm_args
from tp_jax.serving.llm import LLM

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
    (dict(dtype=np.float32), TypeError, "must be a string: 'auto', 'float32', 'bfloat16' or 'float16'"),
    (dict(progress="yes"), TypeError, "progress='yes' must be True or False, got str"),
    (dict(layer_loop=True), TypeError, "layer_loop=True must be one of 'auto', 'scan', 'switch', 'unrolled', "
     "got bool"),
    (dict(layer_loop="scanned"), ValueError, "layer_loop='scanned' is not a layer loop; choose one of 'auto', "
     "'scan', 'switch', 'unrolled'"),
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
    validate_llm_args(model=None, tensor_parallel_size=np.int64(2), pipeline_parallel_size=1, data_parallel_size=1,
                      dtype="auto", max_model_len=None, max_num_seqs=np.int32(4), num_microbatches=None, seed=-5,
                      progress=False, devices=None, self=object())       # unknown names are ignored
    with pytest.raises(FileNotFoundError):                             # past the checks: the load itself
        LLM(NO_SUCH_MODEL, tensor_parallel_size=1, max_num_seqs=1)
