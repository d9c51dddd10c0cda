"""Our CPU kernels (`cpu_kernels.c`): fp32 rows times bf16 weights packed once, attention, a
whole decoder pass in one call (`FusedDecoder`), a DSpark drafter's context step (`FusedContext`),
argmax, the logit of a distribution's top probability, and a seeded request's Gumbel-max token;
on AMX-INT8 CPUs also 4- and 8-bit weights in the GGUF's own blocks (`Q4Weight`, `Q8Weight`:
`--dtype int4`), each matmul's input quantized to int8.

What it owns: choosing the instruction set the kernels are built for (`isa()`: the best this CPU
has, from /proc/cpuinfo), compiling the C kernels for it with the system's `gcc` (once per kernel
source, compiler and flags, cached under `$DSPARK_TRT_CACHE/kernels`), packing a weight into the
kernel's layout (one layout for every ISA), describing a model's weights to the C side, and the
calls. What it does not: deciding when to use them (`models/linear.py`, `models/target.py`,
`models/drafter.py` and the proposer do), or owning the weights and caches it reads and writes.

Why: measured on this project's 2-core CPUs (SmolLM2-135M's 121 matrices plus the LM head),
one step over 1 / 2 / 8 / 16 rows cost 22 / 53 / 55 / 69 ms in fp32 through numpy's OpenBLAS
and 37 / 36 / 46 / 68 ms in bf16 through oneDNN with pre-packed weights (`_linear_pointwise`):
neither is flat in the row count, and oneDNN at one row is far from the memory-bandwidth
floor. This kernel reads every weight byte once per call whatever the row count, so
verifying a block costs about what decoding one token costs (`benchmarks/matmul_kernels.py`).
The attention kernel computes each (token, head) over exactly its visible keys in one fixed
order, so it too is batch invariant (and it avoids ~0.1 ms of thread wake-up per small torch
matmul in a decode step).

Numerics: weight-only bf16. The weights are rounded to bf16 once; activations stay fp32 and
each output is one fp32 FMA chain over k in order. A row's result never depends on the other
rows (batch invariant by construction), nor on the number of threads (each thread owns whole
columns). The AMX build differs in one thing: each matmul's input is rounded to bf16 (what the
tiles multiply), with fp32 accumulation; it is batch invariant too (a row's tile products never
mix rows), but not bit-identical to the FMA builds.

ISAs: one C source, built per instruction set (`ISAS`): `amx` (AMX-BF16 tiles for the matmuls,
AVX-512 for the rest: Intel Sapphire Rapids and later Xeons), `avx512` (AVX-512 F and BW: Intel
Skylake-SP and later server CPUs, AMD Zen 4 and later) or `avx2` (AVX2 and FMA: Intel Haswell and
later, AMD Zen 1-3, most laptops and desktops). Why all three: without the kernels the engine
falls back to oneDNN, slower at every row count, so an AVX2-only CPU would lose the bf16 engine;
and at 4-16 rows the FMA builds are bound by their multiply rate, which AMX's tiles lift ~10x
(an 8-token step 1.6x a one-token step with FMAs, 1.1x with AMX, on a Sapphire Rapids Xeon). The
AVX-512 and AVX2 builds give bit-identical results (the same operations in the same order;
`tests/test_bf16.py` checks it), so a cache or a comparison never depends on which of them ran.
One is picked per process, at the first use: the best the CPU has (falling back to the next when
a build or the AMX tile permission fails), or the one `DSPARK_TRT_KERNEL_ISA` (`auto`, the
default, | `amx` | `avx512` | `avx2`) forces (to test or measure a build on a CPU that has a
better one); a forced ISA the CPU lacks leaves the kernels unavailable, with the reason. Needs `gcc` (or `$CC`) too;
`available()` says why not otherwise, and callers fall back to oneDNN. Set
`DSPARK_TRT_BF16_KERNEL=off` to force that fallback (for comparisons).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_trt.kernels import huge_pages
from dspark_trt.kernels.build_cache import CompileError, built

SOURCE = Path(__file__).with_name("cpu_kernels.c")
GROUP_COLUMNS = 64  # the matmul kernel's column group (cpu_kernels.c)
AMX_K = 32  # the AMX build pads K to whole tile rows of 32 bf16 (cpu_kernels.c)


@dataclass(frozen=True)
class Isa:
    cpu_flags: tuple[str, ...]  # what /proc/cpuinfo must list
    compile_flags: tuple[str, ...]


# Best first. amx: the AVX-512 build with its matmuls on AMX tiles (bf16 matmul inputs: see the C
# source); avx512: F (the FMAs) and BW (the 16-bit shuffles that widen bf16 weights).
ISAS = {
    "amx": Isa(("amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx512bw"),
               ("-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8")),
    "avx512": Isa(("avx512f", "avx512bw"), ("-mavx512f", "-mavx512bw")),
    "avx2": Isa(("avx2", "fma"), ("-mavx2", "-mfma")),
}
ISA_VARIABLE = "DSPARK_TRT_KERNEL_ISA"


def compile_flags(isa: str) -> list[str]:
    return ["-O3", *ISAS[isa].compile_flags, "-pthread", "-shared", "-fPIC"]


_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_unavailable_reason: str | None = None
_isa: str | None = None
_layout: str | None = None  # how PackedWeight lays out weights for the loaded build


def _cpu_flags() -> set[str]:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(flags.split(":", 1)[-1].split())


def choose_isa(wanted: str | None = None, cpu_flags: set[str] | None = None) -> tuple[str | None, str | None]:
    """(the ISA to build, None) or (None, why none): `wanted` (default `$DSPARK_TRT_KERNEL_ISA`,
    `auto` when unset) is `auto` (the best of `ISAS` the CPU has) or one ISA's name."""
    wanted = (os.environ.get(ISA_VARIABLE, "") if wanted is None else wanted).strip().lower() or "auto"
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    if wanted == "auto":
        present = supported_isas(flags)
        if present:
            return present[0], None
        # an ISA that needs another's flags and more (amx over avx512) adds nothing to the reason
        least = [isa for isa in ISAS.values()
                 if not any(set(other.cpu_flags) < set(isa.cpu_flags) for other in ISAS.values())]
        return None, "this CPU has neither " + " nor ".join(" and ".join(isa.cpu_flags) for isa in least)
    if wanted not in ISAS:
        return None, f"{ISA_VARIABLE}={wanted!r} is none of auto, {', '.join(ISAS)}"
    missing = [flag for flag in ISAS[wanted].cpu_flags if flag not in flags]
    if missing:
        return None, f"{ISA_VARIABLE}={wanted} asks for an ISA this CPU lacks (no {', '.join(missing)})"
    return wanted, None


