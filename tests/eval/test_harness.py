"""k3 as an lm-evaluation-harness model, offline: local tasks (task YAMLs reading local JSON) of the three request
kinds, run through lm_eval.simple_evaluate with ``--model k3``, and checked against k3 computing the same numbers
on its own. Skipped when lm-eval is not installed (pip install 'k3[eval]')."""

import importlib.metadata as md
import json
import math

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api import registry  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from k3.cli import main  # noqa: E402
from k3.data.tokenizer import encode, eos_id  # noqa: E402
from k3.eval import score_text  # noqa: E402
from k3.eval.harness import K3LM  # noqa: E402

from .test_scoring import _direct  # noqa: E402

MC = [{"question": "def f(x):\n    return", "choices": [" x + 1", " hello"], "label": 0},
      {"question": "print(f(2))  #", "choices": [" three", " k3."], "label": 1}]
PPL = [{"text": "def f(x):\n    return x + 1\n"}, {"text": "hello world, this is k3.\n" * 2}]
GEN = [{"prompt": "def f(x):\n", "answer": "    return x + 1"}]
TASKS = {
    "k3_mc": "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
             "doc_to_target: \"{{label}}\"\nmetric_list:\n  - metric: acc\n",
    "k3_ppl": "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\nmetric_list:\n"
              "  - metric: bits_per_byte\n",
    "k3_gen": "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{answer}}\"\n"
              "generation_kwargs:\n  until: [\"\\n\\n\"]\n  max_gen_toks: 4\n  do_sample: false\n"
              "metric_list:\n  - metric: exact_match\n",
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    for name, rows in (("k3_mc", MC), ("k3_ppl", PPL), ("k3_gen", GEN)):
        (d / f"{name}.json").write_text("\n".join(json.dumps(r) for r in rows))
        (d / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                        f"    test: {d / (name + '.json')}\ntest_split: test\n" + TASKS[name])
    return d


def test_the_entry_point_names_the_model():
    (ep,) = [e for e in md.entry_points(group="lm_eval.models") if e.name == "k3"]
    assert ep.load() is K3LM
    if hasattr(registry, "load_plugins"):  # lm-eval with entry-point plugins: resolves --model k3 itself
        registry.load_plugins("lm_eval.models", registry.model_registry)
    assert registry.get_model("k3") is K3LM


def test_local_tasks_through_lm_eval(setup, monkeypatch, tmp_path):
    from k3 import K3Config, K3ForCausalLM
    from k3.pretrained import save_pretrained
    from k3.data.tokenizer import save_tokenizer, train_tokenizer

    from .test_scoring import TEXT

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tok = train_tokenizer([TEXT, "hello world, this is k3.\n" * 5], 300, min_frequency=1)
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size())).eval()
    save_pretrained(model, tmp_path)
    save_tokenizer(tok, tmp_path / "tokenizer.json")
    out = lm_eval.simple_evaluate(model="k3", model_args=f"checkpoint={tmp_path},device=cpu,max_length=16",
                                  tasks=list(TASKS), task_manager=TaskManager(include_path=str(setup)))
    res = out["results"]

    # multiple choice: the choice with the highest log-likelihood, computed here with plain forwards
    correct = 0
    for doc in MC:
        ctx = encode(tok, doc["question"])
        lls = [sum(_direct(model, ctx + encode(tok, doc["question"] + c)[len(ctx):],
                           len(encode(tok, doc["question"] + c)) - len(ctx))) for c in doc["choices"]]
        correct += int(max(range(len(lls)), key=lambda i: lls[i]) == doc["label"])
    assert math.isclose(res["k3_mc"]["acc,none"], correct / len(MC))

    # rolling log-likelihood: lm-eval's bits per byte is k3 eval's, document by document (max_length 16: windows)
    scores = [score_text(model, tok, d["text"], max_length=16) for d in PPL]
    bpb = sum(s.nll for s in scores) / math.log(2) / sum(s.bytes for s in scores)
    assert math.isclose(res["k3_ppl"]["bits_per_byte,none"], bpb, rel_tol=1e-5)

    # generation: greedy by full recompute, cut at the task's stop string
    for doc, sample in zip(GEN, out["samples"]["k3_gen"]):
        ids, want = encode(tok, doc["prompt"]), []
        for _ in range(4):
            with torch.no_grad():
                nxt = int(model(torch.tensor([ids + want])).logits[0, -1].argmax())
            if nxt == eos_id(tok):
                break
            want.append(nxt)
        text = tok.decode(want, skip_special_tokens=False).split("\n\n")[0]
        assert sample["resps"][0][0] == text
    assert "exact_match,none" in res["k3_gen"]


def test_k3_eval_tasks(setup, tmp_path, capsys):
    from k3 import K3Config, K3ForCausalLM
    from k3.pretrained import save_pretrained
    from k3.data.tokenizer import save_tokenizer, train_tokenizer

    tok = train_tokenizer(["hello world, this is k3.\n" * 5], 300, min_frequency=1)
    save_pretrained(K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size())), tmp_path)
    save_tokenizer(tok, tmp_path / "tokenizer.json")
    assert main(["eval", "--checkpoint", str(tmp_path), "--tasks", "k3_mc", "--include-path", str(setup),
                 "--device", "cpu", "--output", str(tmp_path / "r.json")]) == 0
    assert 0 <= json.loads((tmp_path / "r.json").read_text())["results"]["k3_mc"]["acc,none"] <= 1
