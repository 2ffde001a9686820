"""Build, cache and load the quantized-weight kernels (csrc/cpu_quant_avx2.c, cpu_quant_k.c, and
cpu_quant_decoder.c's fused decoder layers over them; and cpu_argmax_f32.c, greedy decoding's
row argmax, for CPUs without the AMX library; and cpu_stream_read.c, the plain read that `bench
decode` measures a step's read floor with) for this CPU.

A second library beside cpu_build.py's AMX one, because it asks much less of the CPU: its fast
path needs AVX2 + FMA + F16C (any x86-64 from ~2013), and without them it compiles a scalar
path, so it loads on every x86-64 Linux with a C compiler. Same caching as cpu_build.py: built
once per (sources, compiler, flags, CPU) under $AGENTRT_CACHE/kernels, loaded with ctypes.
AGENTRT_KERNELS=0 turns it off too (callers then use the PyTorch references).

Threads: it links its own copy of csrc/cpu_pool.c (plain pthreads, no AMX state), so a process
that loads both libraries has two idle worker pools; they sleep after ~50 us without work.

-ffp-contract=off: the kernel's rows must not depend on which tile shape computed them (see the
C file), and its embedding lookup reproduces the reference's unfused multiply-then-add.

$AGENTRT_QUANT_MARCH builds for another CPU level than this one's (-march=native by default):
AGENTRT_QUANT_MARCH=x86-64-v3 compiles the AVX2 + FMA paths alone, attention and the per-token
loops included, so a machine with AVX-512 measures what a CPU without it gets (the bits are the
same: tests/kernels/test_quant_isa.py), where $AGENTRT_QUANT_ISA caps only the linears.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import re
import threading
from collections.abc import Iterator
from pathlib import Path

from agentrt.kernels.cpu_build import (_compiler, _cpu_flags, compile_library, compiler_identity, kernels_cache_dir,
                                       open_library)

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("cpu_pool.c", "cpu_quant_avx2.c", "cpu_quant_avx512.c", "cpu_quant_k.c", "cpu_quant_decoder.c", "cpu_quant_attention.c", "cpu_argmax_f32.c",
           "cpu_stream_read.c")
HEADERS = ("cpu_pool.h", "cpu_quant.h")
CFLAGS = ("-O3", "-ffp-contract=off", "-pthread", "-shared", "-fPIC", "-std=gnu11")
MARCH_ENV = "AGENTRT_QUANT_MARCH"  # the CPU level to build for (gcc's -march), default native
AVX2_MARCH = "x86-64-v3"  # AVX2, FMA, F16C and BMI2: the fast path without AVX-512
FAST_PATH_CPU_FLAGS = ("avx2", "fma", "f16c")
# The instruction sets a linear on rows-by-8 weights can run on, in agentrt_quant_isa's order
# (csrc/cpu_quant.h), with the CPU flags each needs beyond the one before. Every one gives the
# same bits; the best the build and CPU allow runs, capped by $AGENTRT_QUANT_ISA (or cap_isa).
ISAS = ("scalar", "avx2", "avx512-vnni", "amx-int8")
ISA_CPU_FLAGS = {
    "scalar": (),
    "avx2": FAST_PATH_CPU_FLAGS,
    "avx512-vnni": FAST_PATH_CPU_FLAGS + ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    "amx-int8": FAST_PATH_CPU_FLAGS + ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"),
}
ISA_ENV = "AGENTRT_QUANT_ISA"
# "1": the attention's scores and P.V on AMX-BF16 tiles where the CPU has them (attention_tiles)
ATTENTION_TILES_ENV = "AGENTRT_QUANT_ATTENTION_TILES"
ATTENTION_TILES_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
                             "amx_bf16")
# Activation rows a linear multiplies at once, per instruction set: AMX takes 16 per tile multiply
# and runs up to 16 rows as one pipelined tile, so a step's cost jumps each time its rows pass a
# multiple of 16 (measured on a 2-core Xeon, SmolLM2 Q4_1: 14.6 ms at 16 rows, 18.1 ms at 17). The
# vector paths' steps (a block unpacked per 4 or 8 rows) are small enough to price as a slope.
ISA_ROW_TILE = {"amx-int8": 16}
SCALAR_DEFINE = "-DAGENTRT_QUANT_SCALAR"  # forces the scalar path (tests of the fallback)

_I64, _I32, _P = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
SIGNATURES = {
    "agentrt_quant_avx2": (_I32, []),
    "agentrt_quant_isa": (_I32, []),
    "agentrt_quant_set_isa": (_I32, [_I32]),
    "agentrt_quant_activations": (_I32, [_P, _I64, _I64, _I64, _P, _P]),
    "agentrt_quant_linear": (_I32, [_P, _I64, _I64, _P, _I32, _I64, _I64, _P, _I64, _I32]),
    "agentrt_quant_embedding": (_I32, [_P, _I64, _P, _I32, _I64, _I64, _P, _I64]),
    "agentrt_quant_interleave": (_I32, [_P, _I32, _I64, _I64, _P]),
    "agentrt_quant_kv_store": (None, [_P, _I64, _P]),
    "agentrt_argmax_f32": (None, [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I32]),
    "agentrt_quant_decoder": (_I32, [_P, _I64, _P, _I64, _I64, _I64, _I32, _I32, _I32, ctypes.c_float, ctypes.c_float,
                                     _P, _P, _P, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _P, _I64, _P,
                                     _I32, _P, _P, _I64]),
    "agentrt_quant_forward": (_I32, [_P, _I64, _P, _I64, _P, _P, _I64, _P, _P, _I64, _I64, _P, _I64, _P, _P, _P, _I32,
                                     _P, _P, _I64]),
    "agentrt_quant_attention": (_I32, [_P, _I64, _I64, _I32, _I32, _I32, ctypes.c_float, _P, _I64, _P, _P, _I64, _I64,
                                       _I64, _I64, _P, _P, _I64, _P, _I32]),
    "agentrt_quant_attention_tiles": (_I32, [_I32]),
    "agentrt_quant_reserve": (_I32, [_I64, _I64, _I64, _I32, _I32, _I32]),
    "agentrt_stream_read": (ctypes.c_uint64, [_P, _I64, _I32]),
}

_lock = threading.Lock()
_loaded: dict[tuple[bool, str], ctypes.CDLL | None] = {}  # (scalar?, march) -> lib (None: cannot run here)


def unsupported_reason() -> str | None:
    """Why the quantized kernels cannot run here, or None when they can be built."""
    if os.environ.get("AGENTRT_KERNELS", "1") == "0":
        return "disabled by AGENTRT_KERNELS=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs Linux on x86-64, this is {platform.system()} {platform.machine()}"
    if _compiler() is None:
        return "no C compiler (gcc or cc, or $CC) on PATH"
    return None


def has_fast_path() -> bool:
    """Whether this CPU gets the AVX2 path (else the scalar one)."""
    return all(f in _cpu_flags() for f in FAST_PATH_CPU_FLAGS)


def missing_cpu_flags(flags: tuple[str, ...]) -> list[str]:
    """The flags among `flags` (as /proc/cpuinfo names them) this machine lacks."""
    return [f for f in flags if f not in _cpu_flags()]


def missing_isa_flags(isa: str) -> list[str]:
    """The CPU flags this machine lacks for `isa` (one of ISAS), [] when it has them all."""
    if isa not in ISA_CPU_FLAGS:
        raise ValueError(f"unknown instruction set {isa!r}: expected one of {', '.join(ISAS)}")
    return missing_cpu_flags(ISA_CPU_FLAGS[isa])


def isa(lib: ctypes.CDLL) -> str:
    """The instruction set lib runs rows-by-8 linears on now (where this says amx-int8, calls of
    fewer than 8 rows, 5 for Q8_0, run on avx512-vnni: a tile multiply's fixed cost buys little
    there)."""
    return ISAS[lib.agentrt_quant_isa()]


def row_tile() -> int:
    """The row tile of the instruction set the quantized linears run on now (1: no tiles, or no
    quantized kernels here)."""
    lib = quant_kernels()
    return 1 if lib is None else ISA_ROW_TILE.get(isa(lib), 1)


def cap_isa(lib: ctypes.CDLL, name: str) -> str:
    """Run lib's linears on `name` at most (benches and tests compare the paths; the outputs are
    the same bits). Returns the instruction set now in effect; ValueError when this CPU or build
    cannot run `name`, naming the missing CPU flags."""
    if name not in ISAS:
        raise ValueError(f"unknown instruction set {name!r}: expected one of {', '.join(ISAS)}")
    if lib.agentrt_quant_set_isa(ISAS.index(name)) < 0:
        missing = missing_isa_flags(name)
        why = f"this CPU lacks {', '.join(missing)}" if missing else (
            "this build has no such path (the scalar path is built apart: quant_kernels(scalar=True))"
            if name == "scalar" else "the kernel could not enable it (AMX: the kernel refused the tile state)")
        raise ValueError(f"the quantized kernels cannot run {name}: {why}")
    return isa(lib)


def attention_tiles(lib: ctypes.CDLL, on: bool | None = None) -> bool:
    """Whether lib's attention takes its scores and P.V on AMX-BF16 tiles (TDPBF16PS), after
    turning that on or off (on=None: leaves it). Off by default: the tiles sum a dot product in the
    tile unit's own order, so their bits differ from the vector paths' by rounding (every row of the
    process on one path keeps batch invariance), and a decode row pays the tile set-up (see
    docs/benchmarks.md). Set it before the first step, as $AGENTRT_QUANT_ATTENTION_TILES=1 does.
    ValueError when on=True and this CPU or build cannot, naming why."""
    if on is None:
        return lib.agentrt_quant_attention_tiles(-1) == 1
    got = lib.agentrt_quant_attention_tiles(1 if on else 0) == 1
    if on and not got:
        missing = missing_cpu_flags(ATTENTION_TILES_CPU_FLAGS)
        lib.agentrt_quant_attention_tiles(0)
        raise ValueError("the quantized attention cannot run on AMX tiles: " + (
            f"this CPU lacks {', '.join(missing)}" if missing else
            "this build has no AMX-BF16 path, or the kernel refused the tile state"))
    return got


_march_override: str | None = None  # built_for's


@contextlib.contextmanager
def built_for(march: str) -> Iterator[ctypes.CDLL | None]:
    """Inside, quant_kernels() is the build for `march` (yielded; None where it cannot run), so
    a loaded model runs on it: a bench measures the AVX2-only build (AVX2_MARCH) on a CPU with
    AVX-512, which the native build capped at AVX2 (cap_isa) is not: its AVX2 loops are compiled
    with AVX-512's 32 vector registers. Every build gives the same bits. Not for concurrent use."""
    global _march_override
    before, _march_override = _march_override, march
    try:
        yield quant_kernels()
    finally:
        _march_override = before


