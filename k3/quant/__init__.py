"""Quantisation as K3 ships it (SPEC §6): MXFP4 routed-expert weights, MXFP8 activations.

- the formats (OCP MX v1.0, exact, CPU and GPU): ``k3.ops.mx``, re-exported here;
- quantisation-aware training: ``K3Config.qat = "mxfp4"`` (``k3 train --qat mxfp4``) fake-quantises every routed
  expert's weights and matmul inputs in ``ExpertBank`` and in the expert-parallel bank (``k3.ops.mx`` sits below the
  layers so that they can call it);
- export in the release's compressed-tensors ``mxfp4-pack-quantized`` layout: ``export.py`` (used by
  ``k3.pretrained.save_pretrained(..., quantization="mxfp4")``);
- serving the packed weights: ``packed.py`` (``PackedExpertBank``, the CPU reference) and ``triton_mm.py`` (the
  CUDA kernel).
"""

from ..ops.mx import (BLOCK, E2M1, E4M3, dequantize_mx, dequantize_mxfp4, dequantize_mxfp8, fake_quant_mxfp4,
                      fake_quant_mxfp8, quantize_mx, quantize_mxfp4, quantize_mxfp8)
from .export import QUANTIZATION_CONFIG, is_packed_state, pack_expert_state, quantization_config
from .packed import PackedExpertBank, PackedWeight, pack_experts, packed_grouped_mm

__all__ = ["BLOCK", "E2M1", "E4M3", "quantize_mx", "dequantize_mx", "quantize_mxfp4", "dequantize_mxfp4",
           "quantize_mxfp8", "dequantize_mxfp8", "fake_quant_mxfp4", "fake_quant_mxfp8", "QUANTIZATION_CONFIG",
           "pack_expert_state", "is_packed_state", "quantization_config", "PackedExpertBank", "PackedWeight",
           "pack_experts", "packed_grouped_mm"]
