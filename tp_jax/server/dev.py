"""Development endpoints for rollouts (vLLM's, behind its VLLM_SERVER_DEV_MODE=1): off unless the environment
variable TP_JAX_SERVER_DEV_MODE=1 is set when `tp-jax serve` starts (no engine argument turns them on).

    POST /sleep?level=1                  free the KV pool (level 2: the weights too); 200, empty
    POST /wake_up                        re-allocate; 200, empty
    GET  /is_sleeping                    {"is_sleeping": bool}
    POST /update_weights_from_disk       {"model_path": DIR}: a checkpoint of the same architecture;
                                         {"success": true, "message": ..., "seconds": ...}

Each runs on the engine thread between steps (`AsyncLLMEngine.call`); with requests still running it is refused
(409), as `LLM.sleep` / `update_weights_from_disk` refuse them; a request that arrives while the engine sleeps
gets a 400 naming the state.
"""

from __future__ import annotations

import asyncio
import os

from fastapi import FastAPI
from pydantic import BaseModel

from tp_jax.server.handlers import APIError

DEV_MODE_ENV = "TP_JAX_SERVER_DEV_MODE"


def dev_mode() -> bool:
    return os.environ.get(DEV_MODE_ENV, "") == "1"


class UpdateWeightsFromDiskRequest(BaseModel):
    model_path: str


def add_dev_routes(app: FastAPI, aengine, llm) -> None:
    """The routes above on `app`, acting on `llm` (whose engine `aengine` runs)."""
    from tp_jax.serving import weights

    async def on_engine(fn):
        try:
            return await asyncio.wrap_future(aengine.call(lambda _engine: fn()))
        except RuntimeError as e:                         # requests still running
            raise APIError(409, str(e), type="conflict") from None
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise APIError(400, str(e)) from None

    @app.post("/sleep")
    async def sleep(level: int = 1):
        await on_engine(lambda: weights.sleep(llm, level))
        return {}

    @app.post("/wake_up")
    async def wake_up():
        await on_engine(lambda: weights.wake_up(llm))
        return {}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": llm.is_sleeping}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest):
        done = await on_engine(lambda: weights.update_from_disk(llm, body.model_path))
        return {"success": True, "message": f"serving the weights of {body.model_path}",
                "seconds": round(done["seconds"], 3)}
