#!/usr/bin/env python3
"""test-daemon.py — kvlingod on 127.0.0.1 (ports 0) with the real pair, driven by the
Python grpcio client, HTTP and signals.

  - greedy Generate streams exactly what `kvlingo run` prints for the same prompt;
    Complete gives the same text
  - a table of bad inputs: each gets its status code and a message naming the problem,
    and the daemon keeps serving
  - cancelling a stream mid-way ends the request and frees its KV blocks
  - /metrics parses with prometheus_client and its counters equal the traffic sent
  - SIGTERM while 8 streams run: all 8 finish, new calls are refused, exit code 0
  - restart: the prefix cache comes back from the snapshot written at shutdown (same output,
    prompt blocks cached); a damaged snapshot is discarded with a warning

usage: test-daemon.py KVLINGOD KVLINGO PROTO_DIR real MODELS_DIR
       test-daemon.py KVLINGOD KVLINGO PROTO_DIR tiny TINY_GGUF_TOOL
(tiny: two tiny synthetic models with a tokenizer and a chat template, written by the
tool: the fast tier, no downloads.)
"""
import json
import os
import random
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

kvlingod, kvlingo, proto_dir, mode, where = sys.argv[1:6]
if mode == "real":
    small = os.path.join(where, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    large = os.path.join(where, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    if not (os.path.exists(small) and os.path.exists(large)):
        print("models missing (scripts/fetch-models): skipped")
        sys.exit(77)
else:
    tiny_dir = tempfile.mkdtemp(prefix="kvl-tiny-")
    small, large = os.path.join(tiny_dir, "small.gguf"), os.path.join(tiny_dir, "large.gguf")
    subprocess.run([where, small, "2", "1"], check=True)
    subprocess.run([where, large, "3", "2"], check=True)

import grpc  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Checks, load_protos  # noqa: E402

pb, rpc, health_pb2, health_pb2_grpc = load_protos(proto_dir)

check = Checks()


TOKEN, ADMIN = "s3cret-token", "admin-token"
spill_dir = tempfile.mkdtemp(prefix="kvl-spill-")
cfg = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
cfg.write(f"""
listen: 127.0.0.1
grpc_port: 0
http_port: 0
auth_token: {TOKEN}
admin_token: {ADMIN}
max_prompt_tokens: 512
max_new_tokens: 1024
drain_s: 60
log_level: info
spill_dir: {spill_dir}
models:
  - name: small
    path: {small}
    hot_mib: 256
    cold_mib: 64
    disk_mib: 64
  - name: large
    path: {large}
    hot_mib: 256
""")
cfg.close()
shutil.copyfile(cfg.name, cfg.name + ".orig")
log = open(os.path.join(tempfile.gettempdir(), "kvlingod-test.log"), "w")
d = subprocess.Popen([kvlingod, "--config", cfg.name], stdout=subprocess.PIPE, stderr=log, text=True)
line = d.stdout.readline()
if not line.startswith("kvlingod listening"):
    print("daemon did not start:", line, open(log.name).read()[-2000:])
    sys.exit(1)
parts = dict(p.split("=", 1) for p in line.split()[2:])
gport, hport = parts["grpc"].rsplit(":", 1)[1], parts["http"].rsplit(":", 1)[1]
ch = grpc.insecure_channel(f"127.0.0.1:{gport}")
md = [("authorization", f"Bearer {TOKEN}")]
inf = rpc.InferenceStub(ch)
health = health_pb2_grpc.HealthStub(ch)


def http(path):
    with urllib.request.urlopen(f"http://127.0.0.1:{hport}{path}", timeout=10) as r:
        return r.status, r.read().decode()


def metrics():
    fam = {}
    for f in text_string_to_metric_families(http("/metrics")[1]):
        for s in f.samples:
            fam.setdefault(s.name, []).append(s)
    return fam


def mval(fam, name, **labels):
    return sum(s.value for s in fam.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def serving():
    return health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING


check(serving() and http("/health")[0] == 200, "health: SERVING over gRPC, 200 over HTTP")
h = subprocess.run([kvlingo, "health", "-s", f"127.0.0.1:{gport}"], capture_output=True, text=True)
check(h.returncode == 0 and "SERVING" in h.stdout, "kvlingo health: SERVING, exit 0")
mj = subprocess.run([kvlingo, "models", "-s", f"127.0.0.1:{gport}", "--token", TOKEN, "--json"], capture_output=True,
                    text=True)
check(mj.returncode == 0 and [m["name"] for m in __import__("json").loads(mj.stdout)["models"]] == ["small", "large"],
      "kvlingo models --json lists both models")

# ---- greedy stream = kvlingo run --------------------------------------------------------
sent = {"requests": 0, "prompt": 0, "generated": 0}
prompt = "def fibonacci(n):"
for model, path in (("small", small), ("large", large)):
    want = subprocess.run([kvlingo, "run", "-m", path, "-p", prompt, "-n", "24"], capture_output=True,
                          text=True).stdout
    req = pb.GenerateRequest(text=prompt, model=model, max_tokens=24, sampling=pb.SamplingParams(temperature=0))
    chunks = list(inf.Generate(req, metadata=md))
    text = "".join(c.text for c in chunks)
    last = chunks[-1]
    want_gen = want[len(prompt):] if want.startswith(prompt) else None
    check(want_gen is not None and text in (want_gen, want_gen[:-1]) and (len(text) > 10 or mode == "tiny"),
          f"{model}: Generate streams kvlingo run's greedy text ({len(chunks)} messages): {text!r}")
    check(all(c.model == model for c in chunks) and last.usage.prompt_tokens > 0 and
          ((last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.generated_tokens == 24) or
           (last.finish_reason == pb.FINISH_REASON_STOP and last.usage.generated_tokens < 24)),
          f"{model}: model on every chunk, usage")
    cli = subprocess.run([kvlingo, "generate", "-s", f"127.0.0.1:{gport}", "--token", TOKEN, "-m", model, "-p", prompt,
                          "-n", "24", "--temperature", "0"], capture_output=True, text=True)
    check(cli.returncode == 0 and cli.stdout in (text, text + "\n"), f"{model}: kvlingo generate streams the same text")
    sent["requests"] += 1
    sent["prompt"] += last.usage.prompt_tokens
    sent["generated"] += last.usage.generated_tokens
    comp = inf.Complete(req, metadata=md)
    check(comp.choices[0].text == text, f"{model}: Complete gives the same text")
    for u in (last.usage, comp.usage):
        sent["requests"] += 1
        sent["prompt"] += u.prompt_tokens
        sent["generated"] += u.generated_tokens

# ---- the Python client package -------------------------------------------------------------
sys.path.insert(0, os.path.join(os.path.dirname(proto_dir), "clients", "python"))
os.environ["KVLINGO_PROTO"] = proto_dir
from kvlingo_client import Client, KvlingoError  # noqa: E402

with Client(f"127.0.0.1:{gport}", token=TOKEN) as kc:
    chunks = list(kc.generate(prompt, model="small", max_tokens=24, temperature=0))
    py_gen = chunks[-1].usage.generated_tokens
    py_text = "".join(c.text for c in chunks)
    ref = "".join(c.text for c in inf.Generate(pb.GenerateRequest(text=prompt, model="small", max_tokens=24,
                                                                   sampling=pb.SamplingParams(temperature=0)),
                                                metadata=md))
    check(py_text == ref and chunks[-1].finish_reason in ("length", "stop") and 0 < py_gen <= 24,
          "python client: generate streams the greedy text, usage on the last chunk")
    try:
        kc.complete("x", model="nope")
        check(False, "python client: unknown model accepted")
    except KvlingoError as e:
        check(e.code == "NOT_FOUND", f"python client: KvlingoError {e.code}")
    for _ in range(2):
        sent["requests"] += 1
        sent["prompt"] += chunks[-1].usage.prompt_tokens
        sent["generated"] += py_gen

# ---- bad input --------------------------------------------------------------------------
raw = lambda method: ch.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
SC = grpc.StatusCode
G = lambda **kw: pb.GenerateRequest(**kw)
cases = [
    ("malformed protobuf", lambda: raw("/kvlingo.v1.Inference/Complete")(b"\x0a\xff\xff\xff", metadata=md),
     SC.INVALID_ARGUMENT, "malformed"),
    ("unknown model", lambda: inf.Complete(G(text="x", model="nope"), metadata=md), SC.NOT_FOUND, "nope"),
    ("empty prompt", lambda: inf.Complete(G(text="", model="small"), metadata=md), SC.INVALID_ARGUMENT, "empty"),
    ("prompt over the limit", lambda: inf.Complete(G(text="word " * 2000, model="small"), metadata=md),
     SC.INVALID_ARGUMENT, "limit"),
    ("negative temperature", lambda: inf.Complete(G(text="x", sampling=pb.SamplingParams(temperature=-1)),
                                                 metadata=md), SC.INVALID_ARGUMENT, "temperature"),
    ("top_p > 1", lambda: inf.Complete(G(text="x", sampling=pb.SamplingParams(top_p=1.5)), metadata=md),
     SC.INVALID_ARGUMENT, "top_p"),
    ("invalid UTF-8", lambda: raw("/kvlingo.v1.Inference/Complete")(b"\x0a\x02\xff\xfe", metadata=md),
     SC.INVALID_ARGUMENT, "UTF-8"),
    ("token id out of vocabulary", lambda: inf.Complete(G(tokens=pb.TokenIds(ids=[10**8])), metadata=md),
     SC.INVALID_ARGUMENT, "vocabulary"),
    ("max_tokens of 10^9", lambda: inf.Complete(G(text="x", max_tokens=10**9), metadata=md), SC.INVALID_ARGUMENT,
     "max_tokens"),
    ("unknown method", lambda: raw("/kvlingo.v1.Inference/Nope")(b"", metadata=md), SC.UNIMPLEMENTED, "Nope"),
    ("missing token", lambda: inf.Complete(G(text="x")), SC.UNAUTHENTICATED, "token"),
    ("wrong token", lambda: inf.Complete(G(text="x"), metadata=[("authorization", "Bearer wrong")]),
     SC.UNAUTHENTICATED, "token"),
    ("admin call without the admin token", lambda: rpc.AdminStub(ch).UnloadModel(pb.UnloadModelRequest(name="small"),
                                                                                 metadata=md),
     SC.PERMISSION_DENIED, "admin"),
]
for name, call, code, word in cases:
    try:
        call()
        check(False, f"bad input: {name}: accepted")
    except grpc.RpcError as e:
        check(e.code() == code and word.lower() in (e.details() or "").lower(),
              f"bad input: {name}: {e.code().name} '{e.details()}'")
check(serving(), "still serving after the bad inputs")

# ---- the OpenAI SDK through the HTTP API --------------------------------------------------
from openai import OpenAI, BadRequestError, AuthenticationError  # noqa: E402

oai = OpenAI(base_url=f"http://127.0.0.1:{hport}/v1", api_key=TOKEN)
msgs = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
r = oai.chat.completions.create(model="small", messages=msgs, max_tokens=16, temperature=0)
check(r.choices[0].message.content and r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0,
      f"openai: chat completion with usage: {r.choices[0].message.content!r} {r.usage.completion_tokens} tokens")
s_text, s_usage, s_fin = "", None, None
for chunk in oai.chat.completions.create(model="auto", messages=msgs, max_tokens=16, temperature=0, stream=True,
                                         stream_options={"include_usage": True}):
    if chunk.choices:
        s_text += chunk.choices[0].delta.content or ""
        s_fin = chunk.choices[0].finish_reason or s_fin
    if chunk.usage:
        s_usage = chunk.usage
check(s_text == r.choices[0].message.content and s_usage and s_usage.completion_tokens == r.usage.completion_tokens
      and s_fin == r.choices[0].finish_reason, "openai: streamed chat (SSE) equals the unary one, usage at the end")
c = oai.completions.create(model="large", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
check(c.choices[0].text and c.usage.completion_tokens == 8, f"openai: completion {c.choices[0].text!r}")
# content as a list of text parts (the OpenAI vision-style message) is their concatenation
parts = [{"role": "user", "content": [{"type": "text", "text": "Write a Python function "},
                                      {"type": "text", "text": "that adds two numbers."}]}]
rp = oai.chat.completions.create(model="small", messages=parts, max_tokens=16, temperature=0)
check(rp.choices[0].message.content == r.choices[0].message.content
      and rp.usage.prompt_tokens == r.usage.prompt_tokens, "openai: content parts equal their concatenated text")
for u in (r.usage, s_usage, c.usage, rp.usage):
    sent["requests"] += 1
    sent["prompt"] += u.prompt_tokens
    sent["generated"] += u.completion_tokens
try:
    oai.completions.create(model="small", prompt="x", top_p=2)
    check(False, "openai: top_p 2 accepted")
except BadRequestError as e:
    check("top_p" in str(e), "openai: top_p 2 refused with 400 naming top_p")
try:
    oai.completions.create(model="small", prompt="x", seed=1.5)
    check(False, "openai: seed 1.5 accepted")
except BadRequestError as e:
    check("seed" in str(e), "openai: a non-integer seed refused with 400 naming seed")


def raw_post(path, body):
    """POST bytes as they are (no client library between): (status, parsed JSON body)."""
    q = urllib.request.Request(f"http://127.0.0.1:{hport}{path}", data=body, method="POST",
                               headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(q, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# a malformed body whose error text (jansson quotes the input near the error) would cut a
# UTF-8 character: a 400 with a JSON error, not a dropped connection (found by fuzz-request)
st, body = raw_post("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\u000\xce\x9d"}]}')
check(st == 400 and "not a JSON object" in body["error"]["message"], f"openai: malformed body near UTF-8 -> {st}")
try:
    OpenAI(base_url=f"http://127.0.0.1:{hport}/v1", api_key="wrong").models.list()
    check(False, "openai: wrong key accepted")
except AuthenticationError:
    check(True, "openai: wrong key refused with 401")

# ---- metrics equal the traffic ------------------------------------------------------------
fam = metrics()
check(mval(fam, "vllm:request_success_total") == sent["requests"],
      f"metrics: request_success_total {mval(fam, 'vllm:request_success_total')} == {sent['requests']} requests")
gen_total = mval(fam, "vllm:generation_tokens_total")
check(gen_total == sent["generated"], f"metrics: generation_tokens_total {gen_total} == {sent['generated']}")
prompt_total = mval(fam, "vllm:prompt_tokens_total")
check(prompt_total == sent["prompt"], f"metrics: prompt_tokens_total {prompt_total} == {sent['prompt']}")
check(mval(fam, "vllm:time_to_first_token_seconds_count") == sent["requests"],
      "metrics: one time-to-first-token observation per request")

# ---- cancel mid-stream --------------------------------------------------------------------
before = mval(metrics(), "vllm:request_success_total", finished_reason="abort")
stream = inf.Generate(G(text=prompt, model="large", max_tokens=500, ignore_eos=True), metadata=md)
got = 0
for c in stream:
    got += 1
    if got == 3:
        stream.cancel()
        break
t0 = time.time()
while time.time() - t0 < 10:
    fam = metrics()
    if mval(fam, "vllm:request_success_total", finished_reason="abort") == before + 1:
        break
    time.sleep(0.05)
freed = time.time() - t0
fam = metrics()
check(mval(fam, "vllm:request_success_total", finished_reason="abort") == before + 1 and
      mval(fam, "vllm:num_requests_running") == 0 and mval(fam, "vllm:kv_cache_usage_perc", model_name="large") == 0,
      f"cancel: request ended and its blocks freed {freed:.2f} s after the cancel")

# Cancels racing the stream: 1-4 concurrent streams each cancelled after 1-6 messages, /metrics
# polled meanwhile (a cancelled call was once freed twice when its request ended while a
# message was in flight: the daemon died under MALLOC_PERTURB_).
rng = random.Random(7)


def cancel_one(model, k):
    st = inf.Generate(G(text=prompt, model=model, max_tokens=500, ignore_eos=True), metadata=md)
    try:
        for n, _ in enumerate(st, 1):
            if n >= k:
                st.cancel()
                break
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            raise


rounds = 100 if mode == "tiny" else 6
for _ in range(rounds):
    ts = [threading.Thread(target=cancel_one, args=(rng.choice(["small", "large"]), rng.randint(1, 6)))
          for _ in range(rng.randint(1, 4))]
    for t in ts:
        t.start()
    for _ in range(rng.randint(0, 3)):
        metrics()
    for t in ts:
        t.join()
t0 = time.time()
while time.time() - t0 < 20 and mval(metrics(), "vllm:num_requests_running") != 0:
    time.sleep(0.05)
fam = metrics()
check(d.poll() is None and mval(fam, "vllm:num_requests_running") == 0 and
      mval(fam, "vllm:kv_cache_usage_perc", model_name="large") == 0 and
      mval(fam, "vllm:kv_cache_usage_perc", model_name="small") == 0,
      f"cancel: {rounds} rounds of racing cancels, still serving, no request running, no block held")
check(all(mval(fam, "kvlingo:kv_blocks", model_name=m, tier="hot", state="capacity") > 0 and
          mval(fam, "kvlingo:kv_blocks", model_name=m, tier="hot", state="used") == 0 and
          mval(fam, "kvlingo:kv_blocks", model_name=m, tier="hot", state="cached") > 0 and
          "kvlingo:kv_block_moves_total" in fam for m in ("small", "large")),
      "metrics: KV blocks per tier (hot capacity, none referenced, some cached) and the tier-move counters")

# ---- loading and unloading a model while others stream ------------------------------------
admin = rpc.AdminStub(ch)
amd = [("authorization", f"Bearer {ADMIN}")]
live = [None] * 4


def stream_to_end(i, model, n):
    try:
        got = list(inf.Generate(G(text=f"# job {i}\n", model=model, max_tokens=n, ignore_eos=True,
                                   sampling=pb.SamplingParams(temperature=0)), metadata=md))
        live[i] = (sum(len(c.token_ids) for c in got), got[-1].finish_reason)
    except grpc.RpcError as e:
        live[i] = ("error", e.code().name, e.details())


workers = [threading.Thread(target=stream_to_end, args=(i, "small", 48)) for i in range(3)]
for t in workers:
    t.start()
loaded = admin.LoadModel(pb.LoadModelRequest(name="extra", path=small), metadata=amd)
x = inf.Complete(G(text=prompt, model="extra", max_tokens=8, ignore_eos=True), metadata=md)
check(loaded.model.name == "extra" and x.model == "extra" and x.usage.generated_tokens == 8,
      "admin: LoadModel while streams run; the new model answers")
w = threading.Thread(target=stream_to_end, args=(3, "extra", 40))
w.start()
time.sleep(0.3)
admin.UnloadModel(pb.UnloadModelRequest(name="extra"), metadata=amd)  # returns once its requests are done
try:
    inf.Complete(G(text="x", model="extra"), metadata=md)
    gone = False
except grpc.RpcError as e:
    gone = e.code() == SC.NOT_FOUND
for t in workers + [w]:
    t.join(timeout=300)
check(live[:3] == [(48, pb.FINISH_REASON_LENGTH)] * 3 and live[3] == (40, pb.FINISH_REASON_LENGTH),
      f"admin: no stream failed across load and unload: {live}")
names = [m.name for m in inf.ListModels(pb.ListModelsRequest(), metadata=md).models]
check(gone and names == ["small", "large"], f"admin: after UnloadModel the name is gone ({names})")
si = inf.ServerInfo(pb.ServerInfoRequest(), metadata=md)
check(si.version and si.uptime_seconds > 0 and [m.name for m in si.models] == ["small", "large"] and
      si.backend.startswith("cpu") and "; " not in si.backend,  # both models on the CPU: its name once
      f"ServerInfo: version {si.version!r}, backend {si.backend!r}, up {si.uptime_seconds:.1f} s, "
      f"models {[m.name for m in si.models]}")
try:
    admin.UnloadModel(pb.UnloadModelRequest(name="extra"), metadata=amd)
    check(False, "admin: unloading twice accepted")
except grpc.RpcError as e:
    check(e.code() == SC.NOT_FOUND, f"admin: unloading twice: {e.code().name} '{e.details()}'")

# ---- SIGTERM while 8 streams run ----------------------------------------------------------
results = [None] * 8
first = threading.Barrier(9)


def run(i):
    try:
        n, fin, seen = 0, None, False
        for c in inf.Generate(G(text=f"# task {i}\ndef f{i}(x):", model="small", max_tokens=24, ignore_eos=True,
                                 sampling=pb.SamplingParams(temperature=0)), metadata=md):
            n += len(c.token_ids)
            if not seen:
                seen = True
                first.wait(timeout=120)
            fin = c.finish_reason
        results[i] = (n, fin)
    except Exception as e:  # noqa: BLE001
        results[i] = ("error", str(e))
        try:
            first.abort()
        except Exception:  # noqa: BLE001
            pass


threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
for t in threads:
    t.start()
first.wait(timeout=120)
d.send_signal(signal.SIGTERM)
time.sleep(0.3)
try:
    inf.Complete(G(text="late", model="small", max_tokens=4), metadata=md, timeout=10)
    refused = False
except grpc.RpcError as e:
    refused = e.code() in (SC.UNAVAILABLE, SC.CANCELLED)
try:
    not_serving = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status != \
        health_pb2.HealthCheckResponse.SERVING
except grpc.RpcError:
    not_serving = True
for t in threads:
    t.join(timeout=120)
rc = d.wait(timeout=120)
check(all(r == (24, pb.FINISH_REASON_LENGTH) for r in results), f"SIGTERM: all 8 streams completed: {results}")
check(refused and not_serving, "SIGTERM: new calls refused, health NOT_SERVING")
check(rc == 0, f"SIGTERM: exit code {rc}")

# ---- the prefix caches survive a restart (cache snapshots) --------------------------------
def launch(tag):
    lg = open(os.path.join(tempfile.gettempdir(), f"kvlingod-test-{tag}.log"), "w")
    p = subprocess.Popen([kvlingod, "--config", cfg.name], stdout=subprocess.PIPE, stderr=lg, text=True)
    ln = p.stdout.readline()
    if not ln.startswith("kvlingod listening"):
        print("daemon did not start:", ln, open(lg.name).read()[-2000:])
        sys.exit(1)
    gp = dict(x.split("=", 1) for x in ln.split()[2:])["grpc"].rsplit(":", 1)[1]
    return p, rpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{gp}")), lg.name


def ask(stub):
    text = "".join(f"# step {i}: add the {i}th number to the running total\n" for i in range(8)) + "def total(xs):"
    ids, last = [], None
    for c in stub.Generate(G(text=text, model="small", max_tokens=8, ignore_eos=True,
                             sampling=pb.SamplingParams(temperature=0)), metadata=md, timeout=120):
        ids += list(c.token_ids)
        last = c
    return ids, last.usage


snap = os.path.join(spill_dir, "small.snapshot")
p1, s1, _ = launch("r1")
ref, u1 = ask(s1)
p1.send_signal(signal.SIGTERM)
p1.wait(timeout=120)
check(os.path.exists(snap) and (os.stat(snap).st_mode & 0o777) == 0o600,
      "restart: the small model's cache snapshot written at shutdown, mode 0600")
p2, s2, log2 = launch("r2")
out2, u2 = ask(s2)
check(out2 == ref and u2.cached_native_tokens >= 64 and u2.prefilled_tokens < u1.prefilled_tokens,
      f"restart: the prompt's blocks come back from the snapshot ({u2.cached_native_tokens} cached, "
      f"{u2.prefilled_tokens} prefilled vs {u1.prefilled_tokens} before) and the output is the same")
p2.send_signal(signal.SIGTERM)
p2.wait(timeout=120)
check('"snapshot_loaded"' in open(log2).read(), "restart: the log says the snapshot was loaded")
with open(snap, "r+b") as f:  # one flipped byte in the middle: refused whole, removed, never trusted
    f.seek(os.path.getsize(snap) // 2)
    b = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([b[0] ^ 0x5A]))
p3, s3, log3 = launch("r3")
out3, u3 = ask(s3)
p3.send_signal(signal.SIGTERM)
p3.wait(timeout=120)
lg3 = open(log3).read()
check('"snapshot_discarded"' in lg3 and out3 == ref and u3.cached_native_tokens == 0,
      f"restart: a damaged snapshot is discarded with a warning and the daemon serves from scratch "
      f"({u3.cached_native_tokens} cached)")
# killed outright (the OOM killer, SIGKILL): no snapshot is written and no disk-tier file is
# left behind (the tier's file is unlinked as soon as it is open); the next start loads the
# snapshot of the last clean shutdown
snap_before = os.stat(snap).st_mtime_ns
pk, sk, _ = launch("rk")
ask(sk)
fd_dir = f"/proc/{pk.pid}/fd"
held = [os.readlink(os.path.join(fd_dir, f)) for f in os.listdir(fd_dir)]
named = [f for f in os.listdir(spill_dir) if f.endswith(".kv")]
pk.kill()
pk.wait(timeout=60)
left = [f for f in os.listdir(spill_dir) if f.endswith(".kv")]
check(os.stat(snap).st_mtime_ns == snap_before, "SIGKILL: the killed daemon wrote no snapshot (the file is untouched)")
p6, s6, log6 = launch("r6")
out6, u6 = ask(s6)
p6.send_signal(signal.SIGTERM)
p6.wait(timeout=120)
check(any(h.endswith(f".{pk.pid}.kv (deleted)") for h in held) and not named and not left,
      f"SIGKILL: the running daemon's disk tiers have no name in spill_dir ({named}) and none is left "
      f"after a kill ({left})")
check(out6 == ref and u6.cached_native_tokens >= 64 and '"snapshot_loaded"' in open(log6).read(),
      f"SIGKILL: the next start serves from the last clean shutdown's snapshot ({u6.cached_native_tokens} cached)")
# a spill directory that does not exist yet, and no disk tier that would have made it: the
# daemon creates it at start, so the shutdown snapshot has somewhere to go
fresh_spill = os.path.join(tempfile.mkdtemp(prefix="kvl-spill-"), "not", "yet")
with open(cfg.name, "w") as f:
    f.write(open(cfg.name + ".orig").read().replace(spill_dir, fresh_spill).replace("    disk_mib: 64\n", ""))
p4, s4, log4 = launch("r4")
ask(s4)
p4.send_signal(signal.SIGTERM)
p4.wait(timeout=120)
snap4 = os.path.join(fresh_spill, "small.snapshot")
check(os.path.exists(snap4) and (os.stat(os.path.dirname(snap4)).st_mode & 0o777) == 0o700
      and '"snapshot_failed"' not in open(log4).read(),
      "restart: a spill_dir that did not exist is created (mode 0700) and the snapshot written into it")
# ---- a model's backend from the configuration --------------------------------------------
orig = open(cfg.name + ".orig").read()
with open(cfg.name, "w") as f:
    f.write(orig.replace("  - name: large\n", "  - name: large\n    backend: tpu\n"))
r = subprocess.run([kvlingod, "--config", cfg.name], capture_output=True, text=True, timeout=60)
check(r.returncode != 0 and "models[1].backend: expected cpu, cuda or cuda-sim" in r.stderr,
      f"backend: an unknown backend refused by its key's path: {r.stderr.strip()[-200:]!r}")
with open(cfg.name, "w") as f:
    f.write(orig.replace("  - name: large\n", "  - name: large\n    backend: cuda\n"))
p5 = subprocess.Popen([kvlingod, "--config", cfg.name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
ln = p5.stdout.readline()
if ln.startswith("kvlingod listening"):  # a machine with a GPU: the model runs there
    p5.send_signal(signal.SIGTERM)
    check(p5.wait(timeout=120) == 0, "backend: cuda with a GPU: the daemon starts and stops cleanly")
else:
    err5 = p5.stderr.read()
    rc5 = p5.wait(timeout=60)
    check(rc5 != 0 and "model 'large': backend cuda:" in err5,
          f"backend: cuda without a GPU refused at start, with the reason: {err5.strip()[-200:]!r}")
if check.failed:
    print(open(log.name).read()[-3000:])
sys.exit(1 if check.failed else 0)