def default_march() -> str:
    """What the default library is built for: built_for's CPU level inside it, else
    $AGENTRT_QUANT_MARCH (a gcc -march value), else native."""
    if _march_override is not None:
        return _march_override
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", march):
        log.warning("%s=%r is not a CPU level gcc knows the form of (x86-64-v3, skylake-avx512, ...): building "
                    "for this CPU", MARCH_ENV, march)
        return "native"
    return march


def _flags(scalar: bool, march: str) -> tuple[str, ...]:
    return CFLAGS + (f"-march={march}",) + ((SCALAR_DEFINE,) if scalar else ())


def _library_path(cc: str, scalar: bool, march: str = "native") -> Path:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((CSRC / name).read_bytes())
    h.update("\0".join([compiler_identity(cc), *_flags(scalar, march), " ".join(sorted(_cpu_flags()))]).encode())
    return kernels_cache_dir() / h.hexdigest()[:16] / "libagentrt_quant.so"


def kernels_key() -> str | None:
    """What tells these kernels' timings apart: the instruction set they run on now and their
    build's hash (sources, compiler, flags, CPU); None where they do not run. A step-cost fit
    made on other kernels prices steps that no longer exist."""
    lib = quant_kernels()
    if lib is None:
        return None
    return f"{isa(lib)}-{_library_path(_compiler(), False, default_march()).parent.name[:8]}"


