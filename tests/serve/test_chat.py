"""ChatTemplate: the documented ChatML default, custom formats, errors that explain."""

import pytest

from k3.chat import ChatTemplate


def test_default_is_chatml():
    t = ChatTemplate()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi {there}"}]
    assert t.render(msgs) == ("<|im_start|>system\nbe brief<|im_end|>\n"
                              "<|im_start|>user\nhi {there}<|im_end|>\n<|im_start|>assistant\n")
    assert t.stop == ("<|im_end|>",)


def test_custom_template():
    t = ChatTemplate("### {role}: {content}\n", "### assistant:", ("###",))
    assert t.render([{"role": "user", "content": "x"}]) == "### user: x\n### assistant:"


def test_errors():
    with pytest.raises(ValueError, match="only the fields"):
        ChatTemplate("{speaker}: {content}")
    with pytest.raises(ValueError, match="at least one message"):
        ChatTemplate().render([])
