"""Checkpoints in the official HF layouts: config.json + safetensors (sharded with an index when large).

Our module tree differs from the checkpoint in these places, translated here and nowhere else:
- routed experts are 3-D tensors ``experts.w{1,2,3}`` [E, out, in]; the checkpoint has ``experts.{e}.w{n}.weight``
  (MXFP4 ``weight_packed`` + ``weight_scale`` in the release: dequantised on load, or kept packed with
  ``read_checkpoint(..., keep_packed=True)``; k3.quant.export packs them for writing), or
  DeepSeek-V3's ``mlp.experts.{e}.{gate,up,down}_proj.weight`` for Kimi K2's architecture (``config.hf_layout``);
- MTP layers live in ``mtp.{i}``; the checkpoint puts them at ``model.layers.{num_hidden_layers + i}``;
- ``A_log`` is [H]; Kimi Linear's layout stores [1, 1, H, 1];
- the multimodal releases prefix text weights with ``language_model.`` (stripped; vision weights are skipped).
Aliases accepted on load: ``*_res.proj_weight`` / ``*_res.norm_weight`` (dotted AttnRes form), ``A_log`` of any shape
and padded beyond the head count (the release ships [128] for 96 heads), ``dt_bias`` as [H, K], the router bias as
``block_sparse_moe.e_score_correction_bias``, MTP under ``model.mtp.layers.{i}`` / ``model.mtp.{i}``, a dense layer's
MLP under ``block_sparse_moe.`` (transformers' re-save), ``vision_model.`` among the skipped prefixes.
Every file written gets a sha256 in ``SHA256SUMS``, checked on load (manifest.py).

This package reads and writes names, shards and checksums, and builds no model: ``k3.pretrained`` (above the model,
the vision tower and quantisation) picks the class and fills it (``load_pretrained`` / ``save_pretrained``).
"""

from .errors import CheckpointError
from .io import (Checkpoint, from_hf_state_dict, mismatch_message, read_checkpoint, read_hf_tensors, to_hf_state_dict,
                 write_checkpoint)

__all__ = ["CheckpointError", "Checkpoint", "read_checkpoint", "write_checkpoint", "read_hf_tensors",
           "to_hf_state_dict", "from_hf_state_dict", "mismatch_message"]
