"""kvlingo's tokenizer against Hugging Face `tokenizers` on >= 2 MB of mixed text.

The reference is built with the `tokenizers` library from the same GGUF's vocabulary and
merges, configured as the model's own tokenizer.json is (NFC normaliser, the Qwen2 split
expression with "isolated" behaviour, byte-level pre-tokenizer without prefix space,
byte-level BPE, control/user-defined tokens as added tokens). Two reference tokenizers:
with the added tokens (our parse_special=true) and without them (parse_special=false:
special-token strings in user text are plain text).

The corpus is generated deterministically: Python standard-library source and its
docstrings (prose), non-Latin scripts, emoji with ZWJ sequences and modifiers, decomposed
(NFD) text, digit runs, whitespace runs (incl. Unicode spaces, CR/LF mixes), text with
special-token strings. Round trip: decode(encode(x)) == NFC(x).

usage: test-tokenizer-oracle.py TOKENIZE_TOOL MODELS_DIR  (exit 77 without models)
"""
import os
import random
import struct
import subprocess
import sys
import unicodedata

MODELS = ["qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"]
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def reference(path):
    from gguf import GGUFReader
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    r = GGUFReader(path)
    f = r.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    f = r.fields["tokenizer.ggml.merges"]
    merges = [tuple(bytes(f.parts[i]).decode("utf-8").split(" ", 1)) for i in f.data]
    f = r.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    special = [t for t, ty in zip(tokens, types) if ty in (3, 4)]
    base = {t: i for i, t in enumerate(tokens) if types[i] == 1}

    def build(with_added):
        tk = Tokenizer(models.BPE(vocab=dict(base), merges=merges, fuse_unk=False, byte_fallback=False))
        tk.normalizer = normalizers.NFC()
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tk.decoder = decoders.ByteLevel()
        if with_added:
            tk.add_tokens([AddedToken(t, special=True, normalized=False) for t in special])
            for t in special:
                assert tk.token_to_id(t) == tokens.index(t), t
        return tk

    return build(True), build(False)


def corpus(seed=2026):
    rng = random.Random(seed)
    docs = []
    stdlib = os.path.dirname(os.__file__)
    files = sorted(f for f in os.listdir(stdlib) if f.endswith(".py"))
    size = 0
    for name in files:  # Python source, whole files, in a fixed order, until 1.2 MB
        try:
            text = open(os.path.join(stdlib, name), encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        docs.append(text)
        size += len(text.encode())
        if size > 1_500_000:
            break
    import ast
    prose = []
    for text in docs[:60]:  # docstrings = English prose
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                d = ast.get_docstring(node)
                if d:
                    prose.append(d)
    docs.append("\n\n".join(prose)[:400_000])
    scripts = [(0x4E00, 0x9FFF), (0x0400, 0x04FF), (0x0600, 0x06FF), (0x0900, 0x097F), (0xAC00, 0xD7A3),
               (0x3040, 0x30FF), (0x0370, 0x03FF), (0x0E00, 0x0E7F), (0x05D0, 0x05EA)]
    for _ in range(400):  # non-Latin scripts mixed with Latin, digits and punctuation
        parts = []
        for _ in range(rng.randint(5, 60)):
            kind = rng.random()
            if kind < 0.5:
                lo, hi = rng.choice(scripts)
                parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 8))))
            elif kind < 0.7:
                parts.append(rng.choice(["hello", "World", "naïve", "café", "straße", "ÆØÅ", "x"]))
            elif kind < 0.85:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 30))))
            else:
                parts.append(rng.choice([",", ".", "!?", "...", "—", "«»", "()", "'s", "'LL", "’"]))
        docs.append(rng.choice([" ", "", "  ", "\n"]).join(parts))
    emoji = ["😀", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷", "❤️", "🤖", "✨", "🐍"]
    for _ in range(300):
        docs.append("".join(rng.choice(emoji + [" ", "a", "\n", "1"]) for _ in range(rng.randint(1, 50))))
    for _ in range(300):  # decomposed Unicode
        word = "".join(rng.choice("àéîõüñçÅøœǅḱ한글ガ") for _ in range(rng.randint(1, 12)))
        docs.append(unicodedata.normalize("NFD", word) + " " + unicodedata.normalize("NFKD", word))
    ws = [" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2003", "\u0085", "\u2028", "\v", "\f"]
    for _ in range(300):  # whitespace and digit runs
        docs.append("".join(rng.choice(ws) * rng.randint(1, 40) + rng.choice(["x", "1234567890" * rng.randint(1, 5), ""])
                            for _ in range(rng.randint(1, 10))))
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
                "<|im_start", "|im_end|>", "<<|im_end|>>", "[PAD151665]"]
    for _ in range(300):
        docs.append("".join(rng.choice(specials + ["user\n", " hi", "\n", "x", "<", "|"]) for _ in range(rng.randint(1, 20))))
    return docs


def run_tool(tool, model, docs, special):
    data = b"".join(struct.pack("<I", len(d.encode())) + d.encode() for d in docs)
    out = subprocess.run([tool, model] + (["--special"] if special else []), input=data,
                         capture_output=True, check=True).stdout
    res, at = [], 0
    for _ in docs:
        (n,) = struct.unpack_from("<i", out, at)
        at += 4
        res.append(list(struct.unpack_from(f"<{n}i", out, at)) if n >= 0 else None)
        at += 4 * max(n, 0)
    return res


def main():
    tool, models_dir = sys.argv[1], sys.argv[2]
    paths = [os.path.join(models_dir, m) for m in MODELS if os.path.exists(os.path.join(models_dir, m))]
    if not paths:
        print("no models fetched: skipping")
        sys.exit(77)
    docs = corpus()
    total = sum(len(d.encode()) for d in docs)
    print(f"corpus: {len(docs)} documents, {total / 1e6:.2f} MB")
    assert total >= 2_000_000
    bad = 0
    for path in paths:
        with_added, plain = reference(path)
        for special, ref in ((True, with_added), (False, plain)):
            ours = run_tool(tool, path, docs, special)
            refs = [e.ids for e in ref.encode_batch(docs, add_special_tokens=False)]
            diff = [i for i, (a, b) in enumerate(zip(ours, refs)) if a != b]
            ntok = sum(len(r) for r in refs)
            print(f"{os.path.basename(path)} parse_special={special}: {len(docs) - len(diff)}/{len(docs)} documents "
                  f"identical, {ntok} tokens")
            for i in diff[:5]:
                a, b = ours[i] or [], refs[i]
                k = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
                print(f"  doc {i}: first difference at token {k}: ours {a[k:k + 6]} ref {b[k:k + 6]} "
                      f"text {docs[i][:80]!r}")
            bad += len(diff)
            # round trip: decode(encode(x)) == NFC(x) (without specials, ids decode to the text)
            if not special:
                dec = ref.decode_batch(ours, skip_special_tokens=False)
                rt = sum(1 for d, x in zip(dec, docs) if d != unicodedata.normalize("NFC", x))
                print(f"  round trip decode(encode(x)) != NFC(x): {rt} documents")
                bad += rt
    print("FAILED" if bad else "tokenizer identical to the reference")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
