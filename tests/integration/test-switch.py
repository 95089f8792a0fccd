#!/usr/bin/env python3
"""test-switch.py — model switching through kvlingod (DESIGN.md "Translation"): the
multi-turn protocol, the router and the quality gate, seen from a client.

  - 10 turns of one conversation (gRPC, token ids, a conversation id) alternating two
    models: at every turn the usage the daemon reports (translated, prefilled, cached)
    equals what this script derives on its own from the transcript — which model wrote
    which position natively, what each model's line already holds — never translating a
    position twice, the last prompt position always native;
  - two copies of one model joined by identity translators: the alternating conversation
    generates exactly the single-model conversation, token for token;
  - the router: cascade (the small model hands over mid-answer; routing, the model on each
    chunk and the metrics say so), prefill-offload, pinned;
  - the quality gate: identity translators between two *different* models are caught by
    the shadow re-prefills, the gate closes and requests say fallback_reprefill;
  - replica id and conversation counters over HTTP and /metrics.

usage: test-switch.py KVLINGOD PROTO_DIR tiny TINY_GGUF_TOOL TRANSLATOR_IDENTITY_TOOL
       test-switch.py KVLINGOD PROTO_DIR real MODELS_DIR TRANSLATOR_IDENTITY_TOOL MAPS_DIR
"""
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request

