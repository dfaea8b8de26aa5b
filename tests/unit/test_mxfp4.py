"""MXFP4 (GPT-OSS's expert weights as shipped): shardlm's dequantization equals transformers'."""

import torch


def test_dequantize_mxfp4_equals_transformers_on_every_code_and_exponent():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from shardlm.models.gpt_oss import dequantize_mxfp4
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=g, dtype=torch.uint8)     # every code, both nibbles
    scales = torch.randint(100, 150, (3, 8, 4), generator=g, dtype=torch.uint8)        # 2^-27 .. 2^22
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert ours.shape == theirs.shape == (3, 4 * 32, 8)
    assert torch.equal(ours, theirs)
