"""Write a tiny random Llama (transformers) and a word-level tokenizer to a folder; no hub access.

Run with the engine venv's python (transformers, tokenizers and torch come with vLLM there), not imported
by kvbench itself:  python _tiny_llama.py OUT_DIR [--vocab 4096] [--max-position 8192] [--seed 0]

The tokenizer maps the words w0 … w{vocab-1} to token ids 0 … vocab-1, one token each, splits on
whitespace, adds no BOS/EOS, and maps anything else to w0 (id 0). Its chat template joins the message
contents with single spaces and adds nothing else, so a chat prompt counts exactly its words. The model has
no EOS token, so generation runs until max_tokens (or max-model-len) unless the request sets stop tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CHAT_TEMPLATE = "{% for m in messages %}{% if not loop.first %} {% endif %}{{ m['content'] }}{% endfor %}"


def make_tokenizer(out: Path, vocab_size: int, max_len: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # No decoder: tokenizers joins decoded tokens with single spaces, which is what we want.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_len, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # Some transformers versions write the template to chat_template.jinja only; keep it in the config too.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("chat_template", CHAT_TEMPLATE)
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def make_model(out: Path, vocab_size: int, max_position: int, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model.save_pretrained(out, safe_serialization=True)
    # vLLM reads generation_config.json for default sampling parameters: keep it free of stop/eos settings.
    (out / "generation_config.json").write_text(json.dumps({"_from_model_config": False}, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--max-position", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    make_model(args.out, args.vocab, args.max_position, args.seed)
    make_tokenizer(args.out, args.vocab, args.max_position)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
