"""engine-sim's time model against the GPU it runs on (docs/gpu-truth.md, "On a GPU"): the stage of
benchmarks/gpu_check.sh that checks time. Three comparisons, one table:

1. kernels: the nine linear-layer kernels of one Llama layer, timed with torch on this GPU (bf16 GEMMs through
   cuBLAS; RMS norm, rotary, SiLU·mul and add as torch ops) for Llama-2-7B at TP 1 and Llama-2-70B's per-device
   shapes at TP 1, 2, 4, 8, at 1–4,096 tokens, against operators.py with the preset that matches the GPU
   (h100 or h200). Targets: GEMM-sum MAPE ≤ 10 % at ≥ 64 tokens, ≤ 25 % below. torch's eager norm and rotary
   run several kernels where an engine runs one fused kernel, so the whole layer is reported, not targeted;
2. end to end: vLLM's own latency benchmark shape (a batch of 8, 32 in / 128 out) on a Llama-3-8B geometry with
   dummy weights (no download: a config.json written here, `load_format="dummy"`), when vLLM is importable,
   against engine-sim's batch latency for the same work. Target ±15 %;
3. llama.cpp: benchmarks/llama_fidelity.py when a llama-server is on the PATH (targets TTFT MAPE ≤ 20 %, E2EL
   MAPE ≤ 10 %).

    python benchmarks/gpu_time_check.py --out DIR [--budget-s 200] [--device cuda]

--device cpu runs the same code on the CPU (a smoke test of this script: CPU timings say nothing about the
preset). Writes DIR/gpu_time_check.json and prints the table. Exit status 0 when it ran (missed targets are
reported, not an error), 2 when the device is not usable.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from kvbench.backends.enginesim.operators import OperatorModel
from kvbench.backends.enginesim.roofline import LatencyModel

from kvbench.models import HARDWARE, MODELS, ModelGeometry

TOKENS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096)
LLAMA2 = {  # Llama-2 geometries as Vidur measured them: (hidden, heads, kv heads, intermediate, vocab)
    "llama2-7b": (4096, 32, 32, 11008, 32000),
    "llama2-70b": (8192, 64, 8, 28672, 32000),
}
CONFIGS = [("llama2-7b", 1)] + [("llama2-70b", tp) for tp in (1, 2, 4, 8)]
TARGETS = {"gemm_ge64": 0.10, "gemm_lt64": 0.25, "e2e": 0.15, "llama_ttft": 0.20, "llama_e2el": 0.10}


def geometry(name: str) -> ModelGeometry:
    h, heads, kv, ffn, vocab = LLAMA2[name]
    hd = h // heads
    return ModelGeometry(name, layers=1, kv_heads=kv, head_dim=hd, hidden=h, heads=heads, intermediate=ffn,
                         vocab=vocab, params=h * (2 * heads * hd + 2 * kv * hd) + 3 * h * ffn)  # fmt: skip


def timer(torch, device: str, reps: int):
    """Median seconds of fn() over `reps` runs after warm-up: CUDA events on a GPU, perf_counter elsewhere."""

    def run(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return float(np.median(times))

    return run


def layer_kernels(torch, ops: OperatorModel, tokens: int, device: str):
    """The nine kernels of one layer at `tokens` tokens, as callables on tensors of the model's per-device shapes."""
    dt, m = torch.bfloat16, ops.model
    hd = m.head_dim
    w = {name: torch.randn(n, k, device=device, dtype=dt) for name, (n, k) in ops.gemms.items()}
    x = {name: torch.randn(tokens, k, device=device, dtype=dt) for name, (n, k) in ops.gemms.items()}
    h = torch.randn(tokens, m.hidden, device=device, dtype=dt)
    norm_w = torch.ones(m.hidden, device=device, dtype=dt)
    q = torch.randn(tokens, (m.heads + m.kv_heads) // ops.tp or 1, hd, device=device, dtype=dt)
    cos, sin = (
        torch.randn(tokens, 1, hd // 2, device=device, dtype=dt),
        torch.randn(tokens, 1, hd // 2, device=device, dtype=dt),
    )
    width = ops.gemms["mlp_down"][1]
    gate_up = torch.randn(tokens, 2 * width, device=device, dtype=dt)

    def rms():
        return h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(dt) * norm_w

    def rope():
        a, b = q[..., : hd // 2], q[..., hd // 2 :]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)

    def act():
        g, u = gate_up.chunk(2, -1)
        return torch.nn.functional.silu(g) * u

    kernels = {name: (lambda name=name: torch.nn.functional.linear(x[name], w[name])) for name in ops.gemms}
    return kernels | {"input_norm": rms, "post_attention_norm": rms, "rope": rope, "mlp_act": act,
                      "add": lambda: h + h}  # fmt: skip


def check_kernels(torch, hw, device: str, deadline: float) -> dict:
    measure = timer(torch, device, reps=10 if device == "cuda" else 2)
    rows = []
    # on a CPU (the smoke test) a 4,096-token 70B GEMM would take minutes: a small grid
    tokens_grid, configs = (TOKENS, CONFIGS) if device == "cuda" else ((1, 8, 64), CONFIGS[:1])
    for name, tp in configs:
        ops = OperatorModel(geometry(name), hw, tp)
        for tokens in tokens_grid:
            if time.time() > deadline:
                break
            measured = {k: measure(fn) for k, fn in layer_kernels(torch, ops, tokens, device).items()}
            rows.append({"model": name, "tp": tp, "tokens": tokens, "measured": measured,
                         "predicted": ops.layer_ops_s(tokens)})  # fmt: skip
            if device == "cuda":
                torch.cuda.empty_cache()
    gemms = ("qkv_proj", "o_proj", "mlp_up", "mlp_down")

    def mape(keys, big):
        errs = [sum(r["predicted"][k] for k in keys) / sum(r["measured"][k] for k in keys) - 1
                for r in rows if (r["tokens"] >= 64) == big]  # fmt: skip
        return float(np.mean(np.abs(errs))) if errs else float("nan")

    every = tuple(rows[0]["measured"]) if rows else ()
    return {"rows": rows, "gemm_ge64": mape(gemms, True), "gemm_lt64": mape(gemms, False),
            "layer_ge64": mape(every, True), "layer_lt64": mape(every, False),
            "complete": len(rows) == len(configs) * len(tokens_grid)}  # fmt: skip


def check_e2e(hw, deadline: float) -> dict:
    """vLLM's latency shape on a dummy-weight Llama-3-8B, against engine-sim; skipped without vLLM."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"skipped": "vLLM is not importable here (pip install vllm needs the network)"}
    m = MODELS["llama3-8b"]
    lat = LatencyModel(m, hw)
    predicted = lat.step_s([(32, 0)] * 8, []) + sum(lat.decode_step_s(8, 8 * (32 + i)) for i in range(1, 128))
    with tempfile.TemporaryDirectory() as tmp:
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": m.hidden,
                  "intermediate_size": m.intermediate, "num_attention_heads": m.heads, "num_hidden_layers": m.layers,
                  "num_key_value_heads": m.kv_heads, "vocab_size": m.vocab, "max_position_embeddings": 2048,
                  "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
                  "tie_word_embeddings": False}  # fmt: skip
        Path(tmp, "config.json").write_text(json.dumps(config))
        code = f"""
import json, time, numpy as np
from vllm import LLM, SamplingParams
llm = LLM(model={tmp!r}, load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, enable_prefix_caching=False)
sp = SamplingParams(max_tokens=128, min_tokens=128, ignore_eos=True, detokenize=False)
prompts = [{{"prompt_token_ids": list(range(100 + i, 132 + i))}} for i in range(8)]
llm.generate(prompts, sp, use_tqdm=False)
times = []
for _ in range(5):
    t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); times.append(time.perf_counter() - t)
print(json.dumps({{"median_s": float(np.median(times)), "runs_s": times}}))
"""
        left = int(deadline - time.time())
        if left < 60:
            return {"skipped": f"out of time ({left} s left)"}
        try:
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            return {"skipped": f"vLLM did not finish in {left} s"}
    if proc.returncode != 0:
        return {"failed": proc.stderr[-2000:]}
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    ratio = predicted / measured["median_s"]
    return {"model": "llama3-8b (dummy weights)", "workload": "batch 8, 32 in / 128 out", "measured_s": measured,
            "predicted_s": predicted, "ratio": ratio, "within_target": abs(ratio - 1) <= TARGETS["e2e"]}  # fmt: skip


def check_llama(out: Path, deadline: float) -> dict:
    if not shutil.which("llama-server"):
        return {"skipped": "no llama-server on the PATH (a CUDA build of llama.cpp)"}
    left = int(deadline - time.time())
    if left < 90:
        return {"skipped": f"out of time ({left} s left)"}
    path = out / "llama_fidelity.json"
    cmd = [sys.executable, "benchmarks/llama_fidelity.py", "--rounds", "3", "--requests", "30", "--out", str(path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        return {"skipped": f"llama_fidelity.py did not finish in {left} s"}
    if proc.returncode != 0 or not path.exists():
        return {"failed": proc.stderr[-2000:]}
    return {"medians": json.loads(path.read_text())["medians"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_time_check.json")
    ap.add_argument("--budget-s", type=float, default=200, help="wall-clock budget for all three checks, seconds")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="where to time the kernels")
    args = ap.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not usable: nothing to time")
        return 2
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    hw = HARDWARE["h200" if "H200" in name else "h100"]
    started = time.time()
    deadline = started + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    kernels = check_kernels(torch, hw, args.device, started + 0.4 * args.budget_s)
    e2e = check_e2e(hw, started + 0.8 * args.budget_s) if args.device == "cuda" else {"skipped": "cpu"}
    llama = check_llama(args.out, deadline) if args.device == "cuda" else {"skipped": "cpu"}
    result = {"device": name, "preset": hw.name, "targets": TARGETS, "kernels": kernels, "e2e": e2e,
              "llama_cpp": llama, "wall_s": round(time.time() - started, 1)}  # fmt: skip
    (args.out / "gpu_time_check.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"time model on {name} (preset {hw.name}):")
    print(f"  {'check':44s} {'figure':>10s}  target")
    print(f"  {'kernels: GEMM sum MAPE, >= 64 tokens':44s} {kernels['gemm_ge64']:10.1%}  <= 10%")
    print(f"  {'kernels: GEMM sum MAPE, < 64 tokens':44s} {kernels['gemm_lt64']:10.1%}  <= 25%")
    print(f"  {'kernels: whole layer (torch eager) >= 64':44s} {kernels['layer_ge64']:10.1%}  (reported)")
    fig = f"{e2e['ratio']:.2f}x" if "ratio" in e2e else next(iter(e2e.values()))[:40]
    print(f"  {'end to end: batch 8, 32/128, engine-sim/vLLM':44s} {fig:>10s}  0.85-1.15x")
    for c, v in (llama.get("medians") or {}).items():
        print(f"  {f'llama.cpp c{c}: TTFT / E2EL MAPE':44s} {v['ttft_mape']:5.1%}/{v['e2el_mape']:4.1%}  <= 20% / 10%")
    if "medians" not in llama:
        print(f"  {'llama.cpp':44s} {next(iter(llama.values()))[:60]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
