#!/usr/bin/env bash
# The GPU engine's checks on one CUDA GPU, in under ~8 minutes:
#   1. the Triton kernel tests and the Triton engine tests compiled for the GPU (TRITON_INTERPRET
#      unset: tests/kernels/triton, tests/engine/test_triton_engine.py, the backend choice);
#   2. the engine's timings on the Triton path (scripts/gpu_engine_bench.py: decode at
#      B=1,8,32,64 with and without CUDA graphs, the verify cost of 1-16 rows and the step against
#      the read floor, suffix speculation against plain decoding, tool calls with the template
#      drafter). `agentrt bench decode/spec/toolcall/batch-sweep` take no device: they time
#      the CPU engine, so they are not run here.
# Writes one JSON summary to $1 (default: a new file under ${TMPDIR:-/tmp}) and prints its path.
# Exits 2 at once when no CUDA GPU is present, 1 when a test or a tool call failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SUMMARY=${1:-$(mktemp "${TMPDIR:-/tmp}/agentrt-gpu-check-XXXXXX.json")}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi missing or finds none); nothing was run" >&2
    exit 2
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: nvidia-smi sees a GPU but torch.cuda.is_available() is False in $PY; nothing was run" >&2
    exit 2
fi
unset TRITON_INTERPRET AGENTRT_KERNELS  # the kernels compiled for the GPU, the backend chosen by device
WORK=$(mktemp -d)

timeout 270 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$WORK/tests.xml" \
    tests/kernels/triton tests/kernels/test_kernel_backend.py tests/engine/test_triton_engine.py
TESTS_RC=$?
timeout 210 "$PY" scripts/gpu_engine_bench.py --json "$WORK/engine.json"
BENCH_RC=$?

"$PY" - "$WORK" "$SUMMARY" "$TESTS_RC" "$BENCH_RC" <<'EOF'
import json, subprocess, sys
import xml.etree.ElementTree as ET
from pathlib import Path

work, summary, tests_rc, bench_rc = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
out = {"gpu": subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip(),
       "tests": {"rc": tests_rc}, "engine": {"rc": bench_rc}}
if (work / "tests.xml").exists():
    suites = ET.parse(work / "tests.xml").getroot()
    suite = suites if suites.tag == "testsuite" else suites[0]
    out["tests"] |= {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    out["tests"]["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                              if c.find("failure") is not None or c.find("error") is not None]
if (work / "engine.json").exists():
    out["engine"] |= json.loads((work / "engine.json").read_text())
Path(summary).write_text(json.dumps(out, indent=2))
EOF
echo "gpu_check: summary in $SUMMARY (tests rc=$TESTS_RC, engine timings rc=$BENCH_RC)"
[ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
