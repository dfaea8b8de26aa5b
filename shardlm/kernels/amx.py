"""bfloat16 products on the AMX tiles of Intel Xeons (kernels/blocked_matmul.c: amx_panels over
float panels, amx_integer_panels over 8-bit (int8, FP8) and 4-bit ones): whether
this process can use them, and from how many rows, a CPU plan's choice timed once per process.

AMX sums a tile in an order no vector tile has (docs/USER_GUIDE.md, "CPU performance notes"), while
a row's AMX sums do not depend on the other rows of its tile nor on how many it has. So under
--batch-invariant (the default) a kind of weight runs on the tiles at every row count or at none:
at every one where one row costs at most ONE_ROW_TOLERANCE times the vector tiles' time on a 64 MB
weight, streamed past the cores' own caches as a decode step's weights are. With
--no-batch-invariant, from the fewest rows (8 to 64) where the tiles are MANY_ROWS_GAIN times
faster."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlm import cpu_plan, kernels

ONE_ROW_TOLERANCE = 1.03
MANY_ROWS_GAIN = 1.2
GROUP = 32           # the 8- and 4-bit weights timed: groups of 32 columns (GGUF's), float32 tables
# the weights [N, K] timed: for one row, 64-72 MB with their tables (past the cores' own caches,
# from a shared L3 or memory, as a decode step's weights come); for many rows, an MLP of the
# default model
ONE_ROW_WEIGHTS = {"bfloat16": (16384, 2048), "eight_bit": (32768, 2048), "four_bit": (49152, 2048)}
KINDS = {"bfloat16": "bfloat16 products", "eight_bit": "8-bit products (bfloat16 x)",
         "four_bit": "4-bit products (bfloat16 x)"}
MANY_ROWS_WEIGHT = (1536, 576)


@dataclass(frozen=True)
class AmxRows:
    """The fewest rows of a product on the AMX tiles, per kind of weight (0: never)."""
    bfloat16: int = 0        # bfloat16 panels (K a multiple of 32)
    eight_bit: int = 0       # int8 and FP8 panels of a bfloat16 model (groups a multiple of 32)
    four_bit: int = 0        # 4-bit panels of a bfloat16 model (groups a multiple of 32)


def _function(name: str):
    """A kernel of the AMX choice, or None where this variant has no blocked panels."""
    return kernels._function(name) if kernels.blocked_vector_bits() else None


def use(rows: AmxRows) -> bool:
    """Products on the AMX tiles from these rows on, where this build has them and the OS grants
    them; False where not."""
    setter = _function("blocked_set_amx")
    return setter is not None and setter(rows.bfloat16, rows.eight_bit, rows.four_bit) == 1


def off() -> bool:
    """No product on the AMX tiles; -> whether they could be used."""
    return use(AmxRows())


def calls() -> int:
    """How many products have run on the AMX tiles in this process."""
    count = _function("blocked_amx_calls")
    return count() if count is not None else 0


def cpu_has_tiles() -> bool:
    return "amx" in kernels.supported_isas()


def unavailable() -> str | None:
    """Why products cannot run on the AMX tiles here, or None where they can."""
    usable = _function("blocked_amx_usable")
    state = usable() if usable is not None else 0
    if state == 1:
        return None
    if state == -1:
        return "the OS refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: Linux 5.16 or newer)"
    if not cpu_has_tiles():
        return "this CPU has no AMX tiles"
    return f"the kernel library in use ({kernels.active_isa()}) has no AMX code"


def _product(kind: str, N: int, K: int, rows: int):
    """A product of `rows` bfloat16 rows with a weight [N, K] of `kind` (an AmxRows field) in its
    panels: a call that runs it. The weight's values do not change the time: a constant."""
    x, y = torch.randn(rows, K).to(torch.bfloat16), torch.empty(rows, N, dtype=torch.bfloat16)
    if kind == "bfloat16":
        size, _ = kernels.blocked_pack()
        packed = torch.full((size(N, K, 1),), 0.5, dtype=torch.bfloat16)
        matmul = kernels.blocked_matmul()
        return lambda: matmul(x.data_ptr(), K, packed.data_ptr(), None, y.data_ptr(), rows, N, K, 1)
    size, _, matmul = kernels.blocked_int8() if kind == "eight_bit" else kernels.blocked_int4()
    packed = torch.full((size(N, K, GROUP, 4),), 0x3c, dtype=torch.uint8)      # tables 0.0115
    return lambda: matmul(x.data_ptr(), K, packed.data_ptr(), None, y.data_ptr(), rows, N, K, GROUP, 4, 1)


