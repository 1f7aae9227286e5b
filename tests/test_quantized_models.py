"""Quantized tiny Llamas end to end: int8 (from float safetensors) and GGUF blocks (Q8_0 / Q4_0 / Q4_1 kept),
against transformers run on the dequantized weights, at tp in {1, 2, 3, 4, 8} and pp = 2.

A quantized model must match transformers on *its* weights (Q * s, or the blocks
dequantized by the `gguf` package) far closer than it matches the float model, give the
same logits and greedy tokens at every tp, keep the collectives of the float model, and
never dequantize a whole tensor while loading.
"""

import warnings

import gguf
import jax
import numpy as np
import pytest

from tests.hlo import count, loop_bodies
from tests.quant_models import dequantized_copy, int8_dequantized, write_tiny_gguf
from tests.tiny_models import hf_logits, make_checkpoint
from tp_jax.loaders.model import param_bytes_per_device
from tp_jax.parallel.layers import QuantizationError
from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams

LAYOUTS = [(1, 1, 1), (2, 1, 1), (3, 2, 1), (4, 1, 1), (8, 1, 1), (2, 1, 2)]       # (tp, dp, pp)
GREEDY_LAYOUTS = [(1, 1, 1), (3, 2, 1), (2, 1, 2)]                                # engine runs cost more
INT8_VARIANTS = ["h9kv3", "tied", "bias"]        # padded heads + vocab 1001; one tied table; biases stay float
PROMPTS = [[5, 17, 300, 42], [7, 7, 900], [1, 2, 3, 4, 5, 6]]
CLOSER = 50              # quantized vs its reference must be this much closer than vs the float model


def lid(layout):
    return "tp{}dp{}pp{}".format(*layout)


def load(path, layout, **kw):
    tp, dp, pp = layout
    return LLM(path, tensor_parallel_size=tp, data_parallel_size=dp, pipeline_parallel_size=pp, progress=False, **kw)


def perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    """exp(mean NLL of ids[:, 1:] under logits[:, :-1])."""
    x = logits[:, :-1].astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(np.exp(-np.take_along_axis(logp, ids[:, 1:, None], -1).mean()))


def greedy(llm, n: int = 10) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for s, t in zip(a, b) for x, y in zip(s, t)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("quantized"))


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, 1000, size=(3, 13))


@pytest.fixture(scope="module")
def int8_refs(root, ids):
    """variant -> (float checkpoint, transformers' logits on the float weights, on int8's Q * s)."""
    out = {}
    for name in INT8_VARIANTS:
        path = make_checkpoint(name, root)
        ref_dir = dequantized_copy(path, f"{path}_int8", lambda _, w: int8_dequantized(w))
        out[name] = path, hf_logits(path, ids), hf_logits(ref_dir, ids)
    return out


@pytest.fixture(scope="module")
def tiny_gguf(root, ids):
    """(the Q8_0/Q4_0/Q4_1 file, the float checkpoint it was made from, transformers' logits on the float
    weights, on the dequantized blocks)."""
    path, float_dir, deq_dir = write_tiny_gguf(root)
    return path, float_dir, hf_logits(float_dir, ids), hf_logits(deq_dir, ids)


def check_against(got, ref_float, ref_quant, what):
    err, gap = float(np.abs(got - ref_quant).max()), float(np.abs(ref_float - ref_quant).max())
    assert err <= 1e-4 and err * CLOSER < gap, f"{what}: max |logits - reference| {err:.2e}, float gap {gap:.2e}"
    np.testing.assert_array_equal(got.argmax(-1), ref_quant.argmax(-1), err_msg=what)
    return err


