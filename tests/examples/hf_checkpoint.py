"""A tiny Hugging Face Llama checkpoint folder for the example tests (--init_model, --teacher_model),
made as a published one is: transformers' LlamaForCausalLM.save_pretrained, a tokenizer.json, and
a config whose vocab_size is the tokenizer's rounded up (padded embedding rows).

    python3 hf_checkpoint.py OUT --text TRAIN.txt [--vocab 300] [--pad_to 32] [--tied] [--max_positions 256]
                             [--eval VAL.txt --seq_len T --batch_size B --batches N]

Writes OUT/config.json and OUT/model.safetensors (a seeded LlamaForCausalLM: 2 layers, d32, 4 heads,
2 KV heads, weights drawn with std 0.2 so that the loss depends on every token; --tied: tied
embeddings, written as model.embed_tokens.weight alone), OUT/tokenizer.json
(byte-level BPE trained on TRAIN.txt with the special tokens <s> and </s>) and
OUT/tokenizer_config.json (bos <s>, eos </s>). Prints the tokenizer's and the config's vocab_size.
With --eval it also prints "loss X": the model's mean next-token cross-entropy in float32 over the
first N batches of B windows of T tokens of VAL.txt, the text tokenized as the examples tokenize it
(every non-blank line's ids, then </s>; window w: inputs ids[wT : wT+T], targets one further), as
examples/common/eval.hpp's heldout_loss and llama_to_llada's teacher evaluation compute it.
"""
import argparse
import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--text", required=True)
    p.add_argument("--vocab", type=int, default=300)
    p.add_argument("--pad_to", type=int, default=32, help="config vocab_size: the tokenizer's rounded up to this")
    p.add_argument("--tied", action="store_true")
    p.add_argument("--max_positions", type=int, default=256)
    p.add_argument("--eval")
    p.add_argument("--seq_len", type=int, default=16)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--batches", type=int, default=1)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=a.vocab, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([a.text], trainer)
    tok.save(os.path.join(a.out, "tokenizer.json"))
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)

    vocab = tok.get_vocab_size()
    padded = -(-vocab // a.pad_to) * a.pad_to
    config = LlamaConfig(vocab_size=padded, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=a.max_positions,
                         initializer_range=0.2, tie_word_embeddings=a.tied, bos_token_id=tok.token_to_id("<s>"),
                         eos_token_id=tok.token_to_id("</s>"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    model.save_pretrained(a.out)
    print(f"tokenizer vocab_size {vocab}, config vocab_size {padded}")

    if a.eval:
        eos = tok.token_to_id("</s>")
        ids = []
        with open(a.eval, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if line.strip():
                    ids += tok.encode(line).ids + [eos]
        ids = torch.tensor(ids)
        T, B = a.seq_len, a.batch_size
        windows = min((len(ids) - 1) // T, B * a.batches)
        total, count = 0.0, 0
        with torch.no_grad():
            for w0 in range(0, windows, B):
                rows = range(w0, min(w0 + B, windows))
                x = torch.stack([ids[w * T:w * T + T] for w in rows])
                y = torch.stack([ids[w * T + 1:w * T + T + 1] for w in rows])
                logits = model(input_ids=x).logits.float()
                total += torch.nn.functional.cross_entropy(logits.reshape(-1, padded), y.reshape(-1),
                                                           reduction="sum").item()
                count += y.numel()
        print(f"loss {total / count:.6f}")


if __name__ == "__main__":
    main()