def _tiles_against_vectors(kind: str, N: int, K: int, rows: int) -> float:
    """The AMX tiles' median time over the vector tiles', interleaved."""
    from shardlm.utils import median_seconds_side_by_side
    run = _product(kind, N, K, rows)
    on = AmxRows(**{kind: 1})

    def tiles():
        use(on)
        run()

    def vectors():
        off()
        run()
    tiles_s, vectors_s = median_seconds_side_by_side(tiles, vectors, 9)
    return tiles_s / vectors_s


def _one_row(kind: str) -> tuple[int, str]:
    N, K = ONE_ROW_WEIGHTS[kind]
    ratio = _tiles_against_vectors(kind, N, K, 1)
    within = ratio <= ONE_ROW_TOLERANCE
    return int(within), (f"one row took {ratio:.2f}x the vector tiles' time on a [{N}, {K}] weight past the caches "
                         f"({'within' if within else 'over'} {ONE_ROW_TOLERANCE}x)")


def _many_rows(kind: str) -> tuple[int, str]:
    for rows in (8, 16, 32, 64):
        ratio = _tiles_against_vectors(kind, *MANY_ROWS_WEIGHT, rows)
        if ratio * MANY_ROWS_GAIN < 1:
            return rows, f"AMX took {ratio:.2f}x the vector tiles' time at {rows} rows"
    return 0, f"AMX was not {MANY_ROWS_GAIN}x faster at up to 64 rows"


def kinds_of(quantization) -> tuple[str, ...]:
    """The kinds of weight a model's products may have, by its QuantizationConfig (None: float):
    bfloat16 always (what stays float: the LM head, adapters), a GGUF file's 8- and 4-bit blocks
    (Q4_K_M keeps Q6_K and Q8_0 tensors beside its Q4_K ones)."""
    if quantization is None:
        return ("bfloat16",)
    if quantization.method == "gguf":
        return tuple(KINDS)
    return ("bfloat16", "eight_bit" if quantization.bits == 8 else "four_bit")


def choose(batch_invariant: bool, kinds: tuple[str, ...] = tuple(KINDS)) -> AmxRows:
    """The rows from which each of these kinds of weight runs on the AMX tiles (the others: never;
    AmxRows() where the tiles cannot be used); AMX left off after."""
    if unavailable():
        return AmxRows()
    measure = _one_row if batch_invariant else _many_rows
    rows = AmxRows(**{kind: cpu_plan.choose("amx_rows", plan_key(kind, batch_invariant),
                                            lambda kind=kind: measure(kind))
                      for kind in kinds})
    off()
    return rows


def plan_key(kind: str, batch_invariant: bool) -> str:
    """The CPU plan's key of the choice for a kind of weight (AmxRows' field names)."""
    return f"{KINDS[kind]}, {'batch-invariant' if batch_invariant else 'from many rows'} ({kernels.active_isa()})"


def describe(rows: AmxRows, batch_invariant: bool) -> str:
    """What the start-up log says of the choice."""
    def one(name: str, n: int) -> str:
        if batch_invariant:
            return f"{name} {'at every row count' if n else 'none (one row was slower there)'}"
        return f"{name} {f'from {n} rows' if n else 'none (not faster here)'}"
    return "; ".join([one("bfloat16 weights", rows.bfloat16), one("8-bit weights", rows.eight_bit),
                      one("4-bit weights", rows.four_bit)])
