"""Write a tiny Llama (random weights, seed 0) and its tokenizer as a Hugging Face folder, to try a 7B recipe's whole
path on a CPU: ``+recipe=llama2_7b model.pretrained=<folder> trainer.accelerator=cpu ...`` (docs/using.md, "Big
models"). The tokenizer is a byte-level BPE trained on the embedded corpus's documents; the model has the
architecture of Llama-2 (rotary positions, grouped-query attention, SwiGLU) at a size a CPU trains in seconds.

    python scripts/make_tiny_llama.py /tmp/tiny-llama [--hidden 64 --layers 2]
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

BUILTIN = Path(__file__).resolve().parents[1] / "ccexp" / "data" / "builtin" / "debmix_mini.jsonl.gz"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("out", help="the folder to write (config.json, model.safetensors, tokenizer files)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (a multiple of 4)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers")
    ap.add_argument("--vocab", type=int, default=2048, help="BPE tokens (>= 300)")
    args = ap.parse_args()
    if args.hidden % 4 or args.hidden < 8 or args.layers < 1 or args.vocab < 300:
        ap.error("--hidden must be a multiple of 4 (>= 8), --layers >= 1, --vocab >= 300")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ccexp.data.tokenize import train_bpe_tokenizer

    out = Path(args.out)
    with gzip.open(BUILTIN, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(3000), f)]
    tok = train_bpe_tokenizer(texts, args.vocab, out)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=args.hidden,
                                         intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    model.save_pretrained(out)
    print(f"wrote {out}: a Llama of {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{len(tok):,}-token tokenizer")


if __name__ == "__main__":
    main()
