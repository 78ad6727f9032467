"""A small tokenizer in the Kimi releases' format, written by the tests: ``tiktoken.model`` (256 byte tokens plus
merges building a few words) and ``tokenizer_config.json`` (special tokens, bos/eos, optional chat template)."""

import json
from pathlib import Path

from k3.data.kimi_tokenizer import write_tiktoken_file

WORDS = ["hello", " world", "Hello", " the", " weather", " in", " Paris", " city", "123", "45", "get", "_weather",
         "漢字", " café"]
SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]
K3_SPECIALS = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"]
K2_TOOL_SPECIALS = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                    "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
K2_TEMPLATE = ("{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>"
               "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")


def ranks() -> dict[bytes, int]:
    r = {bytes([b]): b for b in range(256)}
    for w in WORDS:
        raw = w.encode()
        for n in range(2, len(raw) + 1):  # every prefix: tiktoken reaches the word by merging left to right
            r.setdefault(raw[:n], len(r))
    return r


def write_kimi_tokenizer(directory, k3_tokens: bool = True, chat_template: str | None = None,
                         k2_tool_tokens: bool = False) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    r = ranks()
    write_tiktoken_file(r, d / "tiktoken.model")
    names = SPECIALS + (K3_SPECIALS if k3_tokens else []) + (K2_TOOL_SPECIALS if k2_tool_tokens else [])
    cfg = {"added_tokens_decoder": {str(len(r) + i): {"content": t, "special": True} for i, t in enumerate(names)},
           "bos_token": "[BOS]", "eos_token": {"content": "[EOS]", "special": True}, "pad_token": "[EOS]",
           "tokenizer_class": "TikTokenTokenizer"}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d
