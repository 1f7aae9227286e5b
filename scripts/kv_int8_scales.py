"""Which int8 KV scales keep SmolLM2's perplexity: per tensor and per kv head (static, calibrated) against per token
and kv head (dynamic: what `kv_cache_dtype="int8"` ships), one JSON line.

    python scripts/kv_int8_scales.py

Perplexity of tests/test_smollm2.py's TEXT through the KV cache (prompt logprobs, as tests/test_kv_cache_dtype.py).
The static scales are max|x| / 127 of CALIBRATION's keys and values, read from an auto pool. They are measured by
swapping the int8 row format's quantizer (tp_jax/models/attention.py quantize_rows / dequantize_rows) for one over the
static scales, in this process only: the library keeps no static-int8 path (docs/serving.md says why).
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from tests.test_kv_cache_dtype import cache_perplexity
from tests.test_smollm2 import TEXT
from tp_jax import LLM, SamplingParams
from tp_jax.models import attention, cache
from tp_jax.serving import kv_pool

CALIBRATION = ("Photosynthesis is the process by which green plants and some other organisms use sunlight to "
               "synthesize foods from carbon dioxide and water. It generally involves the green pigment chlorophyll "
               "and generates oxygen as a byproduct. The light-dependent reactions take place in the thylakoid "
               "membranes, where energy from light is captured and used to make ATP and NADPH. ") * 2
KW = dict(progress=False, kv_cache_memory_bytes=64 * 2**20, max_model_len=512, enable_prefix_caching=False)


def pool_absmax(llm) -> tuple[np.ndarray, np.ndarray]:
    """max|k| and max|v| per (layer, kv head) over everything the auto pool holds: [L, H] each."""
    core = llm.engine.core
    return tuple(np.abs(np.asarray(x, np.float32)).max((2, 3, 4)) for x in (core.runner.k, core.runner.v))


def use_static_int8(k_scales, v_scales) -> None:
    """int8 rows without their scale bytes: x / s written, q * s read, s the layer's scalar or [H] (this process)."""
    def quantize(x, dtype, scale=None):
        q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale.reshape(-1, 1)), -127, 127).astype(jnp.int8)
        return jax.lax.bitcast_convert_type(q, jnp.uint8)

    def dequantize(rows, dtype, out_dtype, scale=None):
        q = jax.lax.bitcast_convert_type(rows, jnp.int8).astype(jnp.float32)
        return (q * scale.reshape(-1, 1, 1)).astype(out_dtype)

    attention.quantize_rows, attention.dequantize_rows = quantize, dequantize
    cache.KVQuant.scale_bytes = property(lambda self: 0)
    stored_layout = kv_pool.stored_layout
    kv_pool.stored_layout = lambda layout, name, scales=None: (lambda out: dataclasses.replace(
        out, quant=dataclasses.replace(out.quant, k_scales=k_scales, v_scales=v_scales)))(stored_layout(layout, name))


def main():
    auto = LLM(None, **KW)
    ids = auto.get_tokenizer().encode(TEXT)
    ppl = {"auto": cache_perplexity(auto, ids)}
    text_k, text_v = pool_absmax(auto)
    core = auto.engine.core
    core.runner.k, core.runner.v = kv_pool.new_pool(core.runner.pool, core.runner.mesh)     # zeroed: calibration only
    auto.generate([CALIBRATION], SamplingParams(max_tokens=1, temperature=0.0))
    k, v = pool_absmax(auto)
    over = int((text_k > k).sum() + (text_v > v).sum())
    out = {"calibration_exceeded": f"{over} of {2 * k.size} (layer, k / v, head) tensors, by up to "
                                   f"{max((text_k / k).max(), (text_v / v).max()) - 1:.0%}"}
    del auto, core
    llm = LLM(None, kv_cache_dtype="int8", **KW)
    ppl["int8 per token and head"] = cache_perplexity(llm, ids)
    del llm
    for name, (ks, vs) in {"per tensor": (k.max(1), v.max(1)), "per head": (k, v)}.items():
        table = lambda a: tuple(tuple(float(x) / 127 for x in row) if np.ndim(row) else float(row) / 127 for row in a)
        use_static_int8(table(ks), table(vs))
        llm = LLM(None, kv_cache_dtype="int8", **KW)
        ppl[f"int8 {name} (calibrated)"] = cache_perplexity(llm, ids)
        del llm
    out["perplexity"] = {n: f"{p:.3f} ({(p / ppl['auto'] - 1) * 100:+.2f}%)" for n, p in ppl.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
