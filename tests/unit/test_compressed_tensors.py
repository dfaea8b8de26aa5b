"""compressed-tensors integer tensors: the loader's unpacking and decoding equal what the
compressed-tensors library packs and dequantizes, bit for bit; the schemes shardlm does not read
are refused saying what it reads."""

import pytest
import torch

from shardlm.config import QuantizationConfig
from shardlm.layers.quantization import dequantize
from shardlm.model_loader.compressed_tensors import decode, integer_scheme, unpack_int32
from shardlm.model_loader.gptq_awq import checkpoint_method
from tests.compressed_checkpoints import SCHEMES, quantization_config, set_min_max_scales

ct = pytest.importorskip("compressed_tensors")


@pytest.mark.parametrize("bits", [4, 8])
def test_unpacking_inverts_the_librarys_packing(bits):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    low, high = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(low, high, (12, 40), dtype=torch.int8, generator=torch.Generator().manual_seed(bits))
    assert torch.equal(unpack_int32(pack_to_int32(q, bits), bits, 40), q)
    zero = torch.randint(low, high, (16, 5), dtype=torch.int8)           # zero points: packed along the rows
    packed = pack_to_int32(zero, bits, packed_dim=0)
    assert torch.equal(unpack_int32(packed.t().contiguous(), bits, 16).t(), zero)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_decoded_linears_equal_the_librarys_dequantization(scheme):
    """One Linear quantized and compressed by the library: shardlm's (q, scales, mins) give back
    the weight the library's own decompression gives."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    model = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False))
    torch.nn.init.normal_(model[0].weight, std=0.05, generator=torch.Generator().manual_seed(1))
    apply_quantization_config(model, quantization_config(scheme), show_progress=False)
    set_min_max_scales(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    stored = {name.split(".", 1)[1]: t.detach().clone() for name, t in model.state_dict().items()}
    bits = SCHEMES[scheme][0]
    q, scales, mins, got_bits = decode("0", stored, bits)
    compressor.decompress_model(model)
    assert got_bits == bits and q.shape == (48, 64)
    assert torch.allclose(dequantize(q, scales, mins, torch.float32), model[0].weight.data, rtol=0, atol=1e-7)


def _config(**weights) -> dict:
    args = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128, **weights}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}}}


def test_schemes_are_read_or_refused_clearly():
    assert checkpoint_method(_config()) == QuantizationConfig("compressed-tensors", 128, weight_bits=4)
    w8a8 = {**_config(num_bits=8, strategy="channel", group_size=None), "format": "int-quantized"}
    w8a8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "dynamic": True}
    assert checkpoint_method(w8a8) == QuantizationConfig("compressed-tensors", -1, weight_bits=8)
    assert checkpoint_method(w8a8).bits == 8
    assert checkpoint_method({**_config(), "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8}}},
                              "format": "float-quantized"}).method == "fp8"     # FP8: fp8.py's
    with pytest.raises(ValueError, match="different schemes"):
        mixed = _config()
        mixed["config_groups"]["group_1"] = {"targets": ["re:.*down_proj"], "weights": {**_config(num_bits=8)[
            "config_groups"]["group_0"]["weights"]}}
        integer_scheme(mixed)
    with pytest.raises(ValueError, match="asymmetric 8-bit"):
        integer_scheme(_config(num_bits=8, symmetric=False))
    with pytest.raises(ValueError, match="2-bit int weights; shardlm reads 4- and 8-bit"):
        integer_scheme(_config(num_bits=2))
    with pytest.raises(ValueError, match="stored as marlin-24"):
        integer_scheme({**_config(), "format": "marlin-24"})
    with pytest.raises(ValueError, match="sparse weights"):
        integer_scheme({**_config(), "sparsity_config": {"format": "sparse-24-bitmask"}})
    with pytest.raises(ValueError, match="per block"):
        integer_scheme(_config(strategy="block"))


def test_groups_ordered_by_activation_are_refused():
    q = torch.zeros(4, 16, dtype=torch.int32)
    parts = {"weight_packed": q[:, :2].contiguous(), "weight_shape": torch.tensor([4, 16]),
             "weight_scale": torch.ones(4, 2), "weight_g_idx": torch.tensor([1, 0] * 8)}
    with pytest.raises(ValueError, match="actorder"):
        decode("model.layers.0.mlp.down_proj", parts, 4)
    parts["weight_g_idx"] = torch.arange(16) // 8                             # consecutive groups: read
    assert decode("x", parts, 4)[0].shape == (4, 16)