kvlingod, proto_dir, mode, where, identity_tool = sys.argv[1:6]
tmp = tempfile.mkdtemp(prefix="kvl-switch-")
if mode == "real":
    maps = sys.argv[6]
    A = os.path.join(where, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    B = os.path.join(where, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    if not (os.path.exists(A) and os.path.exists(B)):
        print("models missing (scripts/fetch-models): skipped")
        sys.exit(77)
    AB = os.path.join(maps, "qwen2.5-coder-0.5b-to-qwen2.5-coder-1.5b.safetensors")
    BA = os.path.join(maps, "qwen2.5-coder-1.5b-to-qwen2.5-coder-0.5b.safetensors")
    C = None
else:
    A, B, C = (os.path.join(tmp, f) for f in ("a.gguf", "b.gguf", "c.gguf"))
    subprocess.run([where, A, "2", "11"], check=True)
    subprocess.run([where, C, "2", "77"], check=True)  # other weights, same layout
    B = None
# identity translators between two copies of model A (and, tiny, between A and C)
AA = os.path.join(tmp, "a-to-a.safetensors")
subprocess.run([identity_tool, A, A, AA], check=True)
if C:
    AC, CA = os.path.join(tmp, "a-to-c.safetensors"), os.path.join(tmp, "c-to-a.safetensors")
    subprocess.run([identity_tool, A, C, AC], check=True)
    subprocess.run([identity_tool, C, A, CA], check=True)

import grpc  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Checks, load_protos  # noqa: E402

pb, rpc, _, _ = load_protos(proto_dir)
check = Checks()


daemons = []
grpc_port = {}  # stub id -> its daemon's gRPC port
# KVL_TEST_BACKEND=cuda-sim: every model on that backend (the CUDA backend compiled for the CPU)
be = f", backend: {os.environ['KVL_TEST_BACKEND']}" if os.environ.get("KVL_TEST_BACKEND") else ""


def start(models, translators, extra="", env=None, replica="r1"):
    if mode == "tiny" and "translation_precision" not in extra:
        # tiny: every translator is an identity, and the checks compare with the single
        # model token for token, which only fp32 products reproduce exactly
        extra += "translation_precision: fp32\n"
    cfg = os.path.join(tmp, f"d{len(daemons)}.yaml")
    with open(cfg, "w") as f:
        f.write(f"listen: 127.0.0.1\ngrpc_port: 0\nhttp_port: 0\nreplica_id: {replica}\nlog_level: info\n")
        f.write(f"spill_dir: {tmp}\nmax_prompt_tokens: 4096\n")
        f.write("models:\n" + "".join(f"  - {{name: {n}, path: {p}, hot_mib: 256, kv_dtype: f32{be}}}\n"
                                      for n, p in models))
        f.write("translators:\n" + "".join(f"  - {t}\n" for t in translators))
        f.write(extra)
    log = open(cfg + ".log", "w")
    d = subprocess.Popen([kvlingod, "--config", cfg], stdout=subprocess.PIPE, stderr=log, text=True,
                         env=dict(os.environ, **(env or {})))
    line = d.stdout.readline()
    if not line.startswith("kvlingod listening"):
        print("daemon did not start:", line, open(cfg + ".log").read()[-3000:])
        sys.exit(1)
    parts = dict(p.split("=", 1) for p in line.split()[2:])
    g, h = parts["grpc"].rsplit(":", 1)[1], parts["http"].rsplit(":", 1)[1]
    daemons.append(d)
    stub = rpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{g}"))
    grpc_port[id(stub)] = g
    if be and len(daemons) == 1:
        si = stub.ServerInfo(pb.ServerInfoRequest())
        check("kvl_sim" in si.backend and "cpu" not in si.backend,
              f"KVL_TEST_BACKEND={os.environ['KVL_TEST_BACKEND']}: every model on it ({si.backend!r})")
    return stub, int(h)


def metrics(hport):
    with urllib.request.urlopen(f"http://127.0.0.1:{hport}/metrics", timeout=10) as r:
        text = r.read().decode()
    fam = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            fam.setdefault(s.name, []).append(s)
    return fam


def mval(fam, name, **labels):
    return sum(s.value for s in fam.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def generate(inf, ids, model, n, conv=""):
    req = pb.GenerateRequest(tokens=pb.TokenIds(ids=ids), model=model, max_tokens=n, ignore_eos=True,
                             conversation_id=conv, sampling=pb.SamplingParams(temperature=0))
    chunks = list(inf.Generate(req))
    out = [t for c in chunks for t in c.token_ids]
    models = [c.model for c in chunks if c.token_ids]
    return out, models, chunks[-1]


HEAD = 32  # translate_native_head's default: every request computes its first 32 positions itself
rng = random.Random(5)
vocab = 300 if mode == "tiny" else 151000


def user_turn():
    if mode == "tiny":
        return [rng.randrange(3, 255) for _ in range(rng.randrange(5, 30))]
    words = ["def", " sort", " list", " the", " numbers", " please", " return", " python", " and", " explain"]
    text = "".join(rng.choice(words) for _ in range(rng.randrange(6, 20)))
    return list(inf_tok.Tokenize(pb.TokenizeRequest(model="a", text=text)).ids)


def conversation(inf, names, conv, turns=10, n_gen=6, derive=True):
    """Alternate names[t % len(names)]; check each turn's usage against the transcript."""
    seq, outs = [], []
    have = {m: 0 for m in set(names)}
    native = {m: {} for m in set(names)}
    bad = 0
    for t in range(turns):
        seq += user_turn()
        M = names[t % len(names)]
        out, _, last = generate(inf, seq, M, n_gen, conv)
        n = len(seq)
        u = last.usage
        exp_tr = exp_pf = 0
        exp_native = {}
        for p in range(have[M], n - 1):
            src = p >= HEAD and any(p < have[S] and native[S].get(p, False) for S in have if S != M)
            exp_native[p] = not src
            exp_tr += src
            exp_pf += not src
        exp_native[n - 1] = True
        exp_pf += 1
        if derive:
            ok = (u.translated_tokens == exp_tr and u.prefilled_tokens == exp_pf and
                  u.cached_native_tokens + u.cached_translated_tokens == have[M] and
                  u.untranslatable_tokens == 0 and u.declined_tokens == 0 and
                  (last.timings.translation_seconds > 0) == (exp_tr > 0))  # timed exactly when it translated
            want = pb.TRANSLATION_OUTCOME_APPLIED if exp_tr else pb.TRANSLATION_OUTCOME_NOT_NEEDED
            ok = ok and last.translation == want
            if not ok:
                print(f"   turn {t} on {M}: got translated {u.translated_tokens} prefilled {u.prefilled_tokens} "
                      f"cached {u.cached_native_tokens}+{u.cached_translated_tokens}; derived {exp_tr} {exp_pf} "
                      f"{have[M]}")
            bad += not ok
        L = n + len(out) - 1  # the last sampled token has no KV
        for p in range(have[M], L):
            native[M][p] = exp_native.get(p, True)
        have[M] = L
        seq += out
        outs.append(out)
    return seq, outs, bad


# ---- the protocol: spans derived from the transcript ------------------------------------
if mode == "real":
    pair = [("a", A), ("b", B)]
    inf, hport = start(pair, [AB, BA])
else:
    pair = [("a", A), ("b", A)]  # tiny: A and a copy of A through identity translators
    # fp32 products: in bf16 the un-rotated keys are rounded, and identity maps would no
    # longer reproduce the source's cache bit for bit (the token-for-token check below).
    # On KVL_TEST_BACKEND=cuda-sim the device translates in bf16 whatever this says: the
    # cache is then not bit for bit, and the tiny models' tokens still agree
    inf, hport = start(pair, [AA, AA], "translation_precision: fp32\n")  # one file, both directions
inf_tok = inf
if be:  # translations into a CUDA model run there, in bf16, whatever translation_precision says
    loaded = [json.loads(ln) for ln in open(os.path.join(tmp, "d0.yaml.log")) if '"translator_loaded"' in ln]
    check(len(loaded) == 2 and all(e["precision"] == "bf16" and e["backend"] == "cuda" for e in loaded),
          f"translator_loaded on {os.environ['KVL_TEST_BACKEND']}: bf16 on cuda "
          f"({[(e['precision'], e['backend']) for e in loaded]})")
elif mode == "real":  # the default precision, auto: whichever of fp32 and bf16 its probe timed faster
    flags = open("/proc/cpuinfo").read().split()
    has_bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    loaded = [json.loads(ln) for ln in open(os.path.join(tmp, "d0.yaml.log")) if '"translator_loaded"' in ln]
    want = [("bf16" if e["probe_ms_bf16"] < e["probe_ms_fp32"] else "fp32") if has_bf16 else "fp32" for e in loaded]
    probed = all((e["probe_ms_fp32"] > 0 and e["probe_ms_bf16"] > 0) == has_bf16 for e in loaded)
    got = [e.get("precision") for e in loaded]
    check(len(got) == 2 and got == want and probed,
          f"translation_precision auto: each translator in the precision its probe found faster ({got}; probes "
          f"{[(e['probe_ms_fp32'], e['probe_ms_bf16']) for e in loaded]}; bf16 GEMM here: {has_bf16})")
bad_cfg = os.path.join(tmp, "bad-precision.yaml")
with open(bad_cfg, "w") as f:
    f.write("grpc_port: 0\nhttp_port: -1\ntranslation_precision: fp16\n")
r = subprocess.run([kvlingod, "--config", bad_cfg], capture_output=True, text=True, timeout=60)
check(r.returncode != 0 and "translation_precision" in r.stderr and "auto, bf16 or fp32" in r.stderr,
      "translation_precision: fp16 refused by name: " + r.stderr.strip().splitlines()[-1][:120])
seq, outs, bad = conversation(inf, ["a", "b"], "conv-1", turns=10, n_gen=6 if mode == "tiny" else 8)
tr = mval(metrics(hport), "kvlingo:translated_tokens_total")
check(bad == 0, f"10 turns alternating a/b: every turn's translated/prefilled/cached spans equal those derived "
      f"from the transcript ({int(tr)} positions translated)")

if mode == "real":
    # identity: two copies of the 0.5B joined by identity translators
    inf2, hport2 = start([("a", A), ("b", A)], [AA, AA], "translation_precision: fp32\n", env={"KVL_DECODE": "exact"})
else:
    inf2, hport2 = inf, hport
rng.seed(9)
seq_alt, _, bad2 = conversation(inf2, ["a", "b"], "conv-alt")
rng.seed(9)
seq_one, _, _ = conversation(inf2, ["a"], "conv-one", derive=False)  # its prefix caches hold conv-alt
check(bad2 == 0 and seq_alt == seq_one,
      f"identity translators between two copies of one model: the alternating conversation equals the single-model "
      f"one token for token ({len(seq_one)} tokens)")

# ---- a chat conversation resent as text: the kept line is reused whole ---------------------
if mode == "real":
    msgs = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    lines = {}  # model -> positions its kept line holds
    ok = True
    for t, (model, ask) in enumerate([("a", None), ("b", "Now make it reverse the words instead."),
                                       ("a", "Add a docstring.")]):
        if ask:
            msgs.append({"role": "user", "content": ask})
        req = urllib.request.Request(f"http://127.0.0.1:{hport}/v1/chat/completions", method="POST",
                                     data=json.dumps({"model": model, "messages": msgs, "max_tokens": 40,
                                                      "temperature": 0}).encode(),
                                     headers={"Content-Type": "application/json", "x-kvlingo-conversation": "chat-1"})
        with urllib.request.urlopen(req, timeout=300) as r:
            body = json.loads(r.read())
        u, k = body["usage"], body["kvlingo"]["usage"]
        if model in lines:  # everything this model computed before is reused whole
            ok &= u["prompt_tokens_details"]["cached_tokens"] == lines[model]
        print(f"   turn {t} on {model}: prompt {u['prompt_tokens']}, cached {u['prompt_tokens_details']['cached_tokens']}, "
              f"translated {k['translated_tokens']}, prefilled {k['prefilled_tokens']}")
        ok &= t == 0 or (k["translated_tokens"] > 0 and k["translation_seconds"] > 0)
        lines[model] = u["prompt_tokens"] + u["completion_tokens"] - 1  # the last sampled token has no KV
        msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    check(ok, "chat resent as text with a conversation id: each turn reuses its model's line and translates the "
              "other model's answer")

# ---- the router ---------------------------------------------------------------------------
two = [("small", A), ("large", B if mode == "real" else A)]
tr_two = [AB, BA] if mode == "real" else [AA, AA]
prompt = user_turn() * 3 + list(range(40, 60))
casc, hc = start(two, tr_two, "router:\n  policy: cascade\n  cascade: {window: 3, max_mean_entropy: 0.001}\n",
                 replica="casc")
out, models, last = generate(casc, prompt, "auto", 10)
rt = last.routing
check(rt.policy == "cascade" and rt.decision == "escalated" and rt.from_model == "small" and rt.handoff_token == 3 and
      models[0] == "small" and models[-1] == "large" and len(out) == 10 and last.usage.handoffs == 1 and
      last.usage.translated_tokens == len(prompt) + 2 - HEAD and last.replica == "casc",
      f"cascade: small answers 3 tokens, large takes over from the translated cache ({rt.reason})")
if mode == "tiny":
    ref, _, _ = generate(casc, prompt, "small", 10)
    check(out == ref, "cascade through identity translators: the answer equals the small model's own")
fam = metrics(hc)
check(mval(fam, "kvlingo:handoffs_total", source="small", target="large") == 1 and
      mval(fam, "kvlingo:route_decisions_total", policy="cascade", decision="escalated") == 1,
      "cascade: /metrics counts the handoff and the decision")
out, models, last = generate(casc, prompt, "large", 4)
check(last.routing.policy == "requested" and models == ["large"] * len(models), "a named model is not routed")
# translate_native_tail: every request computes its last 8 positions itself (and, with
# translate_native_head 0, translates from position 0); the stateless
# protocol translates the rest of the prompt from the small model's indexed (full) blocks
tl8, _ = start(two, tr_two, "translate_native_tail: 8\ntranslate_native_head: 0\n", replica="tail8")
generate(tl8, prompt, "small", 1)
_, _, lt8 = generate(tl8, prompt, "large", 2)
want8 = (len(prompt) - 8) // 16 * 16  # whole indexed blocks before the tail (no native head here)
check(lt8.usage.translated_tokens == want8,
      f"translate_native_tail 8: {lt8.usage.translated_tokens} positions translated (want {want8}), "
      f"{lt8.usage.prefilled_tokens} prefilled")
# translate_warm_head: once small has served a conversation, large computes its first 32
# positions in the background (counted in /metrics); the switch then finds them in its
# prefix cache and prefills only what follows the translated span
wh, hwh = start(two, tr_two, "translate_warm_head: true\n", replica="warm")
generate(wh, prompt, "small", 1, conv="warm-1")
deadline = time.time() + 120
while time.time() < deadline:
    fam = metrics(hwh)
    if (mval(fam, "kvlingo:translator_head_warmups_total", source="small", target="large") >= 1 and
            mval(fam, "vllm:num_requests_running") + mval(fam, "vllm:num_requests_waiting") == 0):
        break
    time.sleep(0.05)
_, _, lwh = generate(wh, prompt + [7, 8, 9], "large", 2, conv="warm-1")
fam = metrics(hwh)
check(mval(fam, "kvlingo:translator_head_warmups_total", source="small", target="large") == 1 and
      mval(fam, "kvlingo:translator_head_warmups_total", source="large", target="small") == 0 and
      lwh.usage.cached_native_tokens == HEAD and lwh.usage.translated_tokens > 0,
      f"translate_warm_head: the switch found the head cached ({lwh.usage.cached_native_tokens} cached native, "
      f"{lwh.usage.translated_tokens} translated, {lwh.usage.prefilled_tokens} prefilled); none back into small, "
      "which holds the head already")
# router.handoff_native_tail: the large model computes the last 8 positions itself
casc8, _ = start(two, tr_two, "router:\n  policy: cascade\n  handoff_native_tail: 8\n"
                              "  cascade: {window: 3, max_mean_entropy: 0.001}\n", replica="casc8")
out8, models8, last8 = generate(casc8, prompt, "auto", 10)
check(last8.routing.decision == "escalated" and last8.routing.handoff_token == 3 and
      last8.usage.translated_tokens == len(prompt) + 3 - 8 - HEAD and (mode == "real" or out8 == ref),
      f"cascade with a native tail of 8: {last8.usage.translated_tokens} positions translated "
      f"(prompt {len(prompt)} + 3 - 8 - head {HEAD}), {last8.usage.prefilled_tokens} prefilled")

# the example router (clients/python/router.py) through the same daemon: per turn the
# cheapest adequate model; a switch translates what the other model wrote
router = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "clients", "python", "router.py")
turns = ["write a function that adds two numbers", "now make it handle lists",
         "prove that your function terminates", "thanks, rename it"]
rr = subprocess.run([sys.executable, router, "-s", f"127.0.0.1:{grpc_port[id(casc)]}", "--small", "small", "--large",
                     "large", "--max-tokens", "12", "--json", *turns], capture_output=True, text=True, timeout=300)
rows = [json.loads(line) for line in rr.stdout.splitlines() if line.startswith("{")]
check(rr.returncode == 0 and len(rows) == 4 and all(r["model"] in ("small", "large") for r in rows) and
      rows[2]["model"] == "large" and "prove" in rows[2]["why"] and
      sum(r["usage"]["translated"] for r in rows) > 0,
      "router.py: 4 turns answered, the hard one by large, switches translated "
      f"({[(r['model'], r['usage']['translated']) for r in rows]}){rr.stderr[-300:]}")

off, ho = start(two, tr_two, "router:\n  policy: prefill-offload\n  prefill_offload: {min_prompt_tokens: 16}\n")
out, models, last = generate(off, prompt, "auto", 5)
check(last.routing.decision == "prefill-offload" and set(models) == {"large"} and
      last.usage.translated_tokens == len(prompt) - 1 - HEAD and last.usage.prefilled_tokens == len(prompt) + HEAD and
      last.translation == pb.TRANSLATION_OUTCOME_APPLIED,
      f"prefill-offload: small prefills {len(prompt) - 1} positions, large translates them and decodes")
out, models, last = generate(off, prompt[:8], "auto", 3)
check(last.routing.decision == "large" and last.usage.translated_tokens == 0, "prefill-offload: a short prompt stays on large")

pin, hp = start(two, tr_two, "router:\n  policy: pinned\n", replica="pin")
_, m1, l1 = generate(pin, prompt, "auto", 3, conv="p-1")
_, m2, l2 = generate(pin, prompt + [5, 6, 7], "auto", 3, conv="p-1")
check(l1.routing.decision == "pinned" and l2.routing.decision == "pinned" and set(m1) == set(m2) == {"small"} and
      "pinned" in l2.routing.reason, "pinned: the conversation stays on its first model")
req = urllib.request.Request(f"http://127.0.0.1:{hp}/v1/completions", method="POST",
                             data=json.dumps({"model": "auto", "prompt": prompt[:10], "max_tokens": 2}).encode(),
                             headers={"Content-Type": "application/json", "x-kvlingo-conversation": "p-2"})
with urllib.request.urlopen(req, timeout=60) as r:
    body = json.loads(r.read())
    check(r.headers.get("x-kvlingo-replica") == "pin" and body["kvlingo"]["replica"] == "pin" and
          body["kvlingo"]["route"]["decision"] == "pinned", "HTTP: x-kvlingo-replica header and the kvlingo extension")
def http_complete(hport, body, conv):
    req = urllib.request.Request(f"http://127.0.0.1:{hport}/v1/completions", method="POST",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "x-kvlingo-conversation": conv})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


# HTTP's reprefill: the large model prefills what the small one holds instead of translating it
http_complete(hc, {"model": "small", "prompt": prompt, "max_tokens": 1}, "rp-1")
k = http_complete(hc, {"model": "large", "prompt": prompt + [5, 6], "max_tokens": 1, "reprefill": True},
                  "rp-1")["kvlingo"]["usage"]
other = [t + 1 for t in prompt]  # nothing of it is cached natively on large
http_complete(hc, {"model": "small", "prompt": other, "max_tokens": 1}, "rp-2")
k2 = http_complete(hc, {"model": "large", "prompt": other + [5, 6], "max_tokens": 1}, "rp-2")["kvlingo"]["usage"]
check(k["translated_tokens"] == 0 and k["declined_tokens"] > 0 and k2["translated_tokens"] > 0,
      f"HTTP reprefill: true declines translation ({k['declined_tokens']} positions prefilled), without it "
      f"{k2['translated_tokens']} are translated")
# a NUL in a prompt is text (the daemon writes U+0000 in answers; jansson refuses it unless asked)
nul = http_complete(hc, {"model": "small", "prompt": "a\u0000b", "max_tokens": 1}, "")
check(nul["usage"]["prompt_tokens"] >= 2, f"HTTP: a prompt with U+0000 is accepted ({nul['usage']['prompt_tokens']} tokens)")
fam = metrics(hp)
check(mval(fam, "kvlingo:conversations_started_total") == 2 and mval(fam, "kvlingo:conversation_turns_total") == 3 and
      mval(fam, "kvlingo:conversations_active") == 2, "conversation counters: 2 started, 3 turns, 2 active")
bad_conv = pb.GenerateRequest(tokens=pb.TokenIds(ids=prompt), model="auto", max_tokens=2, conversation_id="has space")
try:
    list(pin.Generate(bad_conv))
    check(False, "a bad conversation id is refused")
except grpc.RpcError as e:
    check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and "conversation" in e.details(),
          f"a bad conversation id is refused: {e.details()}")

