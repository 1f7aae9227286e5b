"""Structured outputs in the engine: the device bitmask against llguidance's numpy reference, grammars
that never refuse valid JSON (hypothesis-jsonschema instances), and generation on a tiny random Llama
with SmolLM2's tokenizer, whose outputs are garbage unless constrained: for random JSON schemas every
output validates (jsonschema), whole, streamed, greedy and sampled; regex / choice / grammar outputs
match; unconstrained rows keep their solo tokens; n > 1, preemption, prefix caching, stop strings and
(dp, pp, tp) meshes."""

import json
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tp_jax.serving.llm import LLM
from tp_jax.serving.sampling import SamplingParams
from tp_jax.serving.structured import GrammarCompiler, StructuredOutputsParams, apply_bitmask

VOCAB = 49152
SETTINGS = settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


# --- random JSON schemas whose languages are finite (every output must end) -------------------------
_names = st.text("abcdefghij_", min_size=1, max_size=6)
_leaf = st.one_of(
    st.builds(lambda lo, w: {"type": "integer", "minimum": lo, "maximum": lo + w},
              st.integers(-1000, 1000), st.integers(0, 5000)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.builds(lambda n: {"type": "string", "pattern": f"^[a-z]{{1,{n}}}$"}, st.integers(1, 6)),
    st.lists(st.one_of(st.text("xyz ", max_size=4), st.integers(-9, 9), st.booleans()), min_size=1, max_size=4,
             unique=True).map(lambda v: {"enum": v}),
    st.just({"type": "boolean"}), st.just({"type": "null"}),
)


def _array(items):
    return st.builds(lambda it, lo, w: {"type": "array", "items": it, "minItems": lo, "maxItems": lo + w},
                     items, st.integers(0, 2), st.integers(0, 2))


def _object(values):
    return st.dictionaries(_names, values, min_size=1, max_size=3).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props))).map(
            lambda req: {"type": "object", "properties": props, "required": sorted(req),
                         "additionalProperties": False}))