# --- int8 -------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", INT8_VARIANTS)
def test_int8_matches_transformers_on_its_weights_at_every_layout(int8_refs, ids, variant):
    path, ref_float, ref_int8 = int8_refs[variant]
    first = None
    for layout in LAYOUTS:
        llm = load(path, layout, quantization="int8")
        assert llm.quantization == "int8"
        got = llm.get_logits(ids)
        check_against(got, ref_float, ref_int8, f"{variant} {lid(layout)}")
        first = got if first is None else first
        np.testing.assert_allclose(got, first, rtol=0, atol=2e-6, err_msg=f"{variant} {lid(layout)} vs tp=1")


def test_int8_perplexity_greedy_and_bytes(int8_refs, ids):
    """Reported: perplexity vs float32 (within 2%), greedy agreement with float32, bytes per device (<= 0.3x);
    greedy tokens identical at every layout."""
    path, ref_float, _ = int8_refs["h9kv3"]
    ppl_float = perplexity(ref_float, ids)
    tokens = None
    for layout in GREEDY_LAYOUTS:
        fp, q = load(path, layout, quantization=None), load(path, layout, quantization="int8")
        ppl, ratio = perplexity(q.get_logits(ids), ids), param_bytes_per_device(q.model, q.mesh) / \
            param_bytes_per_device(fp.model, fp.mesh)
        float_tokens, tokens_here = greedy(fp), greedy(q)
        print(f"int8 tiny {lid(layout)}: perplexity {ppl:.3f} vs float32 {ppl_float:.3f} "
              f"({100 * (ppl / ppl_float - 1):+.2f}%), greedy agreement {agreement(tokens_here, float_tokens):.2f}, "
              f"bytes per device {ratio:.3f}x float32")
        assert abs(ppl / ppl_float - 1) <= 0.02 and ratio <= 0.3
        tokens = tokens_here if tokens is None else tokens
        assert tokens_here == tokens, f"{lid(layout)}: greedy tokens differ from tp=1"


# --- GGUF blocks ------------------------------------------------------------------------

def test_gguf_blocks_match_transformers_on_dequantized_weights_at_every_layout(tiny_gguf, ids):
    path, _, ref_float, ref_deq = tiny_gguf
    first, tokens = None, None
    for layout in LAYOUTS:
        llm = load(path, layout, quantization="gguf")             # the blocks kept, float32 dots (the fast
                                                                  # dots, auto's on CPU: tests/test_fast_dots.py)
        assert llm.quantization == "gguf Q4_0, gguf Q4_1, gguf Q8_0"
        got = llm.get_logits(ids)
        check_against(got, ref_float, ref_deq, f"gguf {lid(layout)}")
        first = got if first is None else first
        np.testing.assert_allclose(got, first, rtol=0, atol=2e-6, err_msg=f"gguf {lid(layout)} vs tp=1")
        if layout in GREEDY_LAYOUTS:
            here = greedy(llm)
            tokens = here if tokens is None else tokens
            assert here == tokens, f"gguf {lid(layout)}: greedy tokens differ from tp=1"


def test_gguf_dequantized_path_perplexity_and_bytes(tiny_gguf, ids):
    """quantization=None (and "none") dequantizes as before: the same logits as the kept blocks, 5x the bytes."""
    path, float_dir, ref_float, ref_deq = tiny_gguf
    kept, fp = load(path, (2, 1, 1), quantization="gguf"), load(path, (2, 1, 1), quantization=None)
    assert fp.quantization == "none" and load(path, (1, 1, 1), quantization="none").quantization == "none"
    np.testing.assert_allclose(fp.get_logits(ids), ref_deq, rtol=0, atol=1e-5)
    ppl_kept, ppl_float = perplexity(kept.get_logits(ids), ids), perplexity(ref_float, ids)
    ratio = param_bytes_per_device(kept.model, kept.mesh) / param_bytes_per_device(fp.model, fp.mesh)
    tokens_kept, tokens_float = greedy(kept), greedy(load(float_dir, (2, 1, 1)))
    print(f"gguf tiny (Q4_1 linears, Q8_0 embedding/down, Q4_0 head) tp=2: perplexity {ppl_kept:.3f} vs float32 "
          f"{ppl_float:.3f} ({100 * (ppl_kept / ppl_float - 1):+.2f}%), greedy agreement with float32 "
          f"{agreement(tokens_kept, tokens_float):.2f}, bytes per device {ratio:.3f}x dequantized float32")
    assert abs(ppl_kept / ppl_float - 1) <= 0.02 and ratio <= 0.3


