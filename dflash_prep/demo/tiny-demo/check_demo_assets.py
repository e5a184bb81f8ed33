"""Sanity-check the demo assets: tokenizer round-trip + assistant mask, dataset token
lengths after chat templating, and a CPU forward of the tiny Qwen3.5 model.

    python check_demo_assets.py
"""

import json
import os
import statistics

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))


def check_tokenizer(tok):
    s = "  Hello,\tworld!\n\n  def f(x):  return x**2  # ünïcødé 🙂"
    assert tok.decode(tok.encode(s)) == s, "byte-level round-trip failed"
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What is 12 * 7?"},
        {"role": "assistant", "content": "12 * 7 = 84.\n```python\nprint(12 * 7)\n```"},
    ]
    out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    print("mask:", "".join(map(str, mask)))
    masked = tok.decode([t for t, m in zip(ids, mask) if m])
    print("masked tokens decode to:", repr(masked))
    expected = "".join(m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant")
    assert masked == expected, masked
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n"), prompt
    print("tokenizer OK")


def dataset_stats(tok):
    with open(os.path.join(HERE, "data", "conversations.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    lens = []
    for r in rows:
        out = tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        got = tok.decode([t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m])
        assert got == "".join(m["content"] + "<|im_end|>" for m in r["messages"] if m["role"] == "assistant"), r["id"]
        lens.append(len(out["input_ids"]))
    lens.sort()
    n = len(lens)
    print(f"conversations={n} tokens: min={lens[0]} median={statistics.median(lens)} "
          f"mean={statistics.mean(lens):.1f} p90={lens[int(0.9 * n)]} max={lens[-1]} "
          f">1000: {sum(x > 1000 for x in lens)} <40: {sum(x < 40 for x in lens)} total={sum(lens)}")


def check_model(tok):
    path = os.path.join(HERE, "model_config.json")
    cfg = AutoConfig.from_pretrained(path)
    assert type(cfg).__name__ == "Qwen3_5TextConfig", type(cfg)
    strip = lambda d: {k: v for k, v in d.items() if k != "_name_or_path"}  # noqa: E731
    assert strip(cfg.to_dict()) == strip(type(cfg).from_json_file(path).to_dict())  # JSON round-trip
    assert cfg.vocab_size == len(tok) and cfg.pad_token_id == tok.pad_token_id and cfg.eos_token_id == tok.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(3, cfg.vocab_size, (2, 50))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__}: {n_params} params, logits {tuple(out.logits.shape)}, "
          f"{len(out.hidden_states)} hidden states of {tuple(out.hidden_states[-1].shape)}, "
          f"finite={bool(torch.isfinite(out.logits).all())}")


if __name__ == "__main__":
    tok = AutoTokenizer.from_pretrained(os.path.join(HERE, "tokenizer"))
    check_tokenizer(tok)
    dataset_stats(tok)
    check_model(tok)