def supported_isas(cpu_flags: set[str] | None = None) -> list[str]:
    """Every ISA build of `ISAS` this CPU can run, best first (benchmarks measure each)."""
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    return [name for name, isa in ISAS.items() if set(isa.cpu_flags) <= flags]


def _compile(compiler: str, isa: str) -> Path:
    """The shared library for `isa`, built once per (source, compiler, flags) (`build_cache.py`)."""
    try:
        return built(SOURCE, [compiler, *compile_flags(isa), str(SOURCE), "-lm"], f"cpu_kernels-{isa}", ".so", compiler)
    except CompileError as exc:
        raise RuntimeError(str(exc)) from None


_pointer = ctypes.c_void_p


class _DecoderLayer(ctypes.Structure):  # decoder_layer in cpu_kernels.c
    _fields_ = [(name, _pointer) for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "qkv", "o", "gate_up",
                                              "down", "qkv_bias", "o_bias")]


class _DecoderModel(ctypes.Structure):  # decoder_model
    _fields_ = [*((name, ctypes.c_long) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim",
                                                     "intermediate", "vocab")),
                ("eps", ctypes.c_float), ("layers", ctypes.POINTER(_DecoderLayer)), ("final_norm", _pointer),
                ("lm_head", _pointer), ("layer_format", ctypes.c_long), ("head_format", ctypes.c_long)]


class _ContextModel(ctypes.Structure):  # context_model
    _fields_ = [*((name, ctypes.c_long) for name in ("num_layers", "hidden", "kv_heads", "head_dim", "num_features")),
                ("eps", ctypes.c_float), ("feature_norms", _pointer), ("project", _pointer), ("context_norm", _pointer),
                ("kv", ctypes.POINTER(_pointer)), ("layer_norms", _pointer)]


class _DecoderCall(ctypes.Structure):  # decoder_call
    _fields_ = [("tokens", ctypes.c_long), ("slots", _pointer), ("positions", _pointer), ("visible", _pointer),
                ("keys", _pointer),
                ("values", _pointer), ("layer_stride", ctypes.c_long), ("slot_stride", ctypes.c_long),
                ("head_stride", ctypes.c_long), ("rope_cos", _pointer), ("rope_sin", _pointer),
                ("feature_layers", _pointer), ("num_features", ctypes.c_long), ("features", _pointer),
                ("logit_rows", _pointer), ("num_logits", ctypes.c_long), ("logits", _pointer), ("normed", _pointer)]


def _open(compiler: str, isa: str) -> ctypes.CDLL:
    """The `isa` build, loaded, its entry points typed and its thread pool started (RuntimeError
    or OSError when it does not build, load or start here)."""
    library = ctypes.CDLL(str(_compile(compiler, isa)))
    library.dspark_kernel_isa.restype = ctypes.c_char_p
    built = library.dspark_kernel_isa().decode()
    if built != isa:
        raise RuntimeError(f"asked for {isa}, the source built {built}")
    if library.dspark_kernel_init() != 0:  # AMX: Linux must grant the tile state (kernels >= 5.16)
        raise RuntimeError(f"the {isa} build cannot start here (Linux refused the AMX tile state)")
    void, long_ = ctypes.c_void_p, ctypes.c_long
    library.dspark_bf16_gemm.argtypes = [void, long_, long_, void, long_, long_, void, long_, void]
    library.dspark_bf16_gemm.restype = None
    library.dspark_q4_available.restype = ctypes.c_int
    library.dspark_q4_gemm.argtypes = [void, long_, long_, void, long_, long_, void, long_, void]
    library.dspark_q4_gemm.restype = ctypes.c_int
    library.dspark_q8_gemm.argtypes = [void, long_, long_, void, long_, long_, void, long_, void]
    library.dspark_q8_gemm.restype = ctypes.c_int
    library.dspark_attention.argtypes = [void, long_, long_, long_, long_, long_, void, void, long_, long_,
                                         void, void, ctypes.c_float, void, long_]
    library.dspark_attention.restype = ctypes.c_int
    library.dspark_decoder_forward.argtypes = [ctypes.POINTER(_DecoderModel), void, ctypes.POINTER(_DecoderCall)]
    library.dspark_decoder_forward.restype = ctypes.c_int
    library.dspark_drafter_context.argtypes = [ctypes.POINTER(_ContextModel), void, long_, void, void,
                                               void, void, void, void, long_, long_, long_]
    library.dspark_drafter_context.restype = ctypes.c_int
    library.dspark_argmax.argtypes = [void, long_, long_, long_, void]
    library.dspark_argmax.restype = None
    library.dspark_top_probability_logit.argtypes = [void, long_, long_, long_, ctypes.c_float, void]
    library.dspark_top_probability_logit.restype = None
    library.dspark_draft_slot.argtypes = [void, long_, long_, long_, void, void, void, void, void, long_, void, void,
                                          long_, ctypes.c_float]
    library.dspark_draft_slot.restype = None
    library.dspark_gumbel_argmax.argtypes = [void, long_, long_, long_, void, void, void, void]
    library.dspark_gumbel_argmax.restype = ctypes.c_int
    library.dspark_gumbel_noise.argtypes = [ctypes.c_uint64, void, long_, void]
    library.dspark_gumbel_noise.restype = None
    library.dspark_start_threads.argtypes = [ctypes.c_int]
    library.dspark_start_threads.restype = ctypes.c_int
    library.dspark_start_threads(torch.get_num_threads())  # as many as PyTorch uses
    return library


