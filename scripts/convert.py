"""Convert a checkpoint once: to an Orbax checkpoint that restores onto any mesh, or GGUF -> safetensors.

    python scripts/convert.py SRC OUT --to orbax [--dtype float32|bfloat16|float16] [--overwrite]
    python scripts/convert.py MODEL.gguf OUT --to safetensors [--dtype float32|bfloat16]

SRC is a Hugging Face directory, a .gguf file or an Orbax directory. OUT gets config.json,
the tokenizer files and (for orbax) `OUT/orbax/`; load it with `LLM("OUT", tensor_parallel_size=N)`.
"""

import argparse
import time

from tp_jax.loaders.orbax import DTYPES, convert_to_orbax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="HF model directory, .gguf file, or Orbax model directory")
    parser.add_argument("out", help="output directory (created if missing)")
    parser.add_argument("--to", choices=["orbax", "safetensors"], default="orbax")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="cast tensors on disk (default: orbax keeps each tensor's dtype, "
                             "safetensors writes float32)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT/orbax")
    args = parser.parse_args()
    t = time.perf_counter()
    if args.to == "orbax":
        convert_to_orbax(args.src, args.out, args.dtype, overwrite=args.overwrite)
    else:
        from tp_jax.loaders.convert import convert_gguf
        if not args.src.endswith(".gguf"):
            parser.error("--to safetensors converts a .gguf file; SRC is not one")
        convert_gguf(args.src, args.out, args.dtype or "float32")
    print(f"wrote {args.out} ({args.to}) in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
