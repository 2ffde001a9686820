"""`make peers`' build of llama.cpp (scripts/llama-cpp-cmake-args.sh): native where that is safe;
on a CPU with AMX, where llama.cpp's AMX matmuls die by SIGILL, the AVX family it has named on,
AMX off, and a line that says so."""
from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "llama-cpp-cmake-args.sh"
AVX512_FLAGS = "fpu sse avx avx2 bmi2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16"


def cmake_args(tmp_path: Path, flags: str) -> tuple[list[str], str]:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    p = subprocess.run(["sh", str(SCRIPT)], capture_output=True, text=True, env={"CPUINFO": str(cpuinfo), "PATH": "/usr/bin:/bin"},
                       check=True, timeout=30)
    return p.stdout.split(), p.stderr


def test_amx_cpu_builds_without_the_amx_path(tmp_path):
    args, said = cmake_args(tmp_path, AVX512_FLAGS + " amx_bf16 amx_tile amx_int8")
    assert "-DGGML_NATIVE=OFF" in args and "-DLLAVA_BUILD=OFF" in args
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)
    for option in ("AVX", "AVX2", "BMI2", "FMA", "F16C", "AVX512", "AVX512_VNNI", "AVX512_BF16"):
        assert f"-DGGML_{option}=ON" in args
    assert "-DGGML_AVX512_VBMI=ON" not in args  # only what the CPU has
    assert "AMX" in said and "SIGILL" in said


def test_other_cpus_build_natively(tmp_path):
    args, said = cmake_args(tmp_path, AVX512_FLAGS)
    assert args == ["-DGGML_NATIVE=ON", "-DLLAVA_BUILD=OFF"] and "GGML_NATIVE=ON" in said