# --- collectives, memory ------------------------------------------------------------------

@pytest.mark.parametrize("quantization", ["int8", "gguf"])
def test_hlo_all_reduces_per_layer_unchanged(int8_refs, tiny_gguf, quantization):
    path = int8_refs["h9kv3"][0] if quantization == "int8" else tiny_gguf[0]
    llm = load(path, (2, 1, 1), quantization=quantization)
    ids = np.zeros((1, 8), np.int32)
    pos = np.broadcast_to(np.arange(8, dtype=np.int32), ids.shape)
    fn = llm._logits_fn()
    hlo = jax.jit(lambda i, p: fn(i, p)).lower(ids, pos).compile().as_text()
    bodies = [b for b in loop_bodies(hlo) if count(b, "all-reduce")]
    assert len(bodies) == 1, "one scanned decoder-layer loop holds the layers' all-reduces"
    assert count(bodies[0], "all-reduce") == 2                        # o_proj and down_proj, as in float
    assert count(hlo, "all-reduce") == 3                              # + the vocab-parallel embedding
    assert count(hlo, "all-to-all") == 0


class RecordingSource:
    """A weight source that records the shape of every read."""

    def __init__(self, source):
        self.source, self.reads = source, []

    def keys(self):
        return self.source.keys()

    def __contains__(self, name):
        return name in self.source

    def get(self, name):
        return RecordingTensor(self.source.get(name), name, self.reads)


class RecordingTensor:
    def __init__(self, tensor, name, reads):
        self.tensor, self.name, self.reads, self.shape = tensor, name, reads, tuple(tensor.shape)

    def __getitem__(self, index):
        out = np.asarray(self.tensor[index])
        self.reads.append((self.name, out.shape))
        return out


def test_int8_load_reads_float_rows_in_chunks_never_a_whole_tensor(int8_refs, monkeypatch):
    from tp_jax.loaders.model import load_from_source
    from tp_jax.loaders.sources import open_checkpoint
    from tp_jax.parallel.layers import int8
    from tp_jax.parallel.mesh import make_mesh
    monkeypatch.setattr(int8, "CHUNK_BYTES", 4 * 64 * 16)           # 16 rows of 64 float32 at a time
    ckpt = open_checkpoint(int8_refs["bias"][0])
    source = RecordingSource(ckpt.source)
    load_from_source(ckpt.config, source, make_mesh(tp=2, devices=jax.devices()[:2]), progress=False,
                     quantization="int8")
    big = [(n, s) for n, s in source.reads if len(s) == 2]
    assert big and max(s[0] for _, s in big) <= 16, sorted(set(s for _, s in big))[-3:]


