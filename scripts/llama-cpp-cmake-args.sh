#!/bin/sh
# The CMAKE_ARGS that `make peers` builds llama.cpp (inside llama-cpp-python) with, for this CPU.
# Where the CPU has AMX (amx_tile / amx_int8 in /proc/cpuinfo), llama.cpp's AMX matmul path dies
# with SIGILL in batched matmuls (a prompt of a few hundred tokens), so there the build is not
# native: each AVX-family extension the CPU has is named on, and the AMX options off. Elsewhere
# GGML_NATIVE=ON (-march=native). Prints the arguments on stdout, and what it chose on stderr.
# CPUINFO names another file to read than /proc/cpuinfo (tests/bench/test_make_peers.py).
set -eu

common="-DLLAVA_BUILD=OFF"
flags=$(grep -m1 '^flags' "${CPUINFO:-/proc/cpuinfo}" 2>/dev/null || true)
has() { case " ${flags#*:} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if has amx_tile || has amx_int8; then
  args="-DGGML_NATIVE=OFF"
  # cpuinfo flag:ggml option
  for pair in avx:AVX avx2:AVX2 bmi2:BMI2 fma:FMA f16c:F16C avx512f:AVX512 avx512vbmi:AVX512_VBMI \
              avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    if has "${pair%%:*}"; then args="$args -DGGML_${pair#*:}=ON"; fi
  done
  args="$args -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  echo "make peers: this CPU has AMX, where llama.cpp's AMX matmuls die with SIGILL: building without" \
       "them (GGML_NATIVE=OFF, AVX-family extensions on, GGML_AMX_TILE/INT8/BF16=OFF)" >&2
else
  args="-DGGML_NATIVE=ON"
  echo "make peers: building llama.cpp for this CPU (GGML_NATIVE=ON)" >&2
fi
echo "$args $common"
