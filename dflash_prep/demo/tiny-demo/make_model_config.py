"""Write model_config.json: a tiny Qwen3.5 hybrid (Gated DeltaNet + full attention) text model.

Random-init demo target model for CPU tests; vocab and special ids match tokenizer/.
Load with: AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("model_config.json")).

    python make_model_config.py [--out model_config.json]
"""

import argparse
import os

from transformers.models.qwen3_5 import Qwen3_5TextConfig

HERE = os.path.dirname(os.path.abspath(__file__))


def build():
    return Qwen3_5TextConfig(
        vocab_size=1024,  # == len(tokenizer)
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,  # the default 3:1 pattern
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        # tokenizer: <|endoftext|> (id 0) is pad and eos; it has no bos, so like Qwen we reuse <|endoftext|>
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        dtype="float32",
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "model_config.json"))
    args = ap.parse_args()
    cfg = build()
    cfg.to_json_file(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
