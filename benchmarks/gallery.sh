#!/usr/bin/env bash
# The documentation's gallery (docs/gallery.md): screenshots of a real `kvbench demo` run, rendered by
# `kvbench report --screenshot` in headless Chromium, then cut to their first CROP_PX pixels and scaled to
# WIDTH_PX wide (a full report page is many screens tall; the site shows its top and links the page itself).
# Usage: benchmarks/gallery.sh   (needs Chromium and playwright: the dev extra and `apt install chromium`)
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/gallery
work=$(mktemp -d "${TMPDIR:-/tmp}/kvbench-gallery.XXXXXX")
trap 'rm -rf "$work"' EXIT
kvbench demo --requests 400 --out "$work/demo"
ls "$work/demo/runs"
pictured=(chat-sim multi-tenant-sim chat-engine-sim)
kvbench report "$work/demo" "${pictured[@]/#/$work/demo/runs/}" --screenshot
python3 - "$work/demo" "$out" <<'PY'
import sys
from pathlib import Path
from PIL import Image

CROP_PX, WIDTH_PX = 2400, 1000
demo, out = Path(sys.argv[1]), Path(sys.argv[2])
shots = {"demo-index.png": demo / "screenshots" / "index.png"}
for run in ("chat-sim", "multi-tenant-sim", "chat-engine-sim"):  # the runs pictured above
    shots[f"report-{run}.png"] = demo / "runs" / run / "screenshots" / "report.png"
for name, src in shots.items():
    img = Image.open(src)
    img = img.crop((0, 0, img.width, min(img.height, CROP_PX)))
    img = img.resize((WIDTH_PX, round(img.height * WIDTH_PX / img.width)), Image.LANCZOS)
    img.convert("RGB").save(out / name, optimize=True)
    print(f"wrote {out / name} ({img.width}x{img.height}) from {src}")
PY
