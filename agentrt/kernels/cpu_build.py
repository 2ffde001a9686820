"""Build, cache and load the C kernels of agentrt/kernels/csrc for this CPU.

The kernels are plain C (AVX512, AMX intrinsics) called through ctypes: no PyTorch headers, so a
build takes ~2 s with the system C compiler, once per (sources, compiler, CPU); the shared
library is cached under $AGENTRT_CACHE/kernels (default ~/.cache/agentrt/kernels) and later
starts only load it (AGENTRT_KERNELS_LIB=path loads a given build instead). They run on x86-64 CPUs with AMX-BF16 (Sapphire Rapids and later); anywhere
else, or with AGENTRT_KERNELS=0, `cpu_kernels()` returns None and callers use the PyTorch path.

Threads: the kernels run on their own fork-join workers (csrc/cpu_pool.c: spin briefly, then
sleep), not OpenMP, whose spinning joins collapse on a CPU shared with other busy processes.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("cpu_pool.c", "cpu_linear_bf16.c", "cpu_attention_bf16.c", "cpu_decoder_bf16.c", "cpu_argmax_f32.c")
HEADERS = ("cpu_common.h", "cpu_pool.h")
CFLAGS = ("-O3", "-march=native", "-pthread", "-shared", "-fPIC", "-std=gnu11")
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16")

_I64, _I32, _F32, _P = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
SIGNATURES = {
    "agentrt_amx_init": (_I32, []),
    "agentrt_linear_bf16": (None, [_P, _I64, _I64, _I64, _P, _I64, _I64, _P, _I32, _F32, _P, _I32, _P, _I64, _P, _I64, _I32,
                                   _I32]),
    "agentrt_pack_weight_bf16": (None, [_P, _I64, _I64, _I64, _P, _I64, _I32]),
    "agentrt_rotary_kv_write_bf16": (None, [_P, _I64, _I64, _I32, _I32, _I32, _P, _P, _P, _P, _P, _P, _P, _P, _I32, _F32,
                                            _I32]),
    "agentrt_decoder_layers_bf16": (None, [_P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I32, _I32, _I32, _F32, _F32,
                                           _P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I32, _I32]),
    "agentrt_argmax_f32": (None, [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I32]),
    "agentrt_paged_attention_bf16": (
        None, [_P, _I64, _I64, _P, _P, _P, _I64, _I64, _P, _P, _I32, _I32, _I32, _F32, _I64, _P, _I64, _I32, _I32]),
}

_lock = threading.Lock()
_loaded: list = []  # [lib or None] once decided


def kernels_cache_dir() -> Path:
    env = os.environ.get("AGENTRT_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "agentrt"
    return root / "kernels"


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def unsupported_reason() -> str | None:
    """Why the C kernels cannot run here, or None when they can be built."""
    if os.environ.get("AGENTRT_KERNELS", "1") == "0":
        return "disabled by AGENTRT_KERNELS=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs Linux on x86-64, this is {platform.system()} {platform.machine()}"
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return f"CPU lacks {', '.join(missing)}"
    if _compiler() is None:
        return "no C compiler (gcc or cc, or $CC) on PATH"
    return None


def _library_path(cc: str) -> Path:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((CSRC / name).read_bytes())
    h.update("\0".join([compiler_identity(cc), *CFLAGS, " ".join(sorted(_cpu_flags()))]).encode())
    return kernels_cache_dir() / h.hexdigest()[:16] / "libagentrt_cpu.so"


def compiler_identity(cc: str) -> str:
    """The compiler by its file and its arguments (CC may be "ccache gcc" or "gcc -m64"), without
    running `cc --version` on every start. OSError when it is not found."""
    argv = shlex.split(cc)
    real = Path(shutil.which(argv[0]) or argv[0]).resolve()
    st = real.stat()
    return "\0".join([str(real), str(st.st_size), str(st.st_mtime_ns), *argv[1:]])


def build(cc: str, target: Path) -> Path:
    """Compile the sources into `target` (written atomically: concurrent builders are safe)."""
    return compile_library(cc, CFLAGS, SOURCES, target, "CPU kernels")


def compile_library(cc: str, flags: tuple[str, ...], sources: tuple[str, ...], target: Path, what: str) -> Path:
    """cc flags csrc/sources -> the shared library `target`, written atomically (built under a
    temporary name, then renamed), so processes building it at once are safe."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [*shlex.split(cc), *flags, "-I", str(CSRC), *[str(CSRC / s) for s in sources], "-o", tmp, "-lm"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"building the {what} failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}")
    os.replace(tmp, target)
    return target


def open_library(path: Path, build_it: Callable[[], object], signatures: dict, what: str) -> ctypes.CDLL | None:
    """The library at path (built first by build_it when missing) with its ctypes signatures set,
    or None (logged) when it cannot be built or loaded: callers then use the PyTorch path."""
    try:
        if not path.exists():
            log.info("building agentrt %s into %s", what, path)
            build_it()
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("agentrt %s unavailable, using the PyTorch path: %s", what, e)
        return None
    for name, (res, args) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def _load() -> ctypes.CDLL | None:
    reason = unsupported_reason()
    if reason is not None:
        log.info("agentrt CPU kernels off: %s", reason)
        return None
    cc = _compiler()
    try:
        path = Path(os.environ.get("AGENTRT_KERNELS_LIB") or _library_path(cc))  # override: A/B runs
    except OSError as e:
        log.warning("agentrt CPU kernels unavailable, using the PyTorch path: compiler %r: %s", cc, e)
        return None
    lib = open_library(path, lambda: build(cc, path), SIGNATURES, "CPU kernels")
    if lib is None:
        return None
    if lib.agentrt_amx_init() != 0:
        log.warning("agentrt CPU kernels unavailable: the kernel refused AMX state to this process")
        return None
    return lib


def cpu_kernels() -> ctypes.CDLL | None:
    """The loaded kernel library (built on first use), or None where it cannot run."""
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded.append(_load())
    return _loaded[0]