def instances(schema) -> st.SearchStrategy:
    """Valid instances of a schema from SCHEMAS (hypothesis-jsonschema 0.23 fails on objects with
    hypothesis 6.170: its `many(...).more()` is gone)."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    t = schema["type"]
    if t == "integer":
        return st.integers(schema["minimum"], schema["maximum"])
    if t == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(st.characters(max_codepoint=0xFFFF, exclude_categories=["Cs"]), max_size=schema["maxLength"])
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    if t == "array":
        return st.lists(instances(schema["items"]), min_size=schema["minItems"], max_size=schema["maxItems"])
    props, req = schema["properties"], set(schema["required"])
    return st.fixed_dictionaries({k: instances(v) for k, v in props.items() if k in req},
                                 optional={k: instances(v) for k, v in props.items() if k not in req})


def in_schema_order(value, schema):
    if isinstance(value, list):
        return [in_schema_order(v, schema["items"]) for v in value]
    if isinstance(value, dict):
        return {k: in_schema_order(value[k], s) for k, s in schema["properties"].items() if k in value}
    return value


SCHEMAS = st.recursive(_leaf, lambda inner: st.one_of(_array(inner), _object(inner)), max_leaves=6).filter(
    lambda s: s.get("type") in ("object", "array")) | _object(_leaf)


# --- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(tiny_path, max_model_len=256, max_num_seqs=16, progress=False)


@pytest.fixture(scope="module")
def compiler(llm):
    return GrammarCompiler(llm.get_tokenizer(), VOCAB, llm.eos_token_ids())


def constrained(schema=None, **kw):
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True) if schema is not None else \
        StructuredOutputsParams(**kw)


# --- the mask and the matcher -----------------------------------------------------------------------
def test_apply_bitmask_equals_llguidance_numpy_reference():
    from llguidance.numpy import apply_token_bitmask_inplace
    rng = np.random.default_rng(0)
    for v in (32, 1000, 1001):
        logits = rng.standard_normal((5, v)).astype(np.float32)
        mask = rng.integers(-2**31, 2**31, size=(5, (v + 31) // 32), dtype=np.int64).astype(np.int32)
        mask[0] = -1                                                   # an unconstrained row: unchanged
        ref = logits.copy()
        apply_token_bitmask_inplace(ref, mask)
        got = np.asarray(apply_bitmask(logits.reshape(1, 5, v), mask.reshape(1, 5, -1)))[0]
        np.testing.assert_array_equal(got, ref)
        np.testing.assert_array_equal(got[0], logits[0])


@given(st.data())
@settings(SETTINGS, max_examples=25)
def test_grammar_accepts_every_valid_instance(compiler, data):
    """Completeness: any instance of the schema, tokenized, is accepted token by token and leaves the
    grammar accepting; the constraint never cuts off a valid answer. (llguidance emits an object's
    properties in the schema's order, so the instance is written in that order.)"""
    schema = data.draw(SCHEMAS)
    value = data.draw(instances(schema))
    jsonschema.validate(value, schema)                             # the instance strategy is right
    text = json.dumps(in_schema_order(value, schema), separators=(",", ":"), ensure_ascii=False)
    m = compiler.matcher(constrained(schema))
    ids = compiler.tokenizer.encode(text, add_special_tokens=False)
    assert all(m.consume(t) for t in ids), (schema, text, m.error())
    assert m.accepting, (schema, text)


def test_bad_inputs_are_refused_naming_the_problem(llm):
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(ValueError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
    for so, msg in [(dict(json={"type": "objectx"}), "Invalid type"), (dict(regex="a(b"), "unclosed group"),
                    (dict(json="{not json"), "not valid JSON"), (dict(grammar="start: foo"), "foo")]:
        with pytest.raises(ValueError, match=rf"(?s)prompt 0: structured outputs: .*{msg}"):
            llm.generate(["Hi"], SamplingParams(structured_outputs=StructuredOutputsParams(**so)))
    assert not llm.engine.has_unfinished()


# --- generation -----------------------------------------------------------------------------------
def _check_all(schemas, outs):
    for schema, o in zip(schemas, outs):
        for c in o.outputs:
            assert c.finish_reason == "stop", (schema, c.text)
            jsonschema.validate(json.loads(c.text), schema)


@given(st.lists(SCHEMAS, min_size=4, max_size=4), st.booleans(), st.integers(0, 2**31))
@settings(SETTINGS, max_examples=6)
def test_every_output_validates_whole_and_streamed(llm, schemas, greedy, seed):
    """Random schemas, greedy or sampled (seeded): every output validates, whole and streamed."""
    params = [SamplingParams(max_tokens=200, temperature=0.0 if greedy else 1.0, seed=seed + i,
                             structured_outputs=constrained(s)) for i, s in enumerate(schemas)]
    prompts = [f"Answer {i}:" for i in range(len(schemas))]
    outs = llm.generate(prompts, params)
    _check_all(schemas, outs)
    texts = [""] * len(schemas)
    for ev in llm.generate_stream(prompts, params):
        texts[ev.index] += ev.text
    assert texts == [o.outputs[0].text for o in outs]            # seeded or greedy: the same outputs


def test_unseeded_samples_validate_and_n_samples_each_have_a_matcher(llm):
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1,
              "maxItems": 4}
    out = llm.generate("Numbers:", SamplingParams(n=6, max_tokens=64, structured_outputs=constrained(schema)))[0]
    _check_all([schema], [out])
    assert len({c.text for c in out.outputs}) > 1                 # independent samples, each constrained


def test_regex_choice_grammar_and_json_object(llm):
    sampled = dict(max_tokens=40, temperature=1.0)
    cases = [(dict(regex=r"[a-c]{2,5}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-c]{2,5}-[0-9]{2}", t)),
             (dict(choice=["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
             (dict(grammar='start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'),
              lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
             (dict(grammar='root ::= "ab" [0-9]'), lambda t: re.fullmatch(r"ab[0-9]", t))]       # GBNF
    for so, ok in cases:
        outs = llm.generate([f"Q{i}" for i in range(4)],
                            SamplingParams(**sampled, structured_outputs=StructuredOutputsParams(**so)))
        for o in outs:
            c = o.outputs[0]
            assert c.finish_reason == "stop" and ok(c.text), (so, c.text)


def test_json_object_takes_any_object_and_nothing_else(compiler):
    """(Sampled from a random model, an object's strings run on to max_tokens, so this checks the grammar.)"""
    tok = compiler.tokenizer
    for text, ok in [('{"a": [1, {"b": null}], "c": "x"}', True), ("[1]", False), ('{"a": }', False)]:
        m = compiler.matcher(StructuredOutputsParams(json_object=True))
        ids = tok.encode(text, add_special_tokens=False)
        assert (all(m.consume(t) for t in ids) and m.accepting) == ok, text


def test_greedy_constrained_token_is_the_argmax_over_allowed_tokens(llm, compiler):
    """Each greedy constrained token == numpy argmax of the full forward's logits over the tokens the
    grammar allows at that point (an independent matcher replays the output)."""
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 5}}, "required": ["k"],
              "additionalProperties": False}
    prompt = llm.get_tokenizer().encode("Give JSON:")
    toks = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0,
                                                 structured_outputs=constrained(schema)))[0].outputs[0].token_ids
    logits = llm.get_logits([prompt + toks[:-1]])[0, len(prompt) - 1:]
    m = compiler.matcher(constrained(schema))
    row = np.zeros((VOCAB + 31) // 32, np.int32)
    for i, t in enumerate(toks):
        m.fill(row)
        allowed = np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB].astype(bool)
        assert int(np.argmax(np.where(allowed, logits[i], -np.inf))) == t, i
        assert m.consume(t)
    assert m.done and json.loads(llm.get_tokenizer().decode(toks))["k"] is not None