# ---- the quality gate -------------------------------------------------------------------
if mode == "tiny":
    gate, hg = start([("a", A), ("c", C)], [AC, CA],
                     "quality_gate: {shadow_fraction: 1, max_online_kl: 0.05, min_shadows: 2}\n")
    outcomes = []
    for i in range(4):
        p = [i + 3] + prompt
        generate(gate, p, "a", 2)
        _, _, last = generate(gate, p + [9], "c", 2)
        outcomes.append(last.translation)
    fam = metrics(hg)
    check(outcomes[:2] == [pb.TRANSLATION_OUTCOME_APPLIED] * 2 and
          outcomes[2:] == [pb.TRANSLATION_OUTCOME_FALLBACK_REPREFILL] * 2 and
          mval(fam, "kvlingo:translator_gated", source="a", target="c") == 1 and
          mval(fam, "kvlingo:translator_shadows_total", source="a", target="c") == 2 and
          mval(fam, "kvlingo:translator_online_kl", source="a", target="c") > 0.05 and
          mval(fam, "kvlingo:translation_outcomes_total", outcome="fallback_reprefill") == 2,
          f"quality gate: a wrong translator is caught by 2 shadows (online KL "
          f"{mval(fam, 'kvlingo:translator_online_kl', source='a', target='c'):.3g}), then requests re-prefill")

for d in daemons:
    d.terminate()
for d in daemons:
    check(d.wait(timeout=60) == 0, "daemon exits 0 on SIGTERM")
print(f"{check.failed} failed")
sys.exit(1 if check.failed else 0)
