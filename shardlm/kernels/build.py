"""Compiling the kernel library: its sources, the ISA variants and their flags, the compile.

Standard library only: setup.py loads this file by path to build one library per named variant
at install time (into kernels/prebuilt/, named by the sources' hash, so an editable checkout
whose sources changed since never loads a stale one), and kernels/__init__.py calls it to
build at run time where no prebuilt library fits.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
PREBUILT_DIR = os.path.join(HERE, "prebuilt")
# fast-math for vectorized expf (glibc's libmvec); finite-math stays off: -inf is used as a mask value.
# Compiled and linked in two steps: a fast-math *link* adds crtfastmath.o, which turns on
# flush-to-zero for the whole process that loads the library (torch's numerics included).
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-fno-strict-aliasing", "-ffast-math", "-fno-finite-math-only"]
LINK_FLAGS = ["-shared", "-fopenmp"]

# ISA variant -> (the /proc/cpuinfo flags it needs, its compiler flags), lowest first; x86-64 only.
# Each adds these to the one before.
_ISA_STEPS = (("portable", set(), []),
              ("avx2", {"avx2", "fma", "f16c"}, ["-mavx2", "-mfma", "-mf16c"]),
              ("avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
               ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]),
              ("avx512_bf16", {"avx512_bf16", "avx512_vnni"}, ["-mavx512bf16", "-mavx512vnni"]),
              ("amx", {"amx_tile", "amx_bf16"}, ["-mamx-tile", "-mamx-bf16"]))
ISA_VARIANTS: dict[str, tuple[set[str], list[str]]] = {}
for _name, _needs, _flags in _ISA_STEPS:
    _below = list(ISA_VARIANTS.values())[-1] if ISA_VARIANTS else (set(), [])
    ISA_VARIANTS[_name] = (_below[0] | _needs, _below[1] + _flags)

# Test-only variants, never installed nor chosen by themselves: name -> (the variant they build on,
# their extra flags). amx_emulated runs the AMX code paths on a plain-C model of the tiles
# (amx_emulated.h), so that CPUs without AMX test them too.
EMULATED_VARIANTS = {"amx_emulated": ("avx512_bf16", ["-DSHARDLM_EMULATE_AMX"])}


def is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def find_compiler() -> str | None:
    """The C compiler: $CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def variant_flags(isa: str) -> list[str]:
    """Compiler flags of a variant: native is all this CPU has; a named variant is exactly its
    instructions (tuned generically: a prebuilt library may run on another CPU)."""
    if isa == "native":
        return ["-march=native"]
    if isa in EMULATED_VARIANTS:
        base, extra = EMULATED_VARIANTS[isa]
        return [*variant_flags(base), *extra]
    if not is_x86():
        return []
    return ["-march=x86-64", *ISA_VARIANTS[isa][1]]


def sources() -> list[str]:
    return sorted(glob.glob(os.path.join(HERE, "*.c")))


@functools.cache
def sources_hash() -> str:
    """What the library is compiled from: every kernels/*.c and *.h (read once per process)."""
    digest = hashlib.sha256()
    for path in sources() + sorted(glob.glob(os.path.join(HERE, "*.h"))):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def prebuilt_name(isa: str) -> str:
    return f"shardlm_kernels-{isa}-{sources_hash()}.so"


def prebuilt_variants() -> list[str]:
    """The variants built at install time: every named one on x86-64, the portable one elsewhere."""
    return list(ISA_VARIANTS) if is_x86() else ["portable"]


def compile_library(cc: str, flags: list[str], path: str, workers: int | None = None) -> str:
    """Compiles each source (`workers` at once; default: one per CPU), then links them into the
    shared library at path (atomically: concurrent builders agree). Raises OSError where cc cannot
    run or path cannot be written, RuntimeError on a compile error."""
    out_dir = os.path.dirname(path)
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    objects = [f"{tmp}.{os.path.basename(src)}.o" for src in sources()]

    def compile_one(src_obj: tuple[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run([cc, *flags, "-c", src_obj[0], "-o", src_obj[1]], capture_output=True, text=True)

    try:
        with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
            results = list(pool.map(compile_one, zip(sources(), objects)))
        for src, result in zip(sources(), results):
            if result.returncode != 0:
                raise RuntimeError(f"{cc} failed to compile {os.path.basename(src)}:\n{result.stderr[-2000:]}")
        result = subprocess.run([cc, *LINK_FLAGS, *objects, "-o", tmp, "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed to link the kernels:\n{result.stderr[-2000:]}")
        os.chmod(tmp, 0o755)        # the linker keeps mkstemp's owner-only mode (0711): others could not load it
        os.replace(tmp, path)
        return path
    finally:
        for leftover in (*objects, tmp):
            if os.path.exists(leftover):
                os.unlink(leftover)


def build_through_cache(cc: str, flags: list[str], path: str, workers: int | None = None) -> str:
    """compile_library, through a cache of install-time builds ($SHARDLM_CACHE_DIR/kernels/install,
    as ccache): installing the same sources again with the same compiler and flags (an editable
    reinstall, a wheel built beside it) copies the library instead of compiling it, 30 s or more
    on two cores. A cache that cannot be read or written changes nothing but the time."""
    cached = os.path.join(_cache_dir(), "kernels", "install",
                          f"{os.path.basename(path).removesuffix('.so')}-{_compile_key(cc, flags)}.so")
    if os.path.isfile(cached):
        try:
            return _copy_atomically(cached, path)
        except OSError:
            pass
    compile_library(cc, flags, path, workers)
    try:
        _copy_atomically(path, cached)
    except OSError:
        pass
    return path


def _cache_dir() -> str:
    """envs.SHARDLM_CACHE_DIR (this file imports nothing of shardlm's: setup.py loads it alone)."""
    return os.environ.get("SHARDLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shardlm")


def _compile_key(cc: str, flags: list[str]) -> str:
    """What else than the sources decides the library: the compiler (its file and its version),
    the flags and the machine's architecture."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    what = [os.path.realpath(shutil.which(cc) or cc), version, *flags, *LINK_FLAGS, platform.machine()]
    return hashlib.sha256("\0".join(what).encode()).hexdigest()[:16]


def _copy_atomically(source: str, path: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        shutil.copyfile(source, tmp)
        shutil.copymode(source, tmp)       # readable by every user, as the library built (not mkstemp's 0600)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def build_prebuilt(cc: str, out_dir: str) -> dict[str, str]:
    """Builds every prebuilt variant into out_dir (install time), several at once (the CPUs shared
    between variants and their sources): variant -> path, or -> the reason it was not built. Never
    raises: a machine that cannot build them compiles at run time."""
    variants = prebuilt_variants()
    cpus = os.cpu_count() or 1
    at_once = min(len(variants), cpus)

    def build_one(isa: str) -> str:
        try:
            return build_through_cache(cc, [*FLAGS, *variant_flags(isa)], os.path.join(out_dir, prebuilt_name(isa)),
                                       workers=max(1, cpus // at_once))
        except (OSError, RuntimeError) as e:
            return f"not built: {str(e).splitlines()[0]}"

    with ThreadPoolExecutor(max_workers=at_once) as pool:
        return dict(zip(variants, pool.map(build_one, variants)))
