#!/usr/bin/env bash
# Build a venv of its own with SGLang for the CPU (PyPI only), for the real-SGLang tests
# (tests/integration/test_sglang_engine.py and friends) and `--engine sglang` on a machine
# without a GPU. Usage: scripts/build_sglang_venv.sh [VENV_DIR]   (default .venv-sglang)
#
# Why not `pip install sglang`: it resolves to CUDA torch, ~35 nvidia/cuda packages,
# flashinfer and a 373 MB CUDA-only kernel wheel, several GB that cannot run on a CPU.
# Instead: CPU torch held with a constraint, sglang without its dependencies, then the
# runtime dependencies it needs minus the CUDA, NVIDIA and kernel packages. pip reports
# conflicts with sglang's CUDA pins afterwards: expected and harmless.
# The CPU build of `sgl_kernel` is on no registry: the project's stand-in
# (tests/integration/sgl_kernel_standin/) is copied into the venv, so `--engine sglang`
# runs on a CPU; the tests also put the checkout's copy first on the servers' PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-sglang}
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0

python3 -m venv "$venv"
py="$venv/bin/python"
cons=$(mktemp)
trap 'rm -f "$cons"' EXIT
echo "torch==$TORCH_VERSION" > "$cons"
# CPU torch as .ci/run installs it for .venv-vllm (the machine's wheel folder holds the
# CPU build; elsewhere add --index-url https://download.pytorch.org/whl/cpu).
"$venv/bin/pip" install -q "torch==$TORCH_VERSION"
"$venv/bin/pip" install -q --no-deps "sglang==$SGLANG_VERSION"
"$venv/bin/pip" install -q -c "$cons" \
  aiohttp "anthropic>=0.20" blobfile==3.0.0 build compressed-tensors==0.18.0 datasets distro \
  easydict einops fastapi gguf interegular IPython "llguidance>=1.7.6,<2" \
  "mistral_common>=1.11.5" modelscope msgspec ninja numpy nvidia-ml-py openai==2.8.0 \
  openai-harmony==0.0.4 orjson outlines==0.1.11 packaging partial_json_parser pillow \
  "prometheus-client>=0.20" psutil py-spy pybase64 pydantic "python-dateutil<3" \
  python-multipart "pyzmq>=25.1.2" regex requests scipy sentencepiece==0.2.1 setproctitle \
  "smg-grpc-servicer>=0.9.0" soundfile==0.13.1 tiktoken tokenizers==0.23.2 \
  transformers==5.19.0 "uvicorn>=0.51" uvloop watchfiles xgrammar==0.2.7 xxhash zstandard \
  tqdm torchvision==0.28.0
# SGLang's router (the version the gateway's router client was run against), for the
# two-server test behind it; its dependencies are among the above.
"$venv/bin/pip" install -q -c "$cons" sglang-router==0.3.2

# PyPI's torchvision is a CUDA build: beside CPU torch its _C.so does not load, and two
# unguarded fake-op registrations make `import torchvision` fail (SGLang imports it at
# start). The file's own register_meta decorator registers the same shapes without _C.
meta=$("$py" - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("torchvision")
print(pathlib.Path(spec.origin).parent / "_meta_registrations.py")
PY
)
sed -i \
  -e 's/^@torch\.library\.register_fake("torchvision::nms")$/@register_meta("nms")/' \
  -e 's/^@torch\.library\.register_fake("torchvision::qnms")$/@register_meta("qnms")/' \
  "$meta"
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf "$site/sgl_kernel"
cp -r tests/integration/sgl_kernel_standin/sgl_kernel "$site/sgl_kernel"
# Fail here, not in a test an hour later, if either fix no longer applies.
"$py" -c "import torchvision, sgl_kernel, sglang; print('sglang', sglang.__version__, 'ready')"
