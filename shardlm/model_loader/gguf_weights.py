"""Linear weights read from a GGUF file in their own quantization (`--quantization gguf`).

GGUF stores a weight [N, K] row by row in blocks of 32 columns (ggml's block formats):

    Q8_0  34 bytes: d (float16), 32 x int8 q                  w = q * d
    Q4_0  18 bytes: d (float16), 16 bytes of nibbles          w = (q - 8) * d
    Q4_1  20 bytes: d, m (float16), 16 bytes of nibbles       w = q * d + m

where byte j of the nibbles holds column j (low) and j + 16 (high). The K-quants have super-blocks
of 256 columns whose sub-block scales are themselves quantized (6 or 8 bits times a float16):

    Q4_K  144 bytes: d, dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles   w = q * d*sc - dmin*m  (groups of 32)
    Q5_K  176 bytes: as Q4_K plus 32 bytes holding each q's fifth bit
    Q6_K  210 bytes: 128 bytes low nibbles, 64 of high 2 bits, 16 int8 scales, d   w = (q - 32) * d*sc  (groups of 16)

Each becomes the integers, scales and minimums of a `QuantizedWeight` (w = q * scale + min):
the same values, bit for bit, as ggml's dequantization (d * sc and dmin * m are exact in
float32). Q4_K runs on the 4-bit panels, Q6_K (q - 32 in -32..31) on the 8-bit ones; Q5_K
(asymmetric, 5 bits) is held as 8-bit integers with minimums, which no blocked kernel takes: it
is dequantized for each product (correct, slow). Names, the q/k rows llama.cpp permutes and the
experts' stacked tensors are put in Hugging Face's terms by gguf_names.py. The token embedding and
the LM head are read too where they are Q8_0 (the embedded default model's tied table is); in
another type (F16, K-quants, 4-bit) they stay float. Phi-3's fused q/k/v and gate/up are read as
the checkpoint holds them; the model splits their rows as it splits float ones
(weights.take_quantized_linears).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch

from shardlm import envs
from shardlm.model_loader import gguf_names as names
from shardlm.model_loader.gguf_file import GGUFFile

GROUP = 32
_CACHE_VERSION = 4        # bump when decoding changes
_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_QUANTIZED_TABLES = ("token_embd.weight", "output.weight")     # read where Q8_0



def decode_blocks(raw: np.ndarray, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """raw [N, row bytes] of one tensor -> (q int8 [N, K], scales, mins float32 [N, K / group], bits)."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, _BLOCK_BYTES[type_name])
    if type_name.endswith("_K"):
        return _decode_k_quant(blocks, type_name)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8)
        return _tensors(q, d, np.zeros_like(d), 8)
    nibbles = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.int8)
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if type_name == "Q4_1" else -8 * d
    return _tensors(q, d, mins, 4)


