"""RL rollouts on a GPU: by default the engine samples from a bf16 copy of the fp32 policy under CUDA graphs (not
compiled), and ``Rollout.load`` changes that copy's weights in place under the captured graphs. Checked: after
``load(b)`` an engine whose graphs were captured with policy a writes the same tokens, with the same recorded
log-probabilities, as a fresh engine built from b (a graph reading a stale copy of any weight would not)."""

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.data import train_tokenizer
from k3.post.format import ChatFormat
from k3.post.rollout import Rollout, Trajectory
from k3.chat import ChatTemplate

pytestmark = pytest.mark.gpu


def _policy(vocab: int, seed: int) -> K3ForCausalLM:
    torch.manual_seed(seed)
    cfg = K3Config.preset("small").replace(vocab_size=vocab, num_nextn_predict_layers=0)
    return K3ForCausalLM(cfg).to("cuda").train()  # fp32 master weights, as k3 rl trains them


def _trajectories(fmt) -> list[Trajectory]:
    prompts = [fmt.prompt_ids([{"role": "user", "content": f"What is {a} + {b}?"}], effort)
               for a, b, effort in ((1, 2, "low"), (3, 4, "max"))]
    return [Trajectory(g, p, seed=100 * g + i) for g, p in enumerate(prompts) for i in range(4)]


@torch.no_grad()
def test_a_loaded_graph_engine_samples_as_a_fresh_one():
    texts = [ChatTemplate().render([{"role": "user", "content": f"What is {a} + {b}?"},
                                    {"role": "assistant", "content": f"Answer: {a + b}"}])
             for a in range(10) for b in range(10)]
    tok = train_tokenizer(texts, 400)
    fmt = ChatFormat(tok)
    a, b = _policy(tok.get_vocab_size(), 1), _policy(tok.get_vocab_size(), 2)
    rollout = Rollout(a, tok, fmt.stop, 24, version=0)
    engine = rollout.engine
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    assert engine.runner.use_graphs and not engine.runner.compile
    rollout.round(_trajectories(fmt))  # graphs captured with a's weights
    rollout.load(b, 1)
    loaded, fresh = _trajectories(fmt), _trajectories(fmt)
    rollout.round(loaded)
    Rollout(b, tok, fmt.stop, 24, version=1).round(fresh)
    assert any(len(t.tokens) > 4 for t in loaded)
    for x, y in zip(loaded, fresh):
        assert x.tokens == y.tokens and x.finish == y.finish
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-3, rtol=0)
