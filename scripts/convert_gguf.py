"""Convert a llama GGUF file to a Hugging Face checkpoint directory.

    python scripts/convert_gguf.py IN.gguf OUT_DIR [--dtype float32|bfloat16|float16]

The same as `scripts/convert.py IN.gguf OUT_DIR --to safetensors`.
"""

import argparse

from tp_jax.loaders.convert import convert_gguf
from tp_jax.loaders.dtypes import FLOATS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf_path", help="input .gguf file (llama architecture)")
    parser.add_argument("out_dir", help="output directory (created if missing)")
    parser.add_argument("--dtype", choices=FLOATS, default="float32")
    args = parser.parse_args()
    try:
        convert_gguf(args.gguf_path, args.out_dir, args.dtype)
    except (ValueError, OSError) as e:                 # GGUFError is a ValueError: one line, no traceback
        parser.exit(2, f"convert_gguf.py: error: {e}\n")
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    main()
