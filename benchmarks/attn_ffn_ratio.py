"""Attention/FFN disaggregation: decode tokens/s per device and TPOT against the attention:FFN device ratio, for
a fixed number of devices, through `kvbench experiment attn-ffn`'s functions (backends/enginesim/afd_experiment.py;
docs/parallelism.md, Attention/FFN disaggregation). Two deployments:

- deepseek-v3 (MoE, fp8 weights) on 16 × H200 (two servers: the two sides talk over the network), context 4096;
- llama3-70b (dense, bf16) on 8 × H100 (one server: NVLink), context 2048.

    python benchmarks/attn_ffn_ratio.py [--micro-batches 3]

Writes benchmarks/results/attn_ffn_ratio.json and attn_ffn_ratio.png, and prints the curves. Analytical: no trace
is replayed (each point is one decode step at a steady batch), so it runs in about a second.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from kvbench.backends.enginesim.afd_experiment import curve, plot, table

RESULTS = Path(__file__).parent / "results"
CASES = [  # model, hardware, devices, weight dtype, context
    ("deepseek-v3", "h200", 16, "fp8", 4096),
    ("llama3-70b", "h100", 8, "bf16", 2048),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--micro-batches", type=int, default=3, help="ping-pong micro-batches per step (count)")
    args = ap.parse_args()
    cases = [curve(*case, micro_batches=args.micro_batches) for case in CASES]
    RESULTS.mkdir(exist_ok=True)
    result = {"benchmark": "attn_ffn_ratio", "command": "python benchmarks/attn_ffn_ratio.py",
              "machine": platform.platform(), "cases": cases}  # fmt: skip
    tmp = RESULTS / "attn_ffn_ratio.json.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(RESULTS / "attn_ffn_ratio.json")
    plot(cases, RESULTS / "attn_ffn_ratio.png")
    for case in cases:
        print(f"{case['model']} on {case['devices']} × {case['hardware']}, {case['weight_dtype']}, "
              f"context {case['context']}")  # fmt: skip
        print(table(case))
    print(f"wrote {RESULTS / 'attn_ffn_ratio.json'} and attn_ffn_ratio.png")


if __name__ == "__main__":
    main()
