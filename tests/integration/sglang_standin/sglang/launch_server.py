"""`python -m sglang.launch_server FLAGS`, served by the local engine: parses exactly the
flags `launcher/sglang_servers.py` sends (an unknown one is an error, as in SGLang) and
starts `python -m launcher engine` with the model, host, port and weight version."""

from __future__ import annotations

import argparse
import os
import sys

parser = argparse.ArgumentParser(prog="sglang.launch_server (CPU stand-in)")
for flag in (
    "--model-path",
    "--served-model-name",
    "--weight-version",
    "--host",
    "--port",
    "--tp-size",
    "--dp-size",
    "--log-level",
    "--max-running-requests",
    "--mem-fraction-static",
    "--context-length",
    "--dtype",
):
    parser.add_argument(flag)
parser.add_argument("--enable-metrics", action="store_true")
args = parser.parse_args()
data_dir = os.environ.get("SGLANG_STANDIN_DATA_DIR", "./data")
argv = [
    sys.executable,
    "-m",
    "launcher",
    "engine",
    "--model",
    args.model_path,
    "--host",
    args.host,
    "--port",
    args.port,
    "--set",
    f"engine.weight_version={args.weight_version}",
    "--set",
    f"engine.served_model_name={args.served_model_name}",
    "--set",
    f"data_dir={data_dir}",
    "--set",
    "engine.torch_threads=1",
]
if args.max_running_requests is not None:
    argv += ["--set", f"engine.max_running_requests={args.max_running_requests}"]
os.execv(sys.executable, argv)
