#!/usr/bin/env python3
"""Regenerate the Qwen2 forward-pass golden outputs in tests/oracle/golden/.

The goldens are an independent reference for kvlingo's own Qwen2 forward pass: each
packaged Qwen2.5-Coder GGUF model is loaded with Hugging Face transformers straight from
the GGUF file (weights dequantised to float32), run on the CPU in fp32 with eager
attention over a fixed set of prompts, and the results are written as one GGUF file per
model, which kvlingo's C GGUF reader can open. Per prompt i the file holds:

  p<i>.tokens         int32 [n]        prompt token ids (no BOS: Qwen adds none)
  p<i>.topk_ids       int32 [n, 50]    ids of the 50 most likely next tokens, by position
  p<i>.topk_logprobs  f32   [n, 50]    their log-softmax values, descending
  p<i>.next_logprob   f32   [n-1]      log-prob of the prompt's actual next token
  p<i>.k.l<L>         f32   [m, kv]    output of layer L's k_proj (bias added, before RoPE)
  p<i>.v.l<L>         f32   [m, kv]    output of layer L's v_proj (bias added)

Shapes are numpy's (row-major); GGUF stores them reversed (ne[0] = the last, contiguous
dimension), so row r of each tensor is position r. kv = n_kv_heads * head_dim; m = n for
the first two prompts and min(n, 64) for the others. L runs over the first, middle and
last layer (metadata golden.layers).

Before any forward pass the script checks, and aborts on failure, that:
  * the model file's SHA-256 matches scripts/models.tsv (when that file is there);
  * transformers did not tie lm_head to the embeddings: lm_head.weight is bit-identical to
    the gguf package's dequantisation of `output.weight`, embed_tokens to `token_embd.weight`,
    and every other parameter to its GGUF tensor (mapped here by hand, unpermuted);
  * the config agrees with the GGUF metadata and the expected Qwen2 values (RoPE base 1e6,
    RMS eps 1e-6, head counts, head dim);
  * the tokenizer adds no BOS, keeps <|im_start|>/<|im_end|> as single special tokens,
    and decodes every prompt back to its text;
  * a from-scratch float64 forward pass written here (RMSNorm, NeoX-style RoPE, GQA,
    SwiGLU) over the dequantised GGUF tensors agrees with transformers' logits and its
    pre-RoPE K/V captures on the first two prompts.

The prompt texts are fixed: literal strings below, or byte ranges of CPython 3.11.7
standard-library files whose SHA-256 is checked (pass --stdlib to point at another copy
of the same files). Needs the oracle venv (scripts/requirements-oracle.txt), not .venv.
"""
import argparse
import hashlib
import math
import os
import sys
import sysconfig
import time

import numpy as np
import torch
import transformers
import gguf
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOPK = 50
KV_FULL_PROMPTS = 2       # prompts 0 and 1 keep K/V at every position
KV_PREFIX = 64            # the others keep the first 64 positions
CHECK_PROMPTS = (0, 1)    # prompts re-run through the float64 reference forward

