"""Checkpoints in the official HF layout: config.json + safetensors (sharded with an index when large).

Our module tree differs from the checkpoint in three places, translated here and nowhere else:
- routed experts are 3-D tensors ``experts.w{1,2,3}`` [E, out, in]; the checkpoint has ``experts.{e}.w{n}.weight``
  (MXFP4 ``weight_packed`` + ``weight_scale`` in the release: dequantised on load, or kept packed with
  ``load_pretrained(..., keep_packed=True)``; written so by ``save_pretrained(..., quantization="mxfp4")``);
- MTP layers live in ``mtp.{i}``; the checkpoint puts them at ``model.layers.{num_hidden_layers + i}``;
- the multimodal release prefixes text weights with ``language_model.`` (stripped; vision weights are skipped).
Aliases accepted on load: ``*_res.proj_weight`` / ``*_res.norm_weight`` (dotted AttnRes form) and an ``A_log``
padded beyond the head count with zeros (the release ships [128] for 96 heads).
"""

from .io import CheckpointError, load_pretrained, save_pretrained, to_hf_state_dict, from_hf_state_dict

__all__ = ["CheckpointError", "load_pretrained", "save_pretrained", "to_hf_state_dict", "from_hf_state_dict"]
