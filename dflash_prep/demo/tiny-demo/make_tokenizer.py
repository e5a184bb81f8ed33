"""Train the tiny byte-level BPE demo tokenizer (vocab 1024) and save it to tokenizer/.

Run make_demo_data.py first. Deterministic: same data -> identical tokenizer.json.
The saved tokenizer carries a Qwen-style ChatML chat template whose assistant
content + closing <|im_end|> are wrapped in {% generation %} so that
apply_chat_template(..., return_assistant_tokens_mask=True) yields loss masks.

    python make_tokenizer.py [--data data/conversations.jsonl] [--out tokenizer]
"""

import argparse
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB_SIZE = 1024
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2

# ChatML. Only assistant content + its <|im_end|> are inside {% generation %};
# the role header and the trailing "\n" are not, so they get mask 0.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def iter_text(path):
    """Yield "role\ncontent" per message, so role headers get merges too."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            for m in json.loads(line)["messages"]:
                yield m["role"] + "\n" + m["content"]


def build(data_path):
    tok = Tokenizer(models.BPE())
    # GPT-2 style byte-level: regex pre-split, no prefix space, so decode(encode(x)) == x
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # keep raw char offsets for masks
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(iter_text(data_path), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:], chat_template=CHAT_TEMPLATE,
        model_max_length=4096, clean_up_tokenization_spaces=False,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(HERE, "data", "conversations.jsonl"))
    ap.add_argument("--out", default=os.path.join(HERE, "tokenizer"))
    args = ap.parse_args()
    tok = build(args.data)
    assert len(tok) == VOCAB_SIZE, len(tok)
    tok.save_pretrained(args.out)
    print(f"saved tokenizer ({len(tok)} tokens) to {args.out}")


if __name__ == "__main__":
    main()
