"""Reference side of tests/data/hf_tokenizer_test.cpp: trains small tokenizer.json files with
Hugging Face `tokenizers` and writes what HF's encode/decode give on held-out and hard texts.

    python3 hf_tokenizer_check.py DIR      writes DIR/<kind>/tokenizer.json (+ tokenizer_config.json),
                                           DIR/texts.json and DIR/<kind>/expected.json

Kinds: gpt2 (ByteLevel), llama3 (Split regex + ByteLevel, ignore_merges, special tokens),
qwen (NFC + Qwen regex), llama2 (Prepend/Replace normalizers, byte fallback, Llama-2 decoders),
metaspace (NFKC + Metaspace prepend_scheme "first"). Corpus: docstrings of standard-library
modules (natural English, code, numbers); held out: other modules' docstrings.
"""
import importlib
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers, Regex, AddedToken

TRAIN_MODULES = ["json", "re", "os", "collections", "argparse", "pathlib", "functools", "itertools", "typing",
                 "dataclasses", "subprocess", "threading", "logging", "unittest", "shutil", "random"]
HELD_OUT_MODULES = ["csv", "heapq", "textwrap", "string", "fractions", "statistics", "tempfile", "glob"]

HARD = [
    "Hello, world! It's a test: don't, won't, they'll, we've, I'm, she'd. IT'S LOUD.",
    "Ünïcödé façade naïve coöperate Straße ÆØÅ æøå",
    "emoji: 🤗🚀👩‍👩‍👧‍👦 ✨🇫🇷 (flags, ZWJ sequences) 😀😀😀",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "tabs\tand  double  spaces   triple\n\nnewlines\r\nCRLF  \n  trailing   ",
    "digits 0 12 345 6789 12345678901234567890 3.14159 1,000,000 ٣٤٥ ²³",
    "      leading spaces and a lone ' quote and '' two",
    "Ｆｕｌｌｗｉｄｔｈ ｆｏｘ ﬁne ① ㎏ ™ Å (compatibility forms)",
    "e\u0301 vs \u00e9 (NFD vs NFC), \u212b, \u1e9b\u0323",
    "special <|endoftext|> in <s> the </s> middle<|im_start|>user\nhi<|im_end|>",
    "<|begin_of_text|>Hello<|end_of_text|> <|user|> marker <|user|>again",
    "nbsp\u00a0here, ideographic\u3000space, nel\u0085line, zero\u200bwidth",
    "",
    " ",
    "x",
    "code: def f(x):\n    return x**2  # comment\n\tprint(f'{x!r}')",
]

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def docs(names):
    out = []
    for name in names:
        doc = importlib.import_module(name).__doc__ or ""
        out.extend(line for line in doc.splitlines() if line.strip())
    return out


def byte_level(pre, specials, vocab, extra=None, normalizer=None, ignore_merges=False):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    return tok, trainer, extra


def build(kind, corpus):
    config = {}
    if kind == "gpt2":
        tok, trainer, _ = byte_level(pre_tokenizers.ByteLevel(add_prefix_space=False), ["<|endoftext|>"], 600)
        config = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    elif kind == "llama3":
        pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"),
                                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok, trainer, _ = byte_level(pre, ["<|begin_of_text|>", "<|end_of_text|>"], 700, ignore_merges=True)
        config = {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|end_of_text|>"}}
    elif kind == "qwen":
        pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_PATTERN), "isolated"),
                                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok, trainer, _ = byte_level(pre, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 650,
                                     normalizer=normalizers.NFC())
    elif kind == "llama2":
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=specials, limit_alphabet=70,
                                      show_progress=False)
        config = {"bos_token": "<s>", "eos_token": "</s>"}
    elif kind == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    else:
        raise SystemExit(f"unknown kind {kind}")
    tok.train_from_iterator(corpus, trainer)
    if kind in ("llama3", "qwen"):  # chat markers as published models add them; one non-special, lstrip
        tok.add_special_tokens(["<|user|>"] if kind == "llama3" else [])
        tok.add_tokens([AddedToken("<|assistant|>", lstrip=True, rstrip=False, normalized=False)])
    if kind == "metaspace":
        tok.add_special_tokens(["<|user|>"])
    return tok, config


def main():
    out = sys.argv[1]
    corpus = docs(TRAIN_MODULES)
    held_out = docs(HELD_OUT_MODULES)
    texts = held_out + HARD
    with open(os.path.join(out, "texts.json"), "w", encoding="utf-8") as f:
        json.dump(texts, f, ensure_ascii=False)
    # Invalid UTF-8: what Python's errors="replace" decoding (U+FFFD per maximal subpart) encodes to.
    invalid = [b"caf\xe9 au lait", b"cut \xe2\x82", b"\xff\xfe bytes \xc0\xaf \xed\xa0\x80 \xf4\x90\x80\x80 ok"]
    with open(os.path.join(out, "invalid.bin"), "wb") as f:
        for raw in invalid:
            f.write(len(raw).to_bytes(4, "little") + raw)
    for kind in ["gpt2", "llama3", "qwen", "llama2", "metaspace"]:
        tok, config = build(kind, corpus)
        folder = os.path.join(out, kind)
        os.makedirs(folder, exist_ok=True)
        tok.save(os.path.join(folder, "tokenizer.json"))
        if config:
            with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
                json.dump(config, f)
        expected = []
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False).ids
            decoded = tok.decode(ids)
            expected.append({"ids": ids, "decoded": decoded})
        invalid_ids = [tok.encode(raw.decode("utf-8", errors="replace"), add_special_tokens=False).ids
                       for raw in invalid]
        with open(os.path.join(folder, "expected.json"), "w", encoding="utf-8") as f:
            json.dump({"texts": expected, "invalid": invalid_ids, "vocab_size": tok.get_vocab_size(),
                       "special": {name: tok.token_to_id(content) for name, content in
                                   [("bos", config.get("bos_token")),
                                    ("eos", (config.get("eos_token") or {}).get("content")
                                     if isinstance(config.get("eos_token"), dict) else config.get("eos_token"))]
                                   if content}}, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