def build(cc: str, target: Path, scalar: bool = False, march: str = "native") -> Path:
    """Compile the sources into `target` (written atomically: concurrent builders are safe)."""
    return compile_library(cc, _flags(scalar, march), SOURCES, target, "quantized kernels")


def _load(scalar: bool, march: str) -> ctypes.CDLL | None:
    reason = unsupported_reason()
    if reason is not None:
        log.info("agentrt quantized kernels off: %s", reason)
        return None
    cc = _compiler()
    try:
        path = _library_path(cc, scalar, march)
    except OSError as e:  # CC names no compiler: the references run (and this None is cached)
        log.warning("agentrt quantized kernels unavailable, using the PyTorch path: compiler %r: %s", cc, e)
        return None
    lib = open_library(path, lambda: build(cc, path, scalar, march), SIGNATURES, "quantized kernels")
    if lib is not None and os.environ.get(ATTENTION_TILES_ENV, "").strip() == "1":
        try:
            attention_tiles(lib, True)
            log.info("agentrt quantized attention on AMX-BF16 tiles (%s=1)", ATTENTION_TILES_ENV)
        except ValueError as e:
            log.warning("%s=1 ignored: %s", ATTENTION_TILES_ENV, e)
    cap = os.environ.get(ISA_ENV)
    if lib is not None and cap and not scalar:
        try:
            log.info("agentrt quantized kernels capped at %s by %s", cap_isa(lib, cap), ISA_ENV)
        except ValueError as e:
            log.warning("%s=%s ignored: %s", ISA_ENV, cap, e)
    return lib


def quant_kernels(scalar: bool = False, march: str | None = None) -> ctypes.CDLL | None:
    """The loaded library (built on first use), or None where it cannot run. scalar=True: a
    build of the scalar fallback path, whatever the CPU (for tests); march: a build for that CPU
    level (AVX2_MARCH: without AVX-512) instead of default_march()'s."""
    key = (scalar, march or default_march())
    if key not in _loaded:
        with _lock:
            if key not in _loaded:
                _loaded[key] = _load(*key)
    return _loaded[key]
