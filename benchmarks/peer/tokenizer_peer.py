"""The tokenizer suite's Python side (HF `tokenizers`, pinned in requirements.txt).

    tokenizer_peer.py make OUT TEXT           trains OUT/llama3 (byte-level BPE, Llama 3's split regex,
                                              32000 ids) and OUT/llama2 (SentencePiece-style BPE: Metaspace,
                                              byte fallback, 32000 ids) on TEXT; skipped when both exist
    tokenizer_peer.py encode DIR TEXT THREADS one JSON line: HF's encode_batch over TEXT's lines
                                              (RAYON_NUM_THREADS=THREADS), MB/s, tokens, checksum
The checksum is memopt_bench_tokenizer's: sum(id * 2654435761) mod 2^64, then mod 2^53.
"""
import json
import os
import sys
import time


def make(out, text):
    from tokenizers import Tokenizer, Regex, decoders, models, pre_tokenizers, trainers
    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    with open(text, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line]
    if not os.path.exists(os.path.join(out, "llama3", "tokenizer.json")):
        tok = Tokenizer(models.BPE(ignore_merges=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(lines, trainers.BpeTrainer(
            vocab_size=32000, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        os.makedirs(os.path.join(out, "llama3"), exist_ok=True)
        tok.save(os.path.join(out, "llama3", "tokenizer.json"))
    if not os.path.exists(os.path.join(out, "llama2", "tokenizer.json")):
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        tok.train_from_iterator(lines, trainers.BpeTrainer(
            vocab_size=32000, show_progress=False,
            special_tokens=["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]))
        os.makedirs(os.path.join(out, "llama2"), exist_ok=True)
        tok.save(os.path.join(out, "llama2", "tokenizer.json"))


def encode(folder, text, threads):
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # read when tokenizers starts its pool
    import tokenizers
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    with open(text, "rb") as f:
        raw = f.read()
    lines = raw.decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    start = time.perf_counter()
    encodings = tok.encode_batch(lines, add_special_tokens=False)
    seconds = time.perf_counter() - start
    tokens = checksum = 0
    for e in encodings:
        tokens += len(e.ids)
        checksum += sum(i * 2654435761 for i in e.ids)
    load = os.getloadavg()[0]
    print(json.dumps({"suite": "tokenizer", "impl": "hf_tokenizers", "kind": "tokenizer.json", "tokenizer": folder,
                      "threads": threads, "bytes": len(raw), "seconds": seconds, "mb_per_s": len(raw) / seconds / 1e6,
                      "tokens": tokens, "checksum": (checksum % (1 << 64)) % (1 << 53),
                      "tokenizers_version": tokenizers.__version__, "load_avg_1m": load}))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3])
    else:
        encode(sys.argv[2], sys.argv[3], int(sys.argv[4]))
