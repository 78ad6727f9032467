import importlib.util
import sys

import torch

if not torch.cuda.is_available() and importlib.util.find_spec("transformers") and importlib.util.find_spec("fla"):
    # transformers' Kimi Linear takes fla-core's Triton kernels whenever fla imports (they need a GPU; the test
    # suite installs fla-core for its interpreter tests): import it with fla hidden, so it keeps its torch path
    sys.modules["fla"] = None
    try:
        import transformers.models.kimi_linear.modeling_kimi_linear  # noqa: F401
    finally:
        del sys.modules["fla"]
