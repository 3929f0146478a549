"""Write a tiny random llama-architecture GGUF with a word vocabulary, using the `gguf` package.

Run with the llama-cpp engine venv's python (gguf and numpy are installed there), not imported by kvbench:
    python _tiny_gguf.py OUT.gguf [--words 4096] [--context 8192] [--seed 0]

Vocabulary (SentencePiece-style, "llama" tokenizer model of llama.cpp): ids 0 … words-1 are "▁w0" …
"▁w{words-1}", so the text "w1 w2 w3" is the three tokens 1, 2, 3 (llama.cpp prefixes a space and merges
"▁" "w" "1" through the piece "▁w"; every prefix of a word is itself a word). After them come "▁w" (the one
merge piece), "<unk>", "<s>", "</s>" and the 256 byte-fallback tokens <0x00> … <0xFF> that llama.cpp uses for
any other text. No BOS/EOS is added to prompts. Same geometry as the vLLM tiny model: hidden 128, 2 layers,
4 heads, 2 KV heads, FFN 256.
"""

from __future__ import annotations

import argparse
from pathlib import Path

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 128, 2, 4, 2, 256
CHAT_TEMPLATE = "{% for m in messages %}{% if not loop.first %} {% endif %}{{ m['content'] }}{% endfor %}"


def vocabulary(words: int):
    import gguf

    T = gguf.TokenType
    tokens = [f"\u2581w{i}" for i in range(words)] + ["\u2581w", "<unk>", "<s>", "</s>"]
    types = [T.NORMAL] * (words + 1) + [T.UNKNOWN, T.CONTROL, T.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [T.BYTE] * 256
    scores = [0.0] * len(tokens)
    return tokens, scores, types, {"unk": words + 1, "bos": words + 2, "eos": words + 3}


def write(out: Path, words: int, context: int, seed: int) -> None:
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens, scores, types, special = vocabulary(words)
    n_vocab = len(tokens)
    head_dim = HIDDEN // HEADS

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("kvbench-tiny")
    w.add_context_length(context)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(special["unk"])
    w.add_bos_token_id(special["bos"])
    w.add_eos_token_id(special["eos"])
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_chat_template(CHAT_TEMPLATE)

    def mat(rows: int, cols: int) -> np.ndarray:  # numpy (rows, cols) is ggml ne = [cols, rows]
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    def norm() -> np.ndarray:
        return np.ones(HIDDEN, dtype=np.float32)

    kv = KV_HEADS * head_dim
    w.add_tensor("token_embd.weight", mat(n_vocab, HIDDEN))
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm())
        w.add_tensor(p + "attn_q.weight", mat(HIDDEN, HIDDEN))
        w.add_tensor(p + "attn_k.weight", mat(kv, HIDDEN))
        w.add_tensor(p + "attn_v.weight", mat(kv, HIDDEN))
        w.add_tensor(p + "attn_output.weight", mat(HIDDEN, HIDDEN))
        w.add_tensor(p + "ffn_norm.weight", norm())
        w.add_tensor(p + "ffn_gate.weight", mat(FFN, HIDDEN))
        w.add_tensor(p + "ffn_up.weight", mat(FFN, HIDDEN))
        w.add_tensor(p + "ffn_down.weight", mat(HIDDEN, FFN))
    w.add_tensor("output_norm.weight", norm())
    w.add_tensor("output.weight", mat(n_vocab, HIDDEN))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--words", type=int, default=4096)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    write(tmp, args.words, args.context, args.seed)
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