def _load() -> ctypes.CDLL | None:
    global _library, _unavailable_reason, _isa, _layout
    if _library is not None or _unavailable_reason is not None:  # decided: no lock on the hot path
        return _library
    with _lock:
        if _library is not None or _unavailable_reason is not None:
            return _library
        isa, why_not = choose_isa()
        if os.environ.get("DSPARK_TRT_BF16_KERNEL", "").lower() in ("off", "0", "false", "no"):
            _unavailable_reason = "turned off by DSPARK_TRT_BF16_KERNEL"
        elif isa is None:
            _unavailable_reason = why_not
            if os.environ.get(ISA_VARIABLE, "auto").strip().lower() != "auto":  # asked for: say so loudly
                warnings.warn(f"our CPU kernels are off: {why_not}", RuntimeWarning, stacklevel=3)
        elif (compiler := shutil.which(os.environ.get("CC", "gcc"))) is None:
            _unavailable_reason = "no C compiler (gcc) to build it"
        else:
            # `auto` falls back to the next build the CPU runs when one cannot build or start here
            # (an older gcc without AMX, a kernel that withholds the tile state); a forced one does not.
            forced = os.environ.get(ISA_VARIABLE, "auto").strip().lower() not in ("", "auto")
            candidates = [isa] if forced else supported_isas()
            failures = []
            library = None
            for candidate in candidates:
                try:
                    library = _open(compiler, candidate)
                    break
                except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
                    failures.append(f"it did not build for {candidate}: {exc}")
            if library is None:
                _unavailable_reason = "; ".join(failures)
            else:
                # `_library` last: the lock-free check above hands it out at once, and a weight packed
                # before `_layout` is set would get the other build's layout
                _layout = "pairs" if library.dspark_weight_layout() == 1 else "widened"
                _isa, _library = candidate, library
        return _library


def available() -> bool:
    """Whether the kernel runs here (compiles it on first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when it is True)."""
    _load()
    return _unavailable_reason


def isa() -> str | None:
    """The instruction set the loaded kernels were built for (`amx`, `avx512`, `avx2`), None when they
    are not available (compiles them on first call)."""
    _load()
    return _isa


def _widen_order() -> torch.Tensor:
    """Which column of a 32-column block each packed position holds (see `vf_widen32` in the C
    source): in 128-bit lane L (8 values), the first 4 are columns 4L.., the last 4 columns 16 + 4L..
    The same for every ISA: AVX-512 widens the 4 lanes at once, AVX2 two at a time."""
    return torch.tensor([4 * lane + i if i < 4 else 16 + 4 * lane + i - 4 for lane in range(4) for i in range(8)])


WIDEN_ORDER = _widen_order()
UNWIDEN_ORDER = torch.argsort(WIDEN_ORDER)