def test_unconstrained_request_keeps_its_solo_tokens(llm):
    plain = SamplingParams(max_tokens=24, temperature=0.8, seed=5)
    solo = llm.generate("Once upon a time", plain)[0].outputs[0].token_ids
    schemas = [{"type": "array", "items": {"type": "boolean"}, "maxItems": 3}] * 3
    outs = llm.generate(["Once upon a time", "A", "B", "C"],
                        [plain] + [SamplingParams(max_tokens=40, structured_outputs=constrained(s)) for s in schemas])
    assert outs[0].outputs[0].token_ids == solo
    _check_all(schemas, outs[1:])


def test_stop_strings_and_prefix_cache_with_constraints(llm):
    so = constrained(regex=r"(ab|cd){1,30}")
    p = SamplingParams(max_tokens=60, temperature=1.0, seed=3, stop=["cd"], structured_outputs=so)
    prompt = "Repeat after me: " * 4                               # several blocks: the second run hits the cache
    first, again = (llm.generate(prompt, p)[0] for _ in range(2))
    assert again.num_cached_tokens > 0 and again.outputs[0].text == first.outputs[0].text
    c = first.outputs[0]
    assert re.fullmatch(r"(ab)*", c.text) and (c.stop_reason == "cd" or c.finish_reason == "stop")


@pytest.mark.slow
def test_preempted_requests_resume_their_grammar(tiny_path):
    """A pool too small for all requests preempts some; their outputs equal a roomy run's, token for token."""
    schema = {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 3, "maxItems": 6}
    params = SamplingParams(max_tokens=56, temperature=1.0, seed=11, structured_outputs=constrained(schema))
    prompts = [f"List {i}:" for i in range(6)]
    tight = LLM(tiny_path, max_model_len=64, num_gpu_blocks=9, block_size=8, max_num_seqs=6, progress=False)
    outs = tight.generate(prompts, params)
    assert tight.engine.core.stats["preemptions"] > 0
    _check_all([schema] * 6, outs)
    roomy = LLM(tiny_path, max_model_len=64, max_num_seqs=6, progress=False)
    assert [o.outputs[0].token_ids for o in roomy.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("dp,pp,tp", [(2, 1, 2), (1, 2, 2), (2, 2, 2)], ids=lambda v: str(v))
def test_meshes_give_the_single_device_outputs(llm, tiny_path, dp, pp, tp):
    schemas = [{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 50},
                                                 "s": {"type": "string", "maxLength": 3}},
                "required": ["n", "s"], "additionalProperties": False}] * 3
    params = [SamplingParams(max_tokens=40, temperature=t, seed=2, structured_outputs=constrained(s))
              for t, s in zip((0.0, 1.0, 1.0), schemas)]
    prompts = ["One", "Two", "Three"]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    sharded = LLM(tiny_path, tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                  max_model_len=256, max_num_seqs=8, progress=False)
    outs = sharded.generate(prompts, params)
    _check_all(schemas, outs)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_a_step_plan_carries_its_bitmask_to_other_processes(llm):
    """Many hosts: the driver broadcasts the plan as bytes; the bitmask survives the trip (and its absence)."""
    from tp_jax.serving.batch import StepBatch
    from tp_jax.serving.plan import StepPlan
    core = llm.engine.core
    plan = core._plan(StepBatch.empty(core.warmup_shapes()[0]))
    assert plan.bitmask is None and StepPlan.from_bytes(plan.to_bytes()).bitmask is None
    g, r = plan.floats.shape[:2]
    plan.bitmask = np.random.default_rng(1).integers(-2**31, 2**31, (g, r, VOCAB // 32)).astype(np.int32)
    back = StepPlan.from_bytes(plan.to_bytes())
    np.testing.assert_array_equal(back.bitmask, plan.bitmask)
    np.testing.assert_array_equal(back.floats, plan.floats)


def test_a_matcher_in_error_ends_only_its_request(llm):
    """A grammar that refuses a token (its matcher in error) ends that request with "abort"; the engine and
    the other requests go on."""
    engine, tok = llm.engine, llm.get_tokenizer()
    so = StructuredOutputsParams(choice=["ab", "cd"])
    engine.add_request("broken", "Hi", SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=so))
    engine.add_request("fine", "Hi", SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=so))
    broken = next(r for rid, r in engine.core.requests.items() if rid.startswith("broken#"))
    assert not broken.matcher.consume(tok.encode("zzz", add_special_tokens=False)[0])   # now in error
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    assert done["broken"].finish_reason == "abort"
    assert done["fine"].finish_reason == "stop" and done["fine"].text in ("ab", "cd")