MODELS = [
    # (short name, file in the model cache)
    ("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
]

# Expected architecture facts (docs/models.md), checked against both HF config and GGUF.
EXPECT = {
    "qwen2.5-coder-0.5b": dict(n_layer=24, n_embd=896, n_head=14, n_kv=2, head_dim=64, n_ff=4864),
    "qwen2.5-coder-1.5b": dict(n_layer=28, n_embd=1536, n_head=12, n_kv=2, head_dim=128, n_ff=8960),
}
ROPE_THETA = 1.0e6
RMS_EPS = 1.0e-6
IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643

# Each prompt: name, then either text= (a literal) or stdlib=(path, start, end, sha256)
# for a byte range [start, end) of a standard-library file; "wrap" puts the slice into a
# chat template. "ntok" is asserted when given.
CHAT_SYSTEM = "You are a careful Python reviewer. Answer briefly and show code when it helps."
CHAT_TEXT = (
    "<|im_start|>system\n" + CHAT_SYSTEM + "<|im_end|>\n"
    "<|im_start|>user\n"
    "How do I remove duplicates from a list but keep the original order?<|im_end|>\n"
    "<|im_start|>assistant\n"
    "Use a dict, which remembers insertion order since Python 3.7:\n\n"
    "```python\n"
    "def dedupe(items):\n"
    "    return list(dict.fromkeys(items))\n"
    "```\n\n"
    "`dedupe([3, 1, 3, 2, 1])` returns `[3, 1, 2]`. The items must be hashable.<|im_end|>\n"
    "<|im_start|>user\n"
    "And if the items are lists, which are not hashable?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def chat_wrap_colorsys(code):
    return (
        "<|im_start|>system\n" + QWEN_DEFAULT_SYSTEM + "<|im_end|>\n"
        "<|im_start|>user\n"
        "What does this function compute, and what happens when r, g and b are equal?\n\n"
        "```python\n" + code + "```<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


PROMPTS = [
    dict(name="short-16", kind="English sentence (literal)", ntok=16,
         text="The quick brown fox jumps over the lazy dog, and then it runs away."),
    dict(name="python-bisect", kind="Python source",
         stdlib=("bisect.py", 0, 944, "45bec6e93d6388d9b94a4a88a288ac015fa065aa663201ce82de45753419ed6e"),
         lines="1-30"),
    dict(name="prose-heapq-about", kind="English prose (heapq.__about__, non-ASCII, ASCII-art tree)",
         stdlib=("heapq.py", 1528, 4254, "5c51933de47b988aecf6fa38f457b3b81bdfb187a6e5319357f9aba0f4f6d3eb"),
         lines="37-90"),
    dict(name="chat-dedupe", kind="chat (ChatML, literal, multi-turn)", text=CHAT_TEXT),
    dict(name="python-heldout", kind="held-out Python source slice (perplexity check)",
         stdlib=("functools.py", 19448, 22655, "f23dc0d93c85c3b3b4fb3c3103220cf9ad901b6be448599aaab7161e3873f7a6"),
         lines="525-600"),
    dict(name="python-long-1024", kind="Python source (module docstring + code)", ntok=1024,
         stdlib=("statistics.py", 0, 4300, "e1589afa6d29189310a517d55da77ae24cad560a28f9e748576078ab62aa58cf"),
         lines="1-136, cut inside line 136"),
    dict(name="prose-textwrap", kind="English prose (TextWrapper docstring)",
         stdlib=("textwrap.py", 489, 2845, "ba271c0238bccb6b4685c114a627286df2dc61c8e3d710fcd351d2c3c5a94717"),
         lines="17-64"),
    dict(name="python-json-scanstring", kind="Python source",
         stdlib=("json/decoder.py", 1701, 4216, "69784f8187781ba35f85f9df41dcc572cb847154fcd5ab7bca5489684e4ba675"),
         lines="69-135"),
    dict(name="chat-colorsys", kind="chat (ChatML, Qwen default system prompt, code in user turn)",
         stdlib=("colorsys.py", 3182, 3595, "1eb8d9ebc9392d4cb08cd19bea6039542631e6996b1d718577751a09eb2e0e04"),
         lines="125-143", wrap=chat_wrap_colorsys),
]


def log(*a):
    print(*a, flush=True)


def fail(msg):
    raise SystemExit("make-goldens: CHECK FAILED: " + msg)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def load_prompts(stdlib):
    out = []
    for p in PROMPTS:
        p = dict(p)
        if "stdlib" in p:
            rel, a, b, want = p["stdlib"]
            data = open(os.path.join(stdlib, rel), "rb").read()[a:b]
            got = hashlib.sha256(data).hexdigest()
            if got != want:
                fail(f"{rel}[{a}:{b}] has sha256 {got}, want {want} (not CPython 3.11.7's file?)")
            text = data.decode("utf-8")
            src = f"CPython 3.11.7 Lib/{rel} bytes [{a},{b}) (lines {p['lines']}), sha256 {want}"
            if "wrap" in p:
                text = p["wrap"](text)
                src = "ChatML conversation written in make-goldens.py around " + src
            p["text"], p["source"] = text, src
        else:
            p["source"] = "literal text in tests/oracle/make-goldens.py"
        out.append(p)
    return out


def gguf_meta(reader, key):
    f = reader.fields[key]
    v = f.parts[f.data[0]]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(v).decode()
    return v[0].item()


def hf_name(gname):
    """GGUF tensor name -> HF Qwen2ForCausalLM parameter name (no permutation for qwen2)."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gname in top:
        return top[gname]
    _, bid, rest = gname.split(".", 2)
    sub = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
           "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
           "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
           "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
           "attn_output.weight": "self_attn.o_proj.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
           "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}[rest]
    return f"model.layers.{bid}.{sub}"


# ---------------------------------------------------------------------------------------
# Reference forward pass in float64, written from the Qwen2 definition, over the GGUF
# tensors (dequantised by the gguf package), one layer's weights in memory at a time.
# While it walks the file it also checks every tensor against the HF model's parameter.

def rms_norm(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope_neox(x, theta):
    """x: (n, heads, d). Rotates pairs (j, j + d/2) by pos * theta^(-2j/d)."""
    n, _, d = x.shape
    half = d // 2
    inv = theta ** (-torch.arange(0, half, dtype=torch.float64) * 2.0 / d)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def reference_forward(reader, model, hp, token_lists, layers):
    """Returns per prompt the float64 log-softmax, {layer: (K, V)} and the log-softmax with
    token_embd as the head, and the number of tensors checked."""
    hf = dict(model.named_parameters())
    by_name = {t.name: t for t in reader.tensors}
    seen = set()

    def W(gname):
        t = by_name[gname]
        w = dequantize(t.data, t.tensor_type)
        w = np.array(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])  # writable copy
        name = hf_name(gname)
        p = hf[name].detach()
        if tuple(p.shape) != w.shape or not torch.equal(p, torch.from_numpy(w)):
            diff = (p - torch.from_numpy(w)).abs().max().item() if tuple(p.shape) == w.shape else "shape"
            fail(f"HF parameter {name} {tuple(p.shape)} != dequantised GGUF {gname} {w.shape} (max diff {diff})")
        seen.add(name)
        return torch.from_numpy(w).double()

    nh, nkv, hd, eps, theta = hp["n_head"], hp["n_kv"], hp["head_dim"], hp["eps"], hp["theta"]
    emb = W("token_embd.weight")
    xs = [emb[torch.tensor(toks, dtype=torch.long)] for toks in token_lists]
    del emb
    kvs = [dict() for _ in token_lists]
    for il in range(hp["n_layer"]):
        g = lambda s: W(f"blk.{il}.{s}")  # noqa: E731
        wn, wq, bq, wk, bk, wv, bv, wo = (g("attn_norm.weight"), g("attn_q.weight"), g("attn_q.bias"),
                                          g("attn_k.weight"), g("attn_k.bias"), g("attn_v.weight"),
                                          g("attn_v.bias"), g("attn_output.weight"))
        fn, wg, wu, wd = g("ffn_norm.weight"), g("ffn_gate.weight"), g("ffn_up.weight"), g("ffn_down.weight")
        for ip, x in enumerate(xs):
            n = x.shape[0]
            h = rms_norm(x, wn, eps)
            q = (h @ wq.T + bq).view(n, nh, hd)
            k = h @ wk.T + bk
            v = h @ wv.T + bv
            if il in layers:
                kvs[ip][il] = (k.clone(), v.clone())
            q = rope_neox(q, theta)
            k = rope_neox(k.view(n, nkv, hd), theta)
            v = v.view(n, nkv, hd)
            rep = nh // nkv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
            s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
            s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
            a = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, nh * hd)
            x = x + a @ wo.T
            h = rms_norm(x, fn, eps)
            x = x + (torch.nn.functional.silu(h @ wg.T) * (h @ wu.T)) @ wd.T
            xs[ip] = x
    on = W("output_norm.weight")
    hs = [rms_norm(x, on, eps) for x in xs]
    out = W("output.weight")
    lps = [torch.log_softmax(h @ out.T, dim=-1) for h in hs]
    del out
    # What a forward that wrongly ties the head to token_embd would produce (for tolerances).
    emb = W("token_embd.weight")
    tied = [torch.log_softmax(h @ emb.T, dim=-1) for h in hs]
    missing = set(hf) - seen
    if missing:
        fail(f"HF parameters with no GGUF tensor: {sorted(missing)[:5]}")
    if len(seen) != len(reader.tensors):
        fail(f"checked {len(seen)} parameters but the GGUF has {len(reader.tensors)} tensors")
    return lps, kvs, tied, len(seen)


# ---------------------------------------------------------------------------------------

def check_config(model, reader, short):
    cfg = model.config
    e = EXPECT[short]
    arch = gguf_meta(reader, "general.architecture")
    if arch != "qwen2":
        fail(f"general.architecture is {arch}")
    meta = dict(
        n_layer=gguf_meta(reader, "qwen2.block_count"), n_embd=gguf_meta(reader, "qwen2.embedding_length"),
        n_head=gguf_meta(reader, "qwen2.attention.head_count"),
        n_kv=gguf_meta(reader, "qwen2.attention.head_count_kv"),
        n_ff=gguf_meta(reader, "qwen2.feed_forward_length"),
        theta=gguf_meta(reader, "qwen2.rope.freq_base"),
        eps=gguf_meta(reader, "qwen2.attention.layer_norm_rms_epsilon"))
    meta["head_dim"] = meta["n_embd"] // meta["n_head"]
    rp = getattr(cfg, "rope_parameters", None) or {}
    hf_theta = rp.get("rope_theta", getattr(cfg, "rope_theta", None))
    hf_head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    hf = dict(n_layer=cfg.num_hidden_layers, n_embd=cfg.hidden_size, n_head=cfg.num_attention_heads,
              n_kv=cfg.num_key_value_heads, n_ff=cfg.intermediate_size, head_dim=hf_head_dim)
    for key, want in e.items():
        if meta[key] != want or hf[key] != want:
            fail(f"{key}: expected {want}, GGUF says {meta[key]}, HF config says {hf[key]}")
    if meta["theta"] != ROPE_THETA or hf_theta != ROPE_THETA:
        fail(f"rope theta: GGUF {meta['theta']}, HF {hf_theta}, expected {ROPE_THETA}")
    # GGUF stores eps as float32, so 1e-6 arrives as 9.99999997e-07 in both places.
    if abs(meta["eps"] - RMS_EPS) > 1e-12 or abs(cfg.rms_norm_eps - RMS_EPS) > 1e-12:
        fail(f"rms eps: GGUF {meta['eps']!r}, HF {cfg.rms_norm_eps!r}")
    if rp.get("rope_type", "default") != "default" or getattr(cfg, "use_sliding_window", False):
        fail(f"unexpected rope scaling / sliding window: {rp} {cfg.use_sliding_window}")
    if cfg.vocab_size != 151936 or cfg.hidden_act != "silu":
        fail(f"vocab {cfg.vocab_size} act {cfg.hidden_act}")
    if getattr(model.config, "tie_word_embeddings", None):
        fail("transformers tied lm_head to the embeddings although the file has output.weight")
    log(f"  config OK: layers {meta['n_layer']}, embd {meta['n_embd']}, heads {meta['n_head']}/{meta['n_kv']} "
        f"(head dim {meta['head_dim']}), ffn {meta['n_ff']}, rope theta {hf_theta:g}, rms eps {cfg.rms_norm_eps!r}, "
        f"tie_word_embeddings {cfg.tie_word_embeddings}, attn {cfg._attn_implementation}")
    return meta


def check_tokenizer(tok, reader, prompts):
    notes = []
    if getattr(tok, "add_bos_token", False):
        fail("tokenizer adds BOS")
    if gguf_meta(reader, "tokenizer.ggml.bos_token_id") != ENDOFTEXT:
        fail("unexpected bos id in GGUF")
    for s, want in (("<|im_start|>", IM_START), ("<|im_end|>", IM_END), ("<|endoftext|>", ENDOFTEXT)):
        ids = tok(s, add_special_tokens=True).input_ids
        if ids != [want]:
            fail(f"{s} tokenizes to {ids}, want [{want}]")
    toks = []
    for i, p in enumerate(prompts):
        ids = tok(p["text"], add_special_tokens=True).input_ids
        if ids != tok(p["text"], add_special_tokens=False).input_ids:
            fail(f"p{i}: add_special_tokens changes the tokens")
        if "ntok" in p and len(ids) != p["ntok"]:
            fail(f"p{i} {p['name']}: {len(ids)} tokens, want {p['ntok']}")
        back = tok.decode(ids, skip_special_tokens=False)
        if back != p["text"]:
            fail(f"p{i} {p['name']}: decode(tokenize(text)) != text")
        if p["text"].count("<|im_start|>") != ids.count(IM_START) or p["text"].count("<|im_end|>") != ids.count(IM_END):
            fail(f"p{i}: special tokens in the text were not kept whole")
        toks.append(ids)
    # Informational: does the GGUF's chat template reproduce the literal conversation?
    try:
        msgs = [{"role": "system", "content": CHAT_SYSTEM},
                {"role": "user", "content": "How do I remove duplicates from a list but keep the original order?"}]
        rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        want = CHAT_TEXT.split("<|im_start|>assistant\n")[0] + "<|im_start|>assistant\n"
        notes.append("chat template renders the ChatML layout used here: " + str(rendered == want))
    except Exception as ex:  # noqa: BLE001
        notes.append(f"chat template not usable: {ex!r}")
    return toks, notes


def run_model(short, fname, args, prompts, models_tsv):
    t0 = time.time()
    path = os.path.join(args.models_dir, fname)
    log(f"== {short}: {path}")
    digest = sha256_file(path)
    if short in models_tsv and models_tsv[short] != digest:
        fail(f"{fname} sha256 {digest} != scripts/models.tsv {models_tsv[short]}")
    log(f"  sha256 {digest} ({'matches scripts/models.tsv' if short in models_tsv else 'no manifest entry'})")

    reader = GGUFReader(path)
    tok = transformers.AutoTokenizer.from_pretrained(args.models_dir, gguf_file=fname)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.models_dir, gguf_file=fname, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    t_load = time.time() - t0
    log(f"  loaded in {t_load:.0f}s: {type(model).__name__}, tokenizer {type(tok).__name__}")

    hp = check_config(model, reader, short)
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    if emb.data_ptr() == head.data_ptr():
        fail("lm_head shares storage with embed_tokens")
    token_lists, notes = check_tokenizer(tok, reader, prompts)
    for nline in notes:
        log("  " + nline)

    layers = [0, hp["n_layer"] // 2, hp["n_layer"] - 1]
    results = []
    with torch.inference_mode():
        for i, (p, toks) in enumerate(zip(prompts, token_lists)):
            t1 = time.time()
            cap = {}
            hooks = []
            for il in layers:
                attn = model.model.layers[il].self_attn
                for which, mod in (("k", attn.k_proj), ("v", attn.v_proj)):
                    hooks.append(mod.register_forward_hook(
                        lambda m, inp, out, key=(which, il): cap.__setitem__(key, out[0].float().clone())))
            ids = torch.tensor([toks], dtype=torch.long)
            logits = model(input_ids=ids, use_cache=False).logits[0]
            for h in hooks:
                h.remove()
            lp = torch.log_softmax(logits.double(), dim=-1)
            del logits
            top = torch.topk(lp, TOPK, dim=-1)
            nxt = lp[torch.arange(len(toks) - 1), ids[0, 1:]]
            ppl = math.exp(-nxt.mean().item())
            m = len(toks) if i < KV_FULL_PROMPTS else min(len(toks), KV_PREFIX)
            r = dict(tokens=np.array(toks, dtype=np.int32),
                     topk_ids=top.indices.to(torch.int32).numpy(),
                     topk_logprobs=top.values.float().numpy(),
                     next_logprob=nxt.float().numpy(), ppl=ppl,
                     kv={k: t[:m].numpy() for k, t in cap.items()},
                     kv_full={k: t for k, t in cap.items()} if i in CHECK_PROMPTS else None,
                     lp=lp if i in CHECK_PROMPTS else None)
            del lp
            top1 = (r["topk_ids"][:-1, 0] == r["tokens"][1:]).mean()
            log(f"  p{i} {p['name']:24s} n={len(toks):5d}  ppl {ppl:8.3f}  top-1 acc {top1:.3f}  "
                f"({time.time() - t1:.1f}s)")
            results.append(r)

    # Independent check: float64 forward from the GGUF tensors, and the full parameter map.
    t1 = time.time()
    with torch.no_grad():
        ref_lps, ref_kvs, ref_tied, n_checked = reference_forward(
            reader, model, hp, [token_lists[i] for i in CHECK_PROMPTS], layers)
    log(f"  weights OK: all {n_checked} HF parameters bit-identical to gguf-dequantised tensors "
        f"(lm_head == output.weight, embed_tokens == token_embd.weight, q/k unpermuted)")
    with torch.no_grad():
        lm_vs_emb = (head - emb).abs().max().item()
    log(f"  lm_head vs token_embd: max |diff| {lm_vs_emb:.4g} (separate tensors, as expected)")
    if lm_vs_emb == 0:
        fail("output.weight equals token_embd.weight; cannot tell tying apart")
    checks = {}
    for j, i in enumerate(CHECK_PROMPTS):
        r = results[i]
        d_lp = (ref_lps[j] - r["lp"]).abs().max().item()
        agree = (ref_lps[j].argmax(-1).numpy() == r["topk_ids"][:, 0]).mean()
        d_kv = max((ref_kvs[j][il][0 if w == "k" else 1] - r["kv_full"][(w, il)].double()).abs().max().item()
                   for w in ("k", "v") for il in layers)
        d_tied = (ref_tied[j] - ref_lps[j]).abs().max().item()
        agree_tied = (ref_tied[j].argmax(-1) == ref_lps[j].argmax(-1)).double().mean().item()
        log(f"  reference fp64 vs transformers fp32, p{i}: max |logprob diff| {d_lp:.3g}, "
            f"argmax agreement {agree:.3f}, max |K/V diff| {d_kv:.3g}")
        log(f"  head = token_embd instead of output.weight, p{i}: max |logprob diff| {d_tied:.3g}, "
            f"argmax agreement {agree_tied:.3f}")
        if d_lp > 5e-2 or agree < 0.99 or d_kv > 1e-2:
            fail(f"transformers disagrees with the reference forward on p{i}")
        if d_tied <= 10 * d_lp:
            fail(f"p{i}: a tied head is indistinguishable from the real one at this precision")
        checks[i] = (d_lp, agree, d_kv, d_tied)
        r["lp"] = r["kv_full"] = None
    log(f"  reference forward done in {time.time() - t1:.0f}s")

    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, short + ".golden")  # GGUF container, .golden so it is never taken for weights
    w = GGUFWriter(out, arch="golden")
    w.add_string("golden.model", short)
    w.add_string("golden.model_file", fname)
    w.add_string("golden.model_sha256", digest)
    w.add_uint32("golden.n_prompts", len(prompts))
    w.add_array("golden.layers", layers)
    w.add_uint32("golden.topk", TOPK)
    w.add_float64("golden.rope_theta", float(hp["theta"]))
    w.add_float64("golden.rms_eps", float(hp["eps"]))
    w.add_string("golden.reference", "transformers AutoModelForCausalLM from the GGUF file, CPU, fp32, eager "
                 "attention; log-softmax taken in float64 from the fp32 logits")
    w.add_string("golden.kv_layout", "k_proj/v_proj outputs incl. bias, before RoPE; row = position, "
                 "columns = kv_head * head_dim + d")
    w.add_string("golden.torch_version", torch.__version__)
    w.add_string("golden.transformers_version", transformers.__version__)
    w.add_string("golden.gguf_version", _gguf_version())
    w.add_string("golden.python_version", sys.version.split()[0])
    w.add_string("golden.check.lm_head", "lm_head.weight bit-identical to dequantised output.weight; "
                 "tie_word_embeddings false")
    for i, (p, r) in enumerate(zip(prompts, results)):
        w.add_string(f"golden.p{i}.name", p["name"])
        w.add_string(f"golden.p{i}.kind", p["kind"])
        w.add_string(f"golden.p{i}.source", p["source"])
        w.add_string(f"golden.p{i}.text", p["text"])
        w.add_uint32(f"golden.p{i}.n_tokens", len(r["tokens"]))
        w.add_uint32(f"golden.p{i}.kv_positions", int(next(iter(r["kv"].values())).shape[0]))
        w.add_float64(f"golden.p{i}.ppl", r["ppl"])
        if i in checks:
            w.add_float64(f"golden.p{i}.check.fp64_max_logprob_diff", checks[i][0])
            w.add_float64(f"golden.p{i}.check.fp64_max_kv_diff", checks[i][2])
            w.add_float64(f"golden.p{i}.check.tied_head_max_logprob_diff", checks[i][3])
    for i, r in enumerate(results):
        w.add_tensor(f"p{i}.tokens", r["tokens"])
        w.add_tensor(f"p{i}.topk_ids", np.ascontiguousarray(r["topk_ids"]))
        w.add_tensor(f"p{i}.topk_logprobs", np.ascontiguousarray(r["topk_logprobs"]))
        w.add_tensor(f"p{i}.next_logprob", np.ascontiguousarray(r["next_logprob"]))
        for il in layers:
            w.add_tensor(f"p{i}.k.l{il}", np.ascontiguousarray(r["kv"][("k", il)], dtype=np.float32))
            w.add_tensor(f"p{i}.v.l{il}", np.ascontiguousarray(r["kv"][("v", il)], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    verify_written(out, results, len(prompts))
    log(f"  wrote {out} ({os.path.getsize(out)} bytes, read back OK); {short} took {time.time() - t0:.0f}s")
    del model
    return [r["tokens"] for r in results]


def verify_written(path, results, n_prompts):
    """Reads the golden back: every tensor present, ne[0] the contiguous dim, data intact."""
    r = GGUFReader(path)
    got = {t.name: t for t in r.tensors}
    if gguf_meta(r, "golden.n_prompts") != n_prompts:
        fail("golden.n_prompts did not round-trip")
    for i, res in enumerate(results):
        want = {f"p{i}.tokens": res["tokens"], f"p{i}.topk_ids": res["topk_ids"],
                f"p{i}.topk_logprobs": res["topk_logprobs"], f"p{i}.next_logprob": res["next_logprob"]}
        for (which, il), a in res["kv"].items():
            want[f"p{i}.{which}.l{il}"] = a
        for name, a in want.items():
            t = got[name]
            if [int(x) for x in t.shape] != list(reversed(a.shape)):   # GGUF: ne[0] = last numpy dim
                fail(f"{name}: ne {list(t.shape)} for numpy shape {a.shape}")
            if not np.array_equal(np.asarray(t.data).reshape(a.shape), a):
                fail(f"{name}: data did not round-trip")


def _gguf_version():
    try:
        from importlib.metadata import version
        return version("gguf")
    except Exception:  # noqa: BLE001
        return "unknown"


def read_manifest():
    path = os.path.join(REPO, "scripts", "models.tsv")
    out = {}
    if os.path.exists(path):
        for line in open(path):
            if line.strip() and not line.startswith("#"):
                cols = line.rstrip("\n").split("\t")
                out[cols[0]] = cols[-1]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="See tests/oracle/README.md.")
    ap.add_argument("--models-dir", default=os.environ.get(
        "KVLINGO_MODELS", os.path.expanduser("~/.cache/kvlingo/models")),
        help="model cache holding the GGUF files (default: $KVLINGO_MODELS or ~/.cache/kvlingo/models)")
    ap.add_argument("--out-dir", default=os.path.join(REPO, "tests", "oracle", "golden"),
                    help="where to write <model>.golden, a GGUF container (default: tests/oracle/golden)")
    ap.add_argument("--only", action="append", choices=[m[0] for m in MODELS],
                    help="regenerate only this model (repeatable)")
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"],
                    help="CPython 3.11.7 Lib/ directory the source prompts are cut from "
                         "(default: this interpreter's)")
    ap.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)),
                    help="torch CPU threads (default: 2)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, gguf {_gguf_version()}, "
        f"python {sys.version.split()[0]}, numpy {np.__version__}, threads {args.threads}")
    prompts = load_prompts(args.stdlib)
    manifest = read_manifest()
    t0 = time.time()
    tokens = {}
    for short, fname in MODELS:
        if args.only and short not in args.only:
            continue
        tokens[short] = run_model(short, fname, args, prompts, manifest)
    if len(tokens) == 2:
        a, b = tokens.values()
        same = all(np.array_equal(x, y) for x, y in zip(a, b))
        log(f"both models tokenize every prompt identically: {same}")
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