class PackedWeight:
    """A weight `[in, out]` rounded to bf16 in the loaded build's layout (needs `available()`):
    the FMA builds' `[ceil(out / 64), in, 64]` (each 32 columns in `WIDEN_ORDER`), or the AMX
    build's `[ceil(out / 64), in' / 2, 64, 2]` (k-pairs, in' = in rounded up to 32, zeros past it)."""

    def __init__(self, weight_t: torch.Tensor):
        _load()
        in_features, out_features = weight_t.shape
        self.in_features, self.out_features, self.layout = in_features, out_features, _layout
        groups = -(-out_features // GROUP_COLUMNS)
        rows = -(-in_features // AMX_K) * AMX_K if self.layout == "pairs" else in_features
        padded = torch.zeros(rows, groups * GROUP_COLUMNS, dtype=torch.bfloat16)
        padded[:in_features, :out_features] = weight_t.detach().to(torch.bfloat16)
        if self.layout == "pairs":  # [in', G * 64] -> [G, in' / 2, 64, 2]
            packed = padded.view(rows // 2, 2, groups, GROUP_COLUMNS).permute(2, 0, 3, 1)
        else:
            blocks = padded.view(in_features, groups, GROUP_COLUMNS // 32, 32)[..., WIDEN_ORDER]
            packed = blocks.reshape(in_features, groups, GROUP_COLUMNS).transpose(0, 1)
        self.data = huge_pages.place(packed)  # streamed once a step: in 2 MB pages, ~500x fewer page walks

    def unpack(self) -> torch.Tensor:
        """The bf16 weight `[in, out]` this holds (for readers that need it dense)."""
        if self.layout == "pairs":
            groups, pairs = self.data.shape[:2]
            dense = self.data.permute(1, 3, 0, 2).reshape(2 * pairs, groups * GROUP_COLUMNS)
            return dense[: self.in_features, : self.out_features]
        blocks = self.data.transpose(0, 1).reshape(self.in_features, -1, GROUP_COLUMNS // 32, 32)[..., UNWIDEN_ORDER]
        return blocks.reshape(self.in_features, -1)[:, : self.out_features]

    def num_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def rounds_matmul_inputs() -> bool:
    """Whether the loaded build rounds each matmul's input to bf16 (the AMX build) rather than
    multiplying the fp32 activations (the FMA builds)."""
    _load()
    return _layout == "pairs"


def matmul_inputs(x: torch.Tensor) -> torch.Tensor:
    """What the loaded build's matmuls multiply the weights by: `x`, or `x` rounded to bf16 (AMX).
    A reference for our matmuls starts from this."""
    return x.bfloat16().to(x.dtype) if rounds_matmul_inputs() else x


def matmul(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x [rows, in]` (fp32, CPU) @ weight (+ bias `[out]`) -> `[rows, out]` fp32. Needs `available()`."""
    rows, in_features = x.shape
    if in_features != weight.in_features:
        raise ValueError(f"x has {in_features} columns but the weight has {weight.in_features} rows")
    if x.stride(1) != 1 or x.dtype != torch.float32:
        x = x.float().contiguous()
    out = torch.empty(rows, weight.out_features, dtype=torch.float32)
    if rows:
        if bias is not None:
            bias = bias.detach().float().contiguous()
        _library.dspark_bf16_gemm(x.data_ptr(), rows, x.stride(0), weight.data.data_ptr(), in_features,
                                  weight.out_features, out.data_ptr(), weight.out_features,
                                  None if bias is None else bias.data_ptr())
    return out


Q4_BLOCK = 32  # inputs per Q4_1 block (cpu_kernels.c)


_q4_available: bool | None = None  # decided once, like the build it depends on


def q4_available() -> bool:
    """Whether the loaded build runs 4-bit weights (`--dtype int4`): the AMX build, on a CPU with
    AMX-INT8 (Intel Sapphire Rapids and later)."""
    global _q4_available
    if _q4_available is None:  # the AMX build compiles it; the CPU must also have AMX's int8 tiles
        library = _load()
        _q4_available = library is not None and library.dspark_q4_available() == 1 and "amx_int8" in _cpu_flags()
    return _q4_available


def q4_unavailable_reason() -> str | None:
    """Why `--dtype int4` cannot run here (None when it can)."""
    if q4_available():
        return None
    if _load() is None:
        return f"our CPU kernels are off here: {unavailable_reason()}"
    return (f"4-bit weights run on AMX-INT8 tiles (Intel Xeon Sapphire Rapids or later); this CPU runs the "
            f"{isa()} build")


def _blocks(weight_t: torch.Tensor) -> torch.Tensor:
    """`[in, out]` -> fp32 `[ceil(in / 32), 32, out rounded up to 64]`: blocks of 32 inputs per
    column, zeros past the weight (whole column groups, whole blocks)."""
    in_features, out_features = weight_t.shape
    blocks, groups = _block_shape(in_features, out_features)
    w = torch.zeros(blocks * Q4_BLOCK, groups * GROUP_COLUMNS)
    w[:in_features, :out_features] = weight_t.detach().float()
    return w.view(blocks, Q4_BLOCK, groups * GROUP_COLUMNS)


def _b_tiles(q: torch.Tensor) -> torch.Tensor:
    """Quantized blocks `[blocks, 32, G * 64]` -> AMX's int8 B tiles `[G, blocks, 4 tiles, 8 rows, 64]`:
    byte b of row r of tile t is q[block, 4 r + b % 4, 64 g + 16 t + b // 4]."""
    blocks, groups = q.shape[0], q.shape[2] // GROUP_COLUMNS
    return q.view(blocks, 8, 4, groups, 4, 16).permute(3, 0, 4, 1, 5, 2).reshape(groups, blocks, 4, 8, 64)


def _from_b_tiles(tiles: torch.Tensor, blocks: int, groups: int) -> torch.Tensor:
    """`_b_tiles`' inverse: bytes in its order -> `[blocks, 32, G * 64]`."""
    return tiles.reshape(groups, blocks, 4, 8, 16, 4).permute(1, 3, 5, 0, 2, 4).reshape(blocks, Q4_BLOCK, -1)


def _by_group(scales: torch.Tensor) -> torch.Tensor:
    """Per-block fp16 scales `[blocks, G * 64]` -> their bytes in `[G, blocks, 64]` order."""
    blocks, columns = scales.shape
    grouped = scales.view(blocks, columns // GROUP_COLUMNS, GROUP_COLUMNS).transpose(0, 1).contiguous()
    return grouped.view(torch.uint8).reshape(-1)


def _from_by_group(raw: torch.Tensor, blocks: int, groups: int) -> torch.Tensor:
    """`_by_group`'s inverse: bytes -> fp16 scales `[blocks, G * 64]`."""
    return raw.view(torch.float16).view(groups, blocks, GROUP_COLUMNS).transpose(0, 1).reshape(blocks, -1)


def _block_shape(in_features: int, out_features: int) -> tuple[int, int]:
    """(blocks of 32 inputs, groups of 64 columns) of a weight `[in, out]` (`_blocks`' padding)."""
    return -(-in_features // Q4_BLOCK), -(-out_features // GROUP_COLUMNS)


class Q4Weight:
    """A weight `[in, out]` quantized to 4 bits the way the GGUF stores SmolLM2's decoder matrices:
    Q4_1 blocks of 32 inputs per output column, w = d * q + m with q in 0..15 and d, m in fp16
    (ggml's `quantize_row_q4_1`: m the block's minimum, d = (max - m) / 15, q = the nearest step).
    Weights that came from Q4_1 blocks (a GGUF target de-quantised) get those blocks back, so
    their 4-bit copy *is* the model: `dequantize()` returns exactly the fp32 weights it holds.
    `data` is the layout `cpu_kernels.c` reads (its 4-bit section): nibbles, then d, then m; it is
    all this keeps (`q`, `d`, `m` and `dequantize` read the blocks back from it: a copy of q alone
    was a byte a weight, ~134 MB for SmolLM2's int4 engine, kept for one dequantize at load)."""

    def __init__(self, weight_t: torch.Tensor):
        self.in_features, self.out_features = weight_t.shape
        w = _blocks(weight_t)  # [blocks, 32, columns]
        low, high = w.amin(1), w.amax(1)  # [blocks, columns]
        step = (high - low) / 15
        inverse = torch.where(step != 0, 1 / step, torch.zeros_like(step))
        q = ((w - low[:, None]) * inverse[:, None] + 0.5).floor().clamp(0, 15).to(torch.uint8)  # as ggml (fp32)
        tiles = _b_tiles(q)
        nibbles = tiles[..., :32] | (tiles[..., 32:] << 4)
        self.data = huge_pages.place(torch.cat([nibbles.reshape(-1), _by_group(step.half()), _by_group(low.half())]))

    def _sections(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """`data`'s nibbles, d bytes and m bytes, and the (blocks, groups) they cover."""
        blocks, groups = _block_shape(self.in_features, self.out_features)
        size = blocks * groups * GROUP_COLUMNS  # weights (a byte holds two) and entries of each scale table
        weights = size * Q4_BLOCK // 2
        return (self.data[:weights], self.data[weights : weights + 2 * size], self.data[weights + 2 * size :],
                blocks, groups)

    @property
    def q(self) -> torch.Tensor:
        """The 4-bit values `[blocks, 32, columns]` (uint8, 0..15), read back from `data`."""
        nibbles, _, _, blocks, groups = self._sections()
        nibbles = nibbles.view(-1, 32)
        return _from_b_tiles(torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1), blocks, groups)

    @property
    def d(self) -> torch.Tensor:
        """The per-block steps `[blocks, columns]` (fp16)."""
        _, d, _, blocks, groups = self._sections()
        return _from_by_group(d, blocks, groups)

    @property
    def m(self) -> torch.Tensor:
        """The per-block minimums `[blocks, columns]` (fp16)."""
        _, _, m, blocks, groups = self._sections()
        return _from_by_group(m, blocks, groups)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight `[in, out]` these blocks hold (d * q + m, in fp32, as the GGUF reader)."""
        w = self.d.float()[:, None] * self.q.float() + self.m.float()[:, None]
        return w.reshape(-1, w.shape[-1])[: self.in_features, : self.out_features]

    def num_bytes(self) -> int:
        return self.data.numel()


class Q8Weight:
    """A weight `[in, out]` in Q8_0 blocks, as the GGUF stores SmolLM2's embedding (its tied LM
    head): 32 inputs per output column, w = d * q with q in -127..127 and d fp16 (ggml's
    `quantize_row_q8_0`: d = max|w| / 127, q = round(w / d)). Like `Q4Weight`, weights that came
    from such blocks get them back exactly. `data`: the int8 B tiles as `cpu_kernels.c` reads them
    (the 4-bit section's 8-bit form), then d; all this keeps, as `Q4Weight`."""

    def __init__(self, weight_t: torch.Tensor):
        self.in_features, self.out_features = weight_t.shape
        w = _blocks(weight_t)  # [blocks, 32, columns]
        step = w.abs().amax(1) / 127  # [blocks, columns]
        inverse = torch.where(step != 0, 1 / step, torch.zeros_like(step))
        scaled = w * inverse[:, None]
        q = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)  # roundf: halves away from zero, as ggml
        self.data = huge_pages.place(torch.cat([_b_tiles(q).reshape(-1).view(torch.uint8), _by_group(step.half())]))

    @property
    def q(self) -> torch.Tensor:
        """The 8-bit values `[blocks, 32, columns]` (int8), read back from `data`."""
        blocks, groups = _block_shape(self.in_features, self.out_features)
        return _from_b_tiles(self.data[: blocks * groups * GROUP_COLUMNS * Q4_BLOCK].view(torch.int8), blocks, groups)

    @property
    def d(self) -> torch.Tensor:
        """The per-block steps `[blocks, columns]` (fp16)."""
        blocks, groups = _block_shape(self.in_features, self.out_features)
        return _from_by_group(self.data[blocks * groups * GROUP_COLUMNS * Q4_BLOCK :], blocks, groups)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight `[in, out]` these blocks hold (d * q, in fp32)."""
        w = self.d.float()[:, None] * self.q.float()
        return w.reshape(-1, w.shape[-1])[: self.in_features, : self.out_features]

    def num_bytes(self) -> int:
        return self.data.numel()


def _quantized_matmul(entry: str, x: torch.Tensor, weight: Q4Weight | Q8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight (+ bias)` through the C entry point named `entry` (`dspark_q4_gemm` / `dspark_q8_gemm`)."""
    if not q4_available():
        raise RuntimeError(q4_unavailable_reason())
    if weight.in_features % Q4_BLOCK:
        raise ValueError(f"4- and 8-bit weights need in_features a multiple of {Q4_BLOCK}, got {weight.in_features}")
    _require_fp32_contiguous(x=x)
    rows = x.shape[0]
    out = torch.empty(rows, weight.out_features, dtype=torch.float32)
    if bias is not None:
        bias = bias.detach().float().contiguous()
    if rows and getattr(_library, entry)(x.data_ptr(), rows, x.stride(0), weight.data.data_ptr(), weight.in_features,
                                         weight.out_features, out.data_ptr(), weight.out_features,
                                         None if bias is None else bias.data_ptr()):
        raise MemoryError("the quantized matmul could not allocate its int8 copy of the input")
    return out


def q4_matmul(x: torch.Tensor, weight: Q4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x [rows, in]` fp32 @ a 4-bit weight (+ bias) -> `[rows, out]` fp32, each row's input
    quantized to int8 per block of 32 (cpu_kernels.c). Needs `q4_available()`."""
    return _quantized_matmul("dspark_q4_gemm", x, weight, bias)


def q8_matmul(x: torch.Tensor, weight: Q8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`q4_matmul` for a Q8_0 weight (int8 x int8 on the same tiles). Needs `q4_available()`."""
    return _quantized_matmul("dspark_q8_gemm", x, weight, bias)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
    """Causal attention of new tokens over one layer of the KV pool, each token on its own.

    q `[tokens, heads, dim]` fp32; keys/values `[slots, kv_heads, capacity, dim]` contiguous fp32
    (one layer of a `KVPool`, already holding the new tokens' keys/values); slots/positions
    `[tokens]` contiguous int64: token t sees keys `0 .. positions[t]` of slot `slots[t]`, and the
    caller guarantees `positions < capacity` (`AttentionPlan` checks it once per forward pass:
    this runs once per layer). Returns `[tokens, heads * dim]`.
    """
    tokens, heads, dim = q.shape
    _, kv_heads, capacity, _ = keys.shape
    q = q.contiguous()
    out = torch.empty(tokens, heads * dim, dtype=torch.float32)
    status = _library.dspark_attention(q.data_ptr(), tokens, heads * dim, heads, kv_heads, dim, keys.data_ptr(),
                                       values.data_ptr(), kv_heads * capacity * dim, capacity * dim, slots.data_ptr(),
                                       positions.data_ptr(), dim ** -0.5, out.data_ptr(), heads * dim)
    if status != 0:
        raise MemoryError("the attention kernel could not allocate its scores")
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x [rows, n]` (fp32, CPU) -> `[rows]` int64: each row's first maximum, NaN counting as the
    maximum (what `torch.argmax` returns). Needs `available()`."""
    rows, n = x.shape
    if x.dtype != torch.float32 or x.stride(1) != 1:
        x = x.float().contiguous()
    out = torch.empty(rows, dtype=torch.long)
    if rows and n:
        _library.dspark_argmax(x.data_ptr(), rows, n, x.stride(0), out.data_ptr())
    return out


def top_probability_logit(x: torch.Tensor, cap: float) -> torch.Tensor:
    """`x [..., n]` logits -> logit(max softmax) `[...]` fp32, at most `cap`: what
    `models/drafter.py: top_probability_logit` defines, in one pass on the calling thread. Needs
    `available()`."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype != torch.float32 or rows.stride(1) != 1:
        rows = rows.float().contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.float32)
    if rows.shape[0] and rows.shape[1]:
        _library.dspark_top_probability_logit(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0),
                                              cap, out.data_ptr())
    return out.view(x.shape[:-1])


def draft_slot(block: torch.Tensor, slot: int, table: torch.Tensor | None, ids: torch.Tensor,
               adds: tuple[list[int], list[int], list[float]] | None, top_logit: torch.Tensor | None,
               cap: float) -> None:
    """Slot `slot` of a block draft, in place (`dspark_draft_slot` in the C source).

    block: the logits `[N, gamma, V]` (fp32, contiguous); slot k's rows get `table[ids[k]]`
    (`[R, V]` fp32 contiguous; None: no row bias), then the sparse `adds` (rows, columns,
    fp32-rounded weights, applied in order; None: none). ids `[gamma + 1, N]` int64 contiguous:
    row k holds x_{k-1} (row 0 the anchors) and row k + 1 gets each row's argmax (as
    `torch.argmax`). top_logit `[N, gamma]` fp32 contiguous (or None): column k gets
    `top_probability_logit` capped at `cap`. Pointers into the block, not per-slot views: a
    view is a PyTorch op, and seven of each a block cost more than the call. The caller keeps
    every index in range. Needs `available()`."""
    rows, gamma, n = block.shape
    if block.dtype != torch.float32 or not block.is_contiguous():
        raise ValueError("draft_slot: the block's logits must be contiguous fp32")
    if not 0 <= slot < gamma:
        raise ValueError(f"draft_slot: slot must be in [0, {gamma}), got {slot}")
    if ids.dtype != torch.long or not ids.is_contiguous() or tuple(ids.shape) != (gamma + 1, rows):
        raise ValueError(f"draft_slot: ids must be contiguous int64 [{gamma + 1}, {rows}]")
    if table is not None and (table.dtype != torch.float32 or not table.is_contiguous() or table.shape[1] != n):
        raise ValueError(f"draft_slot: table must be contiguous fp32 [rows, {n}]")
    if top_logit is not None and (top_logit.dtype != torch.float32 or not top_logit.is_contiguous()
                                  or tuple(top_logit.shape) != (rows, gamma)):
        raise ValueError(f"draft_slot: top_logit must be contiguous fp32 [{rows}, {gamma}]")
    add_count = len(adds[0]) if adds else 0
    add_rows = add_columns = add_weights = None
    if add_count:
        add_rows = (ctypes.c_long * add_count)(*adds[0])
        add_columns = (ctypes.c_long * add_count)(*adds[1])
        add_weights = (ctypes.c_float * add_count)(*adds[2])
    ids_address = ids.data_ptr()
    _library.dspark_draft_slot(block.data_ptr() + 4 * slot * n, rows, n, gamma * n,
                               None if table is None else table.data_ptr(), ids_address + 8 * slot * rows,
                               add_rows, add_columns, add_weights, add_count, ids_address + 8 * (slot + 1) * rows,
                               None if top_logit is None else top_logit.data_ptr() + 4 * slot, gamma, cap)


def gumbel_argmax(x: torch.Tensor, keys: list[int], ids: torch.Tensor | None = None,
                  scales: list[float] | None = None) -> list[int]:
    """`x [rows, n]` (log-probabilities, or logits with `scales` = 1 / temperature per row) and a
    64-bit noise key per row -> each row's `argmax(x * scale + noise)`, the noise of token `ids[i]`
    (or `i`) under the row's key being the Gumbel noise `runtime/sampling.py: gumbel_noise`
    defines (the same hash; the C side's logs are its own, within an ulp or two of PyTorch's).
    In float64; the first maximum wins, a NaN counts as the maximum (as `torch.argmax`). Needs
    `available()`."""
    rows, n = x.shape
    if x.dtype != torch.float32 or x.stride(1) != 1:
        x = x.float().contiguous()
    if ids is not None and (ids.dtype != torch.int64 or not ids.is_contiguous() or ids.shape != (n,)):
        ids = ids.to(torch.int64).contiguous().view(n)
    out = torch.empty(rows, dtype=torch.long)
    if rows and n:
        key_array = (ctypes.c_uint64 * rows)(*keys)
        scale_array = (ctypes.c_double * rows)(*([1.0] * rows if scales is None else scales))
        if _library.dspark_gumbel_argmax(x.data_ptr(), rows, n, x.stride(0), key_array, scale_array,
                                         None if ids is None else ids.data_ptr(), out.data_ptr()):
            raise MemoryError("the Gumbel-max kernel could not allocate its scratch")
    return out.tolist()


def gumbel_noise(key: int, ids: torch.Tensor) -> torch.Tensor:
    """The C side's noise of token ids `[n]` under a 64-bit `key` -> `[n]` float64 (to test it
    against `sampling.gumbel_noise`, which defines it). Needs `available()`."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], dtype=torch.float64)
    _library.dspark_gumbel_noise(key, ids.data_ptr(), ids.shape[0], out.data_ptr())
    return out


def _require_fp32_contiguous(**tensors: torch.Tensor) -> None:
    """The C side reads these as dense fp32 arrays."""
    for name, tensor in tensors.items():
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous fp32 tensor")


def _pool_strides(keys: torch.Tensor) -> tuple[int, int, int]:
    """Element strides (layer, slot, kv head) of a KV pool `[layers, slots, kv_heads, capacity, head_dim]`."""
    _, _, kv_heads, capacity, head_dim = keys.shape
    return keys[0].numel(), kv_heads * capacity * head_dim, capacity * head_dim


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One decoder layer's weights as the fused pass takes them (norm weights fp32 `[dim]`)."""

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: PackedWeight | Q4Weight  # [hidden, (heads + 2 kv_heads) * head_dim]: q, k, v columns in that order
    o: PackedWeight | Q4Weight
    gate_up: PackedWeight | Q4Weight  # [hidden, 2 * intermediate]: gate columns, then up
    down: PackedWeight | Q4Weight
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # per-head norms of qk-norm models (Qwen3)
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class DecoderShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float


class FusedDecoder:
    """A Llama-family decoder's weights, described once for `dspark_decoder_forward`.

    Holds references to every tensor it points at, so they live as long as it does. Build it
    after the weights are final; it reads them, never copies them (except to make them fp32
    and contiguous).
    """

    def __init__(self, shape: DecoderShape, layers: list[DecoderLayerWeights], final_norm: torch.Tensor,
                 lm_head: "PackedWeight | Q8Weight"):
        self.shape = shape
        self._keep = []  # every tensor the structs point at

        def address(tensor: torch.Tensor | None) -> int | None:
            if tensor is None:
                return None
            tensor = tensor.detach().float().contiguous()
            self._keep.append(tensor)
            return tensor.data_ptr()

        kinds = {type(getattr(layer, name)) for layer in layers for name in ("qkv", "o", "gate_up", "down")}
        if kinds not in ({PackedWeight}, {Q4Weight}):
            raise ValueError("the fused pass takes the layers' matrices all as PackedWeight (bf16) or all as "
                             f"Q4Weight (4-bit), got {sorted(k.__name__ for k in kinds)}")
        layer_format = 1 if kinds == {Q4Weight} else 0
        if layer_format and not q4_available():
            raise RuntimeError(q4_unavailable_reason())
        if layer_format and (shape.hidden % Q4_BLOCK or shape.intermediate % Q4_BLOCK
                             or shape.heads * shape.head_dim % Q4_BLOCK):
            raise ValueError(f"4-bit weights need the matmuls' input sizes to be multiples of {Q4_BLOCK}")
        self._layers = (_DecoderLayer * len(layers))()
        for slot, layer in zip(self._layers, layers):
            for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "qkv_bias", "o_bias"):
                setattr(slot, name, address(getattr(layer, name)))
            for name in ("qkv", "o", "gate_up", "down"):
                packed = getattr(layer, name)
                self._keep.append(packed.data)
                setattr(slot, name, packed.data.data_ptr())
        if not isinstance(lm_head, (PackedWeight, Q8Weight)):
            raise ValueError(f"the LM head must be a PackedWeight (bf16) or a Q8Weight, got {type(lm_head).__name__}")
        head_format = 2 if isinstance(lm_head, Q8Weight) else 0
        if head_format and not q4_available():
            raise RuntimeError(q4_unavailable_reason())
        self._keep.append(lm_head.data)
        self._model = _DecoderModel(len(layers), shape.hidden, shape.heads, shape.kv_heads, shape.head_dim,
                                    shape.intermediate, shape.vocab, shape.eps, self._layers,
                                    address(final_norm), lm_head.data.data_ptr(), layer_format, head_format)

    def forward(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                positions: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                feature_layers: tuple[int, ...], logit_rows: torch.Tensor | None,
                visible: torch.Tensor | None = None, normed: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run every layer over `x` `[tokens, hidden]` (fp32, embedded; overwritten).

        keys/values: the whole KV pool `[layers, slots, kv_heads, capacity, head_dim]` (contiguous
        fp32), written at `(slots[t], positions[t])` for token t (rotated by `positions[t]`),
        which sees keys `0 .. visible[t]` of its slot (default `positions[t]`: causal). The
        caller checks that every position and visible index is below the capacity.
        rope_cos/rope_sin: `[>max position, head_dim]`. Returns the logits `[len(logit_rows) or
        tokens, vocab]` and the outputs of `feature_layers` `[tokens, len(feature_layers) * hidden]`
        (None if none). normed: `[len(logit_rows) or tokens, hidden]` fp32, filled with the final
        norm's output at the logit rows (a drafter's hidden states), or None.
        """
        shape = self.shape
        tokens = x.shape[0]
        _require_fp32_contiguous(x=x, keys=keys, values=values, rope_cos=rope_cos, rope_sin=rope_sin)
        slots, positions = slots.to(torch.long).contiguous(), positions.to(torch.long).contiguous()
        if visible is not None:
            visible = visible.to(torch.long).contiguous()
        rows = None if logit_rows is None else logit_rows.to(torch.long).contiguous()
        if rows is not None and rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= tokens):
            raise ValueError(f"logit rows must be in [0, {tokens}), got {rows.tolist()}")
        if any(not 0 <= layer < len(self._layers) for layer in feature_layers):
            raise ValueError(f"feature layers must be in [0, {len(self._layers)}), got {list(feature_layers)}")
        num_logits = tokens if rows is None else rows.shape[0]
        logits = torch.empty(num_logits, shape.vocab, dtype=torch.float32)
        wanted = torch.tensor(feature_layers, dtype=torch.long)
        features = torch.empty(tokens, len(feature_layers) * shape.hidden) if feature_layers else None
        if normed is not None:
            _require_fp32_contiguous(normed=normed)
            if normed.shape != (num_logits, shape.hidden):
                raise ValueError(f"normed must be [{num_logits}, {shape.hidden}], got {list(normed.shape)}")
        call = _DecoderCall(tokens, slots.data_ptr(), positions.data_ptr(),
                            None if visible is None else visible.data_ptr(), keys.data_ptr(), values.data_ptr(),
                            *_pool_strides(keys), rope_cos.data_ptr(), rope_sin.data_ptr(), wanted.data_ptr(),
                            len(feature_layers),
                            None if features is None else features.data_ptr(),
                            None if rows is None else rows.data_ptr(), num_logits, logits.data_ptr(),
                            None if normed is None else normed.data_ptr())
        if tokens and _library.dspark_decoder_forward(ctypes.byref(self._model), x.data_ptr(), ctypes.byref(call)):
            raise MemoryError("the fused decoder pass could not allocate its scratch memory")
        return logits, features


class FusedContext:
    """A DSpark drafter's context step (feature fusion, then every layer's keys/values into its
    pool), described once for `dspark_drafter_context`. Holds what it points at."""

    def __init__(self, hidden: int, kv_heads: int, head_dim: int, eps: float, feature_norms: list[torch.Tensor],
                 project: PackedWeight, context_norm: torch.Tensor, kv: list[PackedWeight],
                 layer_norms: list[torch.Tensor] | None = None):
        """layer_norms: each layer's RMS-norm weight `[hidden]` applied to the context before its
        keys/values (a drafter with `config.context_norm`), or None."""
        self._norms = torch.cat([w.detach().float() for w in feature_norms]).contiguous()  # [m * hidden]
        self._context_norm = context_norm.detach().float().contiguous()
        self._layer_norms = None if layer_norms is None else torch.cat([w.detach().float() for w in layer_norms])
        self._packed = [project, *kv]  # kept alive
        self._kv = (_pointer * len(kv))(*(w.data.data_ptr() for w in kv))
        self.width = len(feature_norms) * hidden
        self._model = _ContextModel(len(kv), hidden, kv_heads, head_dim, len(feature_norms), eps,
                                    self._norms.data_ptr(), project.data.data_ptr(), self._context_norm.data_ptr(),
                                    self._kv, None if self._layer_norms is None else self._layer_norms.data_ptr())

    def forward(self, features: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, rope_cos: torch.Tensor,
                rope_sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write the keys/values of `features` `[tokens, m * hidden]` at `(slots[t], positions[t])` of
        every layer of the pool `keys`/`values` `[layers, slots, kv_heads, capacity, head_dim]`
        (contiguous fp32; the caller checks positions < capacity)."""
        features = features.float().contiguous()
        if features.shape[1] != self.width:
            raise ValueError(f"features have {features.shape[1]} columns, the drafter fuses {self.width}")
        _require_fp32_contiguous(keys=keys, values=values, rope_cos=rope_cos, rope_sin=rope_sin)
        slots, positions = slots.to(torch.long).contiguous(), positions.to(torch.long).contiguous()
        if features.shape[0] and _library.dspark_drafter_context(
                ctypes.byref(self._model), features.data_ptr(), features.shape[0], slots.data_ptr(),
                positions.data_ptr(), rope_cos.data_ptr(), rope_sin.data_ptr(), keys.data_ptr(), values.data_ptr(),
                *_pool_strides(keys)):
            raise MemoryError("the drafter context pass could not allocate its scratch memory")