def test_gguf_kept_load_dequantizes_nothing(tiny_gguf, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a tensor was dequantized at load")
    from tp_jax.loaders import gguf as gguf_loader
    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    monkeypatch.setattr(gguf_loader, "dequantize_raw", refuse)          # the float path's Q8_0 / Q4_* pass
    assert load(tiny_gguf[0], (2, 1, 1), quantization="gguf_bf16").quantization.startswith("gguf Q4_0")
    assert load(tiny_gguf[0], (2, 1, 1), quantization="gguf").quantization == "gguf Q4_0, gguf Q4_1, gguf Q8_0"
    with pytest.raises(AssertionError, match="dequantized at load"):            # the float path does
        load(tiny_gguf[0], (2, 1, 1), quantization=None)


# --- bad input ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def q5_down_file(root):
    """A GGUF with Q4_0 weights but ffn_down in Q5_0 (a type not kept quantized)."""
    from tests.test_gguf import GGUF_NAMES, QT, tiny_hf_tensors, to_gguf_layout, write_gguf
    tensors = {}
    for name, w in tiny_hf_tensors().items():
        w = to_gguf_layout(name, w)
        qtype = QT.Q5_0 if "down_proj" in name else QT.Q4_0
        tensors[GGUF_NAMES[name]] = (w, None) if w.ndim == 1 else (gguf.quants.quantize(w, qtype), qtype)
    return write_gguf(f"{root}/q5_down.gguf", tensors)


def test_gguf_type_not_kept_is_named(q5_down_file):
    with pytest.raises(QuantizationError, match=r"quantization='gguf' cannot load this checkpoint \(1 param\):\n  "
                                                r"model.layers.layers.mlp.down_proj.kernel: tensor "
                                                r"'model.layers.0.mlp.down_proj.weight' has GGUF quant type Q5_0, "
                                                r"which tp_jax does not keep quantized \(kept: Q8_0, Q4_0, Q4_1\); "
                                                r"load with quantization=None"):
        LLM(q5_down_file, quantization="gguf", progress=False)


def test_auto_loads_a_type_not_kept_as_float_with_a_warning(q5_down_file):
    """"auto" keeps a GGUF's blocks (gguf_bf16 on CPU); a Q5_0 layer, a type not kept, loads as float with one
    warning naming it (a named quantization="gguf" refuses it: above)."""
    with pytest.warns(UserWarning, match=r"quantization='gguf_bf16' \(auto\): 1 param loaded dequantized to float "
                                         r"instead of kept quantized:\n  model.layers.layers.mlp.down_proj.kernel: "
                                         r".* Q5_0"):
        auto = LLM(q5_down_file, progress=False)
    expected = "gguf Q4_0 (bf16 dot)" if jax.default_backend() == "cpu" else "gguf Q4_0"
    assert auto.quantization == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp = LLM(q5_down_file, quantization=None, progress=False)
    ids = np.arange(1, 9)[None] % 32
    got, want = auto.get_logits(ids), fp.get_logits(ids)
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()      # the bf16 dot's bound (tests/test_fast_dots.py)


def test_gguf_on_a_float_checkpoint_is_refused(int8_refs):
    with pytest.raises(QuantizationError, match=r"keeps the blocks of a .gguf file's tensors; "
                                                r"'model.embed_tokens.weight' is not a GGUF tensor \(use "
                                                r"quantization='int8', or None\)"):
        LLM(int8_refs["tied"][0], quantization="gguf", progress=False)


@pytest.mark.parametrize("value,error,message", [
    ("int4", ValueError, "quantization='int4' is not a quantization method; choose one of 'auto', 'none', 'awq', "
                         "'awq_bf16', 'bf16', 'compressed-tensors', 'compressed-tensors_bf16', 'fp8', 'fp8_bf16', "
                         "'gguf', 'gguf_bf16', 'gptq', 'gptq_bf16', 'int8', 'mxfp4', 'mxfp4_bf16', 'w8a8', 'w8a8x2', 'w8a8x2_bf16', or None "
                         "(every weight in float)"),
    (8, TypeError, "quantization=8 must be a string, one of 'auto', 'none', 'awq', 'awq_bf16', 'bf16', "
                   "'compressed-tensors', 'compressed-tensors_bf16', 'fp8', 'fp8_bf16', 'gguf', 'gguf_bf16', 'gptq', "
                   "'gptq_bf16', 'int8', 'mxfp4', 'mxfp4_bf16', 'w8a8', 'w8a8x2', 'w8a8x2_bf16' or None, got int"),
])
def test_unknown_quantization_argument_fails_before_the_load(value, error, message):
    with pytest.raises(error) as e:
        LLM("/nonexistent/model/dir", quantization=value)
    assert message in str(e.value)


@pytest.mark.parametrize("quantization", ["int8", "w8a8x2", "w8a8x2_bf16", "gguf", "gguf_bf16"])
def test_switched_layers_hold_the_same_quantized_weights(int8_refs, tiny_gguf, ids, quantization):
    """LLM(layer_loop="switch") splits every param of the stack per layer slot, the methods' params too, looped
    with switched GEMMs (w8a8x2: the activation digits made once before the switch, `SplitGemm.prepare`, the
    scales applied once after it, `finish`): the scanned stack's numbers bit for bit, its layer body computes
    what the scan's does."""
    path = tiny_gguf[0] if quantization.startswith("gguf") else int8_refs["h9kv3"][0]
    scanned = load(path, (2, 1, 2), quantization=quantization, layer_loop="scan")
    switched = load(path, (2, 1, 2), quantization=quantization, layer_loop="switch")
    assert switched.quantization == scanned.quantization != "none"
    np.testing.assert_allclose(switched.get_logits(ids), scanned.get_logits(ids), rtol=0, atol=0)
    assert greedy(switched) == greedy(scanned)


@pytest.mark.parametrize("quantization", ["int8", "w8a8x2", "bf16", "w8a8x2_bf16", "none"])
def test_switched_branches_hold_only_the_weights_dot(int8_refs, quantization):
    """In the switched loop (one device) every branch of a GEMM's lax.switch is the dot of one slot's weight
    and nothing else: the method's work on x alone (`prepare`: the digits, the bf16 rounding) is traced before
    the switch and its scales (`finish`) after it, once per GEMM instead of once per slot (XLA:CPU compiles
    each branch apart). Weight-only int8 converts its weight to the model's dtype for the dot, in the branch."""
    from tp_jax.serving.batch import StepBatch
    llm = load(int8_refs["h9kv3"][0], (1, 1, 1), quantization=quantization, layer_loop="switch")
    runner = llm.engine.core.runner
    batch = StepBatch.empty(llm.engine.core.warmup_shapes()[0])
    traced = runner._forward.trace(runner.weights, runner.put(batch.packed()), runner.k, runner.v,
                                   shape=batch.shape)
    branches = [b.jaxpr for e in equations(traced.jaxpr.jaxpr) if e.primitive.name == "cond"
                for b in e.params["branches"]]
    assert len(branches) == 4 * 2                        # 4 GEMMs per layer, 2 layer slots
    for branch in branches:
        ops = [e.primitive.name for e in equations(branch) if e.primitive.name not in ("pjit", "jit")]
        assert ops == ["convert_element_type", "dot_general"] if quantization == "int8" else ops == ["dot_general"], ops


def equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside its equations (loop bodies, branches, jit calls)."""
    for e in jaxpr.eqns:
        yield e
        for value in e.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from equations(sub)


def test_int8_gpt2_conv1d_weights_stored_in_out(tmp_path):
    """GPT-2 stores Conv1D weights [in, out] (q|k|v fused): int8 scales are still per output channel, the
    learned positions (a ReplicatedEmbedding, no linear method) stay float."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from tests.test_gpt2 import CONFIG
    from tests.tiny_models import randomize
    torch.manual_seed(6)
    path = str(tmp_path / "gpt2")
    randomize(GPT2LMHeadModel(GPT2Config(**CONFIG)).eval()).save_pretrained(path)

    def reference_weight(name, w):
        if "wpe" in name:
            return w
        conv1d = name.endswith(("attn.c_attn.weight", "c_proj.weight", "mlp.c_fc.weight"))
        return int8_dequantized(w.T).T if conv1d else int8_dequantized(w)
    ref_dir = dequantized_copy(path, str(tmp_path / "gpt2_int8"), reference_weight)
    ids = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], size=(3, 13))
    ref_float, ref_int8 = hf_logits(path, ids), hf_logits(ref_dir, ids)
    for tp, pp in [(1, 1), (4, 1), (2, 2)]:
        llm = load(path, (tp, 1, pp), quantization="int8")
        check_against(llm.get_logits(ids), ref_float, ref_int8, f"gpt2 int8 tp={tp} pp={pp}")