def _float16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32"""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _decode_k_quant(blocks: np.ndarray, type_name: str):
    """blocks [N, super-blocks, bytes] of a K-quant, decoded as ggml lays them out."""
    from gguf.quants import Q4_K
    n, nb = blocks.shape[:2]
    if type_name == "Q6_K":
        ql, qh, sc, d = blocks[..., :128], blocks[..., 128:192], blocks[..., 192:208], _float16(blocks[..., 208:210])
        # per half of 128 columns: 64 bytes of low nibbles (columns 0-63 low, 64-127 high) and 32
        # bytes of 2-bit pairs (columns 0-31, 32-63, 64-95, 96-127 at bits 0, 2, 4, 6)
        low = (ql.reshape(n, nb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 15
        high = (qh.reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
        q = (low.reshape(n, nb, 8, 32) | (high.reshape(n, nb, 8, 32) << 4)).astype(np.int8) - 32
        scales = d[..., None] * sc.copy().view(np.int8).astype(np.float32)          # [n, nb, 16]: groups of 16
        return _tensors(q.reshape(n, -1), scales.reshape(n, -1), np.zeros((n, nb * 16), np.float32), 8)
    d, dmin = _float16(blocks[..., 0:2]), _float16(blocks[..., 2:4])
    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(n * nb, 12))
    scales = d[..., None] * sc.reshape(n, nb, 8).astype(np.float32)
    mins = -(dmin[..., None] * m.reshape(n, nb, 8).astype(np.float32))
    # per 64 columns, 32 bytes: columns 0-31 in the low nibbles, 32-63 in the high ones
    nibbles = blocks[..., -128:].reshape(n, nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    q = (nibbles & 15).reshape(n, nb, 8, 32)
    bits = 4
    if type_name == "Q5_K":     # each q's fifth bit: bit i of byte j is column j of group i
        fifth = (blocks[..., 16:48].reshape(n, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
        q, bits = q | (fifth << 4), 8
    return _tensors(q.astype(np.int8).reshape(n, -1), scales.reshape(n, -1), mins.reshape(n, -1), bits)


def _tensors(q: np.ndarray, scales: np.ndarray, mins: np.ndarray, bits: int):
    n = q.shape[0]
    return (torch.from_numpy(np.ascontiguousarray(q.reshape(n, -1))), torch.from_numpy(np.ascontiguousarray(scales)),
            torch.from_numpy(np.ascontiguousarray(mins)), bits)


def read_linears(path: str, hf_config) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """Every quantized attention/MLP weight of a GGUF file (gguf_names.ARCHITECTURES), and its embedding
    and LM head where Q8_0, by Hugging Face name
    (`model.layers.I.self_attn.q_proj.weight`, `model.embed_tokens.weight`, ...). Decoded once per file and kept in the
    cache directory as safetensors: decoding runs in numpy (0.3 s for the default model, far longer
    for a large file of K-quants), reading the decoded copy takes a fraction of that."""
    from safetensors.torch import load_file, save_file
    stat = os.stat(path)
    cached = os.path.join(envs.SHARDLM_CACHE_DIR, "gguf",
                          f"{os.path.basename(path)}-{stat.st_size}-{int(stat.st_mtime)}-v{_CACHE_VERSION}.safetensors")
    if os.path.isfile(cached):
        flat = load_file(cached)
        return {name[:-2]: (flat[name[:-2] + ".q"], flat[name[:-2] + ".s"], flat[name[:-2] + ".m"],
                            int(flat[name[:-2] + ".b"])) for name in flat if name.endswith(".q")}
    out = _decode_file(path, hf_config)
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".safetensors", dir=os.path.dirname(cached))
    os.close(fd)
    save_file({f"{name}.{key}": t.contiguous() for name, (q, s, m, b) in out.items()
               for key, t in (("q", q), ("s", s), ("m", m), ("b", torch.tensor(b)))}, tmp)
    os.replace(tmp, cached)       # atomic: concurrent ranks agree
    return out


def float_state_dict(file: GGUFFile, hf_config) -> dict[str, torch.Tensor] | None:
    """The float32 weights of a GGUF file by Hugging Face name (gguf_names.py), dequantized by
    gguf's decoders, q/k rows in Hugging Face order, each expert's matrices on their own: the
    tensors transformers' GGUF loader gives (for the files it reads), from one read of the file.
    None for an architecture or a tensor that mapping does not know (transformers' loader takes those)."""
    arch, experts, out = file.architecture, names.expert_count(hf_config), {}
    for name, tensor in file.tensors.items():
        held = names.checkpoint_names(arch, name, experts)
        if held is None:
            return None
        values = names.stored_value(arch, name, torch.from_numpy(tensor.to_float32().copy()))
        order = names.qk_row_order(arch, name.split(".")[-2], values.shape[0], hf_config)
        values = values if order is None else values[order]
        if name.endswith("ffn_gate_inp_shexp.weight"):       # GGUF drops the router's single row
            values = values.view(1, -1)
        for i, hf_name in enumerate(held):
            out[hf_name] = values[i].clone() if len(held) > 1 else values     # one storage each
    return out


def _decode_file(path: str, hf_config) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    file = GGUFFile(path)
    arch, experts, out = file.architecture, names.expert_count(hf_config), {}
    if arch not in names.ARCHITECTURES:
        raise ValueError(f"{path}: --quantization gguf reads the architectures {', '.join(names.ARCHITECTURES)}, "
                         f"not {arch}. Leave out --quantization to run it in float (or --quantization int8/int4).")
    for tensor in file.tensors.values():
        type_name, module = tensor.type_name, tensor.name.split(".")[-2]
        held = names.checkpoint_names(arch, tensor.name, experts)
        if tensor.name in _QUANTIZED_TABLES:
            if type_name == "Q8_0" and held:
                out[held[0]] = decode_blocks(tensor.raw, type_name)
            continue
        if not held or not tensor.name.endswith(".weight") or module not in names.QUANTIZED_MODULES:
            continue
        if type_name not in _TYPES:
            raise ValueError(f"{path}: {tensor.name} is {type_name}; --quantization gguf reads {', '.join(_TYPES)} "
                             "tensors. Leave out --quantization to run it in float.")
        q, scales, mins, bits = decode_blocks(tensor.raw, type_name)
        order = names.qk_row_order(arch, module, q.shape[0], hf_config)
        if order is not None:
            q, scales, mins = q[order], scales[order], mins[order]
        if len(held) == 1:
            out[held[0]] = (q, scales, mins, bits)
            continue
        rows = q.shape[0] // len(held)          # an expert tensor: [experts * rows, columns]
        for i, hf_name in enumerate(held):      # one storage each (the cache file saves them apart)
            out[hf_name] = (*(t[i * rows:(i + 1) * rows].clone() for t in (q, scales, mins)), bits)
    return out
