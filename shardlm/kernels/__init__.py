"""shardlm's own CPU kernels: small C files compiled into one library, called via ctypes.

No torch headers, so the library builds in a few seconds with the system C compiler: each
kernels/*.c compiled on its own, then linked together (kernels/build.py). `pip install` builds
one library per named ISA variant into kernels/prebuilt/ (setup.py), as ggml does its CPU
variants: a capped run loads its variant's, and native (the default) loads the best one where it
cannot compile for this CPU itself (no compiler at run time). Everything else is compiled at run
time and cached under the shardlm cache directory, keyed by the sources, the compiler, the ISA
variant, the machine and this CPU's flags. Every entry point is declared once in C (shardlm_kernels.h, which each file
includes, so the compiler checks the definitions) and once here for ctypes (SIGNATURES; a test
checks the two agree).
OpenMP resolves to torch's own libgomp (same soname, already loaded): one thread pool.

ISA variants, each a superset of the one before: portable (plain C, vectorized by the
compiler for the baseline), avx2 (+FMA, F16C), avx512 (F, BW, VL, DQ), avx512_bf16 (+BF16,
VNNI) and native (-march=native; the installed best named one where it cannot be compiled). The
kernels run the best one this CPU has, at most SHARDLM_CPU_ISA; the C code picks its paths by
the compiler's __AVX512F__ etc. The test-only variant amx_emulated (build.EMULATED_VARIANTS) runs
the AMX code on a plain-C model of the tiles, so that CPUs without them test it.
A library that cannot be built or loaded (no compiler, a bad CC, an unwritable cache, a compile
error) is logged once and the layers run on torch ops, unless SHARDLM_REQUIRE_KERNELS is set.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import tempfile

import torch

from shardlm import cpu_plan, envs
from shardlm.kernels import build
from shardlm.kernels import decode_abi as abi
from shardlm.kernels.build import ISA_VARIANTS
from shardlm.logger import init_logger
from shardlm.utils import cpu_flags

logger = init_logger(__name__)

_loaded: list = []          # [the library, or None], once looked up
_source: list[str] = []     # where the loaded library came from, for `shardlm env check`

# the `dtype` argument every kernel takes
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# what a KV cache holds, for the attention kernels (KV_AS_DTYPE ... in shardlm_kernels.h)
_KV_FP8_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def kv_format(cache_dtype: torch.dtype, dtype: torch.dtype) -> int | None:
    """The kernels' code for a KV cache of cache_dtype read by a model in dtype, or None where they
    cannot read it."""
    return 0 if cache_dtype == dtype else _KV_FP8_FORMATS.get(cache_dtype)

_isa_cap = [envs.SHARDLM_CPU_ISA]


def supported_isas() -> list[str]:
    """The variants this CPU can run, lowest first (native last: all it has)."""
    if not build.is_x86():
        return ["portable", "native"]
    flags = cpu_flags()
    return [name for name, (needs, _) in ISA_VARIANTS.items() if needs <= flags] + ["native"]


def active_isa() -> str:
    """The variant the kernels are built for: the best this CPU has, at most the cap."""
    cap, supported = _isa_cap[0], supported_isas()
    if cap in build.EMULATED_VARIANTS:
        return cap
    if cap == "native" or cap not in ISA_VARIANTS:
        return "native"
    order = list(ISA_VARIANTS)
    return max((v for v in supported if v in ISA_VARIANTS and order.index(v) <= order.index(cap)), key=order.index)


def best_isa() -> str:
    """The best named variant this CPU has (what native amounts to, by name)."""
    return [v for v in supported_isas() if v != "native"][-1]


def isa_cap() -> str:
    return _isa_cap[0]


def use_isa(cap: str) -> str:
    """Cap the variant from now on (tests run each kernel under each; SHARDLM_CPU_ISA at start-up):
    libraries are looked up again. -> the variant in use."""
    if cap != "native" and cap not in ISA_VARIANTS and cap not in build.EMULATED_VARIANTS:
        raise ValueError(f"SHARDLM_CPU_ISA={cap!r}: use one of {', '.join([*ISA_VARIANTS, 'native'])}.")
    if cap in build.EMULATED_VARIANTS and build.EMULATED_VARIANTS[cap][0] not in supported_isas():
        raise ValueError(f"The test-only variant {cap} builds on {build.EMULATED_VARIANTS[cap][0]}, which this CPU "
                         "lacks.")
    _isa_cap[0] = cap
    for cache in (_loaded, _functions, _blocked, _fused, _bf16_dot):
        cache.clear()
    return active_isa()


def library() -> ctypes.CDLL | None:
    """The kernel library (every kernels/*.c), or None where it cannot be built or loaded."""
    if not _loaded:
        _loaded.append(None if envs.SHARDLM_DISABLE_KERNELS else _build())
    return _loaded[0]


KERNEL_FILES = ("fused_ops", "paged_attention", "prefill_attention", "latent_attention", "skinny_matmul",
                "blocked_matmul", "llama_decode", "latent_decode")


def describe() -> dict:
    """What `shardlm env check` shows: the variant in use and the state of each kernel file's code in it."""
    ok = library() is not None
    state = {name: "ok" if ok else "unavailable (torch ops)" for name in KERNEL_FILES}
    if ok and not blocked_vector_bits():
        state["blocked_matmul"] = "not in this variant (AVX2 or AVX-512 only)"
    elif ok and blocked_vector_bits() == 256:
        state["blocked_matmul"] = "ok (AVX2: bfloat16, 4- and 8-bit panels; float32 on skinny_matmul / oneDNN)"
    return {"variant": active_isa(), "best": best_isa(), "cap": _isa_cap[0],
            "library": _source[0] if ok and _source else "none", "kernels": state}


class KernelBuildError(RuntimeError):
    """A kernel could not be built or loaded (raised only with SHARDLM_REQUIRE_KERNELS)."""


def _unavailable(why: str) -> None:
    if envs.SHARDLM_REQUIRE_KERNELS:
        raise KernelBuildError(f"The CPU kernels are unavailable: {why} (SHARDLM_REQUIRE_KERNELS is set).")
    logger.warning("The CPU kernels are unavailable: %s. The layers run on torch ops instead (on CPU several "
                   "times slower); outputs are the same.", why)


def _prebuilt_library(isa: str) -> ctypes.CDLL | None:
    """The library built at install time for `isa` (a named variant), or None where there is none
    for these sources or it does not load."""
    path = os.path.join(build.PREBUILT_DIR, build.prebuilt_name(isa))
    if not os.path.exists(path):
        return None
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        logger.warning("The installed kernel library %s does not load (%s).", path, e)
        return None
    _source.append(f"built at install time for {isa}")
    return lib


def _build() -> ctypes.CDLL | None:
    """A named variant loads the library built at install time, or else compiles it. native
    compiles for this CPU first (-march=native decoded the default model 6-10% faster in bfloat16
    than the installed avx512_bf16 library on a Zen 5) and falls back to the installed library of
    the best named variant."""
    _source.clear()
    isa = active_isa()
    lib = None if isa == "native" else _prebuilt_library(isa)
    if lib is not None:
        return lib
    lib, why = _compile_at_run_time(isa)
    if lib is not None:
        return lib
    lib = _prebuilt_library(best_isa()) if isa == "native" and best_isa() != "portable" else None
    if lib is not None:
        logger.warning("The CPU kernels could not be compiled for this CPU: %s. Using the library built at install "
                       "time for %s instead.", why, best_isa())
        return lib
    _unavailable(why)
    return None


def _compile_at_run_time(isa: str) -> tuple[ctypes.CDLL | None, str]:
    """(the library compiled for `isa` into the cache, or None; why not)."""
    cc = build.find_compiler()
    if cc is None:
        return None, "no C compiler found and no library built at install time for these sources (install gcc, or " \
                     "set CC)"
    flags = [*build.FLAGS, *build.variant_flags(isa)]
    key = hashlib.sha256(build.sources_hash().encode() + cc.encode() + " ".join(flags + build.LINK_FLAGS).encode()
                         + platform.machine().encode() + " ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
    filename = f"shardlm_kernels-{isa}-{key}.so"
    path = os.path.join(envs.SHARDLM_CACHE_DIR, "kernels", filename)
    if not os.path.exists(path):
        try:
            path = build.compile_library(cc, flags, path)
        except OSError as e:         # an unwritable or full cache: build in a private directory instead
            logger.warning("Cannot write the kernel cache %s (%s); building the kernels in a temporary directory "
                           "(again at every start).", os.path.dirname(path), e)
            try:
                path = build.compile_library(cc, flags,
                                             os.path.join(tempfile.mkdtemp(prefix="shardlm-kernels-"), filename))
            except OSError as e2:
                return None, f"{cc} could not be run or its output not written ({e2})"
        except RuntimeError as e:
            return None, str(e)
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return None, f"the built library does not load ({e})"
    _source.append(f"built at run time for {isa} (cached in {os.path.dirname(path)})")
    return lib, ""


_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_I32 = ctypes.c_int32
_to = ctypes.POINTER

# Every entry point of shardlm_kernels.h: (argument types, result type). Pointers are c_void_p,
# except those to the one-call decode step's structs (decode_abi.py).
SIGNATURES: dict[str, tuple[list, object]] = {
    "add_rmsnorm": ([_P, _I64, _P, _P, _P, _P, _I, _I, _F, _I], None),
    "silu_and_mul": ([_P, _P, _I, _I, _I], None),
    "rotary": ([_P, _I64, _P, _P, _I, _I, _I, _I], None),
    "dequantize_int4pack": ([_P, _I, _I, _I, _I, _P, _P, _I, _P, _I], None),
    "argmax_rows": ([_P, _I64, _I, _I, _I, _P], None),
    "mask_disallowed": ([_P, _I64, _P, _I, _I, _P, _I, _I], None),
    "paged_decode_attention": ([_P, _P, _I64, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _I, _I, _F, _F, _P],
                               _I),
    "paged_decode_attention_qkv": ([_P, _P, _I64, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _I,
                                    _I, _F, _F], _I),
    "paged_prefill_attention": ([_P, _P, _I64, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _F, _I,
                                 _I, _F, _F, _P], _I),
    "latent_decode_attention": ([_P, _P, _I64, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _I, _I, _F, _P], _I),
    "rotary_cache_write": ([_P, _I64, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _F, _F], None),
    "merge_attention_partials": ([_P, _I, _I, _I, _I, _I, _I, _P, _I], None),
    "skinny_matmul": ([_P, _I64, _P, _P, _P, _I, _I, _I, _I], _I),
    "blocked_vector_bits": ([], _I),
    "blocked_panel_width": ([], _I),
    "blocked_packed_size": ([_I, _I, _I], _I64),
    "blocked_pack": ([_P, _I, _I, _I, _P], None),
    "blocked_int4_size": ([_I, _I, _I, _I], _I64),
    "blocked_int4_pack": ([_P, _P, _P, _I, _I, _I, _I, _P], None),
    "blocked_int8_size": ([_I, _I, _I, _I], _I64),
    "blocked_int8_pack": ([_P, _P, _I, _I, _I, _I, _P], None),
    "blocked_fp8_pack": ([_P, _P, _I, _I, _I, _P], _I),
    "blocked_rows": ([_P, _P, _I, _I, _I, _I, _I, _I, _I, _P], None),
    "blocked_set_bf16_dot": ([_I], _I),
    "blocked_set_amx": ([_I, _I, _I], _I),
    "blocked_amx_usable": ([], _I),
    "blocked_amx_calls": ([], _I64),
    "blocked_matmul": ([_P, _I64, _P, _P, _P, _I, _I, _I, _I], _I),
    "blocked_int4_matmul": ([_P, _I64, _P, _P, _P, _I, _I, _I, _I, _I, _I], _I),
    "blocked_int8_matmul": ([_P, _I64, _P, _P, _P, _I, _I, _I, _I, _I, _I], _I),
    "blocked_fp8_matmul": ([_P, _I64, _P, _P, _P, _I, _I, _I, _I, _I], _I),
    "blocked_matmul_heads": ([_P, _I64, _I64, _P, _I64, _P, _I, _I, _I, _I, _I], _I),
    "latent_decode_scratch_elements": ([_to(abi.LatentDecodeModel), _I32], _I64),
    "latent_decode_layers": ([_to(abi.LatentDecodeModel), _to(abi.LatentDecodeLayer), _to(abi.LatentDecodeStep)],
                             _I32),
    "llama_decode_scratch_elements": ([_to(abi.LlamaDecodeModel), _I32, _I32], _I64),
    "llama_decode_layers": ([_to(abi.LlamaDecodeModel), _to(abi.LlamaDecodeLayer), _to(abi.LlamaDecodeStep),
                             _to(abi.LlamaDecodeLora), _to(abi.LlamaDecodeContextParallel)], _I32),
}
_functions: dict[str, object] = {}


def _function(name: str):
    """The library's entry point `name` with its signature set, or None (looked up once)."""
    if name not in _functions:
        lib = library()
        fn = None if lib is None else getattr(lib, name)
        if fn is not None:
            fn.argtypes, fn.restype = SIGNATURES[name]
        _functions[name] = fn
    return _functions[name]


def paged_decode_attention():
    """The paged decode attention function, or None."""
    return _function("paged_decode_attention")


def paged_prefill_attention():
    """Tiled causal attention for prompt chunks over the paged cache (prefill_attention.c), or None."""
    return _function("paged_prefill_attention")


def latent_decode_attention():
    """Decode attention for latent attention's one shared cache row per token (latent_attention.c), or None."""
    return _function("latent_decode_attention")


def paged_decode_attention_qkv():
    """Rotary + KV cache write + paged decode attention from a qkv projection, or None."""
    return _function("paged_decode_attention_qkv")


def merge_attention_partials():
    """Decode context parallel's merge of every rank's partial attention, or None."""
    return _function("merge_attention_partials")


def skinny_matmul():
    """skinny_matmul(x, x_stride, w, bias, y, M, N, K, dtype) -> 0, or -1 if out of memory
    (kernels/skinny_matmul.c); None where it cannot be built."""
    return _function("skinny_matmul")


_blocked: list = []


def blocked_vector_bits() -> int:
    """The vector width the blocked panels run at in this variant: 512 (AVX-512), 256 (AVX2), or
    0 (none: no SIMD build, or no compiler). Looked up once: every product on CPU asks."""
    if not _blocked:
        bits = _function("blocked_vector_bits")
        width = 0 if bits is None else bits()
        if width:
            use_bf16_dot(_bf16_dot_pays(_function("blocked_matmul")))
        _blocked.append(width)
    return _blocked[0]


def blocked_matmul():
    """blocked_matmul(x, x_stride, packed_w, bias, y, M, N, K, dtype) -> 0, -1 if out of memory
    (kernels/blocked_matmul.c) for float weights; None where this variant has no blocked panels."""
    return _function("blocked_matmul") if blocked_vector_bits() else None


_bf16_dot: list = []


def use_bf16_dot(on: bool) -> bool:
    """Switch bfloat16 products between the CPU's bfloat16 dot product and float32 FMAs (the
    blocked kernel and the one-call decode step share the setting; tests run both); False where
    this build lacks AVX512_BF16."""
    setter = _function("blocked_set_bf16_dot")
    return bool(setter(int(on))) if setter is not None else False


def _bf16_dot_pays(matmul) -> bool:
    """Whether bfloat16 products run faster with the CPU's bfloat16 dot product (vdpbf16ps) than
    widened to float32 FMAs: twice the multiply-adds on AMD Zen 4, none more on Intel CPUs without
    AMX. Timed once per process and variant, interleaved, on a product of this model family's
    size (a CPU plan's choice, cpu_plan.py); the answer then holds for every product, so all of
    them sum in the same order."""
    if _bf16_dot:
        return _bf16_dot[0]
    setter = _function("blocked_set_bf16_dot")
    pays = False
    if setter(1):       # built with AVX512_BF16
        pays = cpu_plan.choose("bf16_dot", f"products ({active_isa()})", lambda: _time_bf16_dot(setter, matmul))
    setter(int(pays))
    _bf16_dot.append(pays)
    return pays


def _time_bf16_dot(setter, matmul) -> tuple[bool, str]:
    from shardlm.utils import median_seconds_side_by_side
    pack_size, pack = _function("blocked_packed_size"), _function("blocked_pack")
    M, N, K = 64, 1536, 576
    w = torch.randn(N, K).to(torch.bfloat16)
    packed = torch.empty(pack_size(N, K, 1), dtype=torch.bfloat16)
    pack(w.data_ptr(), N, K, 1, packed.data_ptr())
    x, y = torch.randn(M, K).to(torch.bfloat16), torch.empty(M, N, dtype=torch.bfloat16)

    def product(on: int):
        setter(on)
        matmul(x.data_ptr(), K, packed.data_ptr(), None, y.data_ptr(), M, N, K, 1)
    # up to three rounds, the first that shows the gain deciding: on a noisy machine a slow spell
    # has made one round's medians equal on a CPU where the dot product takes half the time
    for _ in range(3):
        widened, dot = median_seconds_side_by_side(lambda: product(0), lambda: product(1), 9)
        if widened > 1.2 * dot:
            break
    return widened > 1.2 * dot, f"the dot product took {dot / widened:.2f}x widening's time on [{M}, {K}] x [{K}, {N}]"


def blocked_pack():
    """(blocked_packed_size(N, K, dtype) -> elements, blocked_pack(w, N, K, dtype, out)) for
    blocked_matmul's weight layout; None where blocked_matmul() is None."""
    if blocked_matmul() is None:
        return None
    return _function("blocked_packed_size"), _function("blocked_pack")


def blocked_int4():
    """(blocked_int4_size(N, K, group, tb) -> bytes, blocked_int4_pack(q, scales, mins, N, K, group,
    tb, out), blocked_int4_matmul(x, x_stride, packed, bias, y, M, N, K, group, tb, dtype) -> 0 / -1
    if out of memory) for 4-bit weights in blocked panels, scales and mins tb bytes each (4:
    float32, 2: float16); None where this variant has no blocked panels."""
    if not blocked_vector_bits():
        return None
    return _function("blocked_int4_size"), _function("blocked_int4_pack"), _function("blocked_int4_matmul")


def blocked_int8():
    """(blocked_int8_size(N, K, group, tb) -> bytes, blocked_int8_pack(q, scales, N, K, group, tb, out),
    blocked_int8_matmul(x, x_stride, packed, bias, y, M, N, K, group, tb, dtype) -> 0 / -1 if out of
    memory) for symmetric 8-bit weights in blocked panels; None where this variant has no blocked panels."""
    if not blocked_vector_bits():
        return None
    return _function("blocked_int8_size"), _function("blocked_int8_pack"), _function("blocked_int8_matmul")


def blocked_fp8():
    """(blocked_int8_size(N, K, group, 4) -> bytes, blocked_fp8_pack(q, scales, N, K, group, out) -> 0 / -1
    if out of memory, blocked_fp8_matmul(x, x_stride, packed, bias, y, M, N, K, group, dtype) -> 0 / -1)
    for FP8 (e4m3fn) weights in the 8-bit panels, float32 scales; in every variant (plain C loops
    where it has no vector tiles), None without the library."""
    if library() is None:
        return None
    return _function("blocked_int8_size"), _function("blocked_fp8_pack"), _function("blocked_fp8_matmul")


def blocked_rows():
    """blocked_rows(packed, index, n, K, bits, fp8, group, tb, dtype, out): rows of a weight in float or
    8-bit blocked panels (an embedding lookup in a tied LM head's table); None where this variant
    has no blocked panels."""
    return _function("blocked_rows") if blocked_vector_bits() else None


def blocked_panel_width():
    """blocked_panel_width() -> the output features per panel of blocked_matmul's layout."""
    return _function("blocked_panel_width")


def llama_decode_layers():
    """(llama_decode_scratch_elements, llama_decode_layers): a stage's Llama decoder layers for one
    decode step in one call (kernels/llama_decode.c; arguments in decode_abi.py), or None."""
    blocked_vector_bits()          # the bfloat16 product choice is made before the first step
    step = _function("llama_decode_layers")
    return None if step is None else (_function("llama_decode_scratch_elements"), step)


def latent_decode_layers():
    """(latent_decode_scratch_elements, latent_decode_layers): a stage's DeepSeek decoder layers for
    one decode step in one call (kernels/latent_decode.c), or None."""
    blocked_vector_bits()
    step = _function("latent_decode_layers")
    return None if step is None else (_function("latent_decode_scratch_elements"), step)


def blocked_matmul_heads():
    """blocked_matmul_heads(x, x_stride, x_head_stride, packed, w_head_stride, y, heads, M, N, K, dtype):
    a blocked product per head into y [heads, M, N] (latent attention's up-projections), or None."""
    return _function("blocked_matmul_heads") if blocked_vector_bits() else None


_fused: list = []


def fused_ops() -> ctypes.CDLL | None:
    """The library with add_rmsnorm, silu_and_mul, rotary, dequantize_int4pack, argmax_rows and
    mask_disallowed (kernels/fused_ops.c) ready to call, or None."""
    if not _fused:
        names = ("add_rmsnorm", "silu_and_mul", "rotary", "dequantize_int4pack", "argmax_rows", "mask_disallowed")
        _fused.append(library() if all(_function(n) is not None for n in names) else None)
    return _fused[0]
