"""Convert a checkpoint once: to an Orbax checkpoint that restores onto any mesh, or GGUF -> safetensors.

    python scripts/convert.py SRC OUT --to orbax [--dtype float32|bfloat16|float16] [--overwrite]
    python scripts/convert.py MODEL.gguf OUT --to safetensors [--dtype float32|bfloat16|float16]

SRC is a Hugging Face directory, a .gguf file or an Orbax directory. OUT gets config.json,
the tokenizer files and (for orbax) `OUT/orbax/`; load it with `LLM("OUT", tensor_parallel_size=N)`.
A bad input ends with one line on stderr and exit code 2 (a bug: its traceback, 1); Ctrl-C with exit code 130.
"""

import argparse
import os
import sys
import time

from tp_jax.loaders.dtypes import FLOATS
from tp_jax.server.command import USER_ERRORS


def convert(args) -> None:
    from tp_jax.loaders.orbax import convert_to_orbax
    from tp_jax.loaders.sources import is_gguf
    if args.to == "orbax":
        convert_to_orbax(args.src, args.out, args.dtype, overwrite=args.overwrite)
    else:
        from tp_jax.loaders.convert import convert_gguf
        if not is_gguf(args.src):
            raise ValueError(f"--to safetensors converts a .gguf file; {args.src!r} is not one")
        convert_gguf(args.src, args.out, args.dtype or "float32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="HF model directory, .gguf file, or Orbax model directory")
    parser.add_argument("out", help="output directory (created if missing)")
    parser.add_argument("--to", choices=["orbax", "safetensors"], default="orbax")
    parser.add_argument("--dtype", choices=FLOATS, default=None,
                        help="cast tensors on disk (default: orbax keeps each tensor's dtype, "
                             "safetensors writes float32)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT/orbax")
    args = parser.parse_args()
    t = time.perf_counter()
    try:
        convert(args)
    except FileExistsError:
        parser.exit(2, f"convert.py: error: {os.path.join(args.out, 'orbax')} already exists; pass --overwrite "
                       f"to replace it\n")
    except (*USER_ERRORS, OSError) as e:                 # the project's user errors, or OUT cannot be written
        parser.exit(2, f"convert.py: error: {e}\n")
    except KeyboardInterrupt:
        parser.exit(130, "convert.py: interrupted; nothing was left half-written in OUT/orbax\n")
    print(f"wrote {args.out} ({args.to}) in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
