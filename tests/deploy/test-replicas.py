#!/usr/bin/env python3
"""test-replicas.py — three kvlingod replicas behind nginx with conversation affinity.

On 127.0.0.1 only: three daemons on a tiny model (ports 0, replica ids r0 r1 r2) and an
nginx from Debian's package, started by this test as the current user with its own
prefix, running deploy/nginx/kvlingo.conf unchanged (only the backend and listen files
it includes are written here).

  - 30 conversations x 5 turns through nginx's HTTP port (OpenAI /v1/chat/completions,
    the client resending the history, header x-kvlingo-conversation; half of them
    streamed as server-sent events): every
    conversation stays on one replica (the x-kvlingo-replica answer header), and the
    conversations spread over the three
  - during turn 3 the replica holding the most conversations is killed (SIGKILL):
    every turn still gets an answer (one client retry allowed); conversations of the
    other replicas never move; each moved conversation lands on one survivor and stays
  - server-side counters prove it: on each replica kvlingo:conversations_started_total
    equals the number of distinct conversations the client saw it serve (so a moved
    conversation was prefilled once on its new replica, not once per turn), and
    kvlingo:conversation_turns_total equals the turns it served; the OpenAI usage shows
    the prefix cache at work (cached_tokens) on a replica's later turns and not on a
    moved conversation's first turn at its new home
  - gRPC through nginx's HTTP/2 port, conversation id in the metadata: each
    conversation starts on exactly one replica
  - without any affinity header requests spread (round-robin); with the
    x-kvlingo-affinity key of kvlingo_client.affinity they stick

usage: test-replicas.py KVLINGOD TINY_GGUF_TOOL
Skips (77) only when nginx is not installed.
"""
import atexit
import concurrent.futures
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

T0 = time.time()
kvlingod, tiny_gguf = sys.argv[1:3]
ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
nginx = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)
if not nginx:
    print("nginx is not installed (scripts/setup installs Debian's nginx-light): skipped")
    sys.exit(77)

N_CONV, N_TURNS, N_REPLICAS = 30, 5, 3
MODEL = "tiny"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from harness import Checks  # noqa: E402

check = Checks()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=20):
    end = time.time() + timeout
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


tmp = tempfile.mkdtemp(prefix="kvl-replicas-")
procs = []


def cleanup():
    for p in procs:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


atexit.register(cleanup)  # also when a step raises: no daemon or nginx outlives the test


# ---- three replicas ---------------------------------------------------------------------
model = os.path.join(tmp, "tiny.gguf")
subprocess.run([tiny_gguf, model, "2", "7"], check=True)
replicas = []  # dicts: id, proc, grpc, http, log
for i in range(N_REPLICAS):
    rid = f"r{i}"
    cfg = os.path.join(tmp, f"{rid}.yaml")
    with open(cfg, "w") as f:
        f.write(f"""listen: 127.0.0.1
grpc_port: 0
http_port: 0
drain_s: 2
log_level: warn
max_prompt_tokens: 4096
spill_dir: {tmp}/spill-{rid}
models:
  - name: {MODEL}
    path: {model}
    hot_mib: 64
    cold_mib: 64
translators: []
""")
    log = open(os.path.join(tmp, f"{rid}.log"), "w")
    # three daemons share two cores: one compute thread each, and OpenMP's idle threads
    # must not spin (they would starve the other replicas)
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="passive")
    p = subprocess.Popen([kvlingod, "--config", cfg, "--replica-id", rid], stdout=subprocess.PIPE, stderr=log, text=True,
                         env=env)
    procs.append(p)
    line = p.stdout.readline()
    if not line.startswith("kvlingod listening"):
        cleanup()
        print(f"replica {rid} did not start: {line!r}\n{open(log.name).read()[-2000:]}")
        sys.exit(1)
    parts = dict(x.split("=", 1) for x in line.split()[2:])
    replicas.append({"id": rid, "proc": p, "grpc": parts["grpc"], "http": parts["http"], "log": log.name})

# ---- nginx with the shipped configuration ------------------------------------------------
prefix = os.path.join(tmp, "nginx")
conf = os.path.join(prefix, "conf")
os.makedirs(os.path.join(conf, "kvlingo"))
os.makedirs(os.path.join(prefix, "logs"))
shutil.copy(os.path.join(ROOT, "deploy", "nginx", "kvlingo.conf"), conf)
HTTP_PORT, GRPC_PORT = free_port(), free_port()
with open(os.path.join(conf, "kvlingo", "http-backends.conf"), "w") as f:
    f.writelines(f"server {r['http']} max_fails=1 fail_timeout=10s;\n" for r in replicas)
with open(os.path.join(conf, "kvlingo", "grpc-backends.conf"), "w") as f:
    f.writelines(f"server {r['grpc']} max_fails=1 fail_timeout=10s;\n" for r in replicas)
with open(os.path.join(conf, "kvlingo", "http-listen.conf"), "w") as f:
    f.write(f"listen 127.0.0.1:{HTTP_PORT};\n")
with open(os.path.join(conf, "kvlingo", "grpc-listen.conf"), "w") as f:
    f.write(f"listen 127.0.0.1:{GRPC_PORT} http2;\n")
temp_dirs = "\n".join(f"    {d}_temp_path {prefix}/{d}_temp;" for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
with open(os.path.join(conf, "nginx.conf"), "w") as f:
    # as root the workers would otherwise switch to an unprivileged user that cannot
    # enter this private temporary directory
    f.write(("user root;\n" if os.geteuid() == 0 else "") + f"""worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;
events {{ worker_connections 256; }}
http {{
    log_format kvl '$status "$upstream_addr" "$upstream_status" $http_x_kvlingo_conversation';
    access_log {prefix}/logs/access.log kvl;
{temp_dirs}
    include kvlingo.conf;
}}
""")
# one process, no master: nothing of it can outlive the test, whatever ends it
ngx = subprocess.Popen([nginx, "-p", prefix, "-c", os.path.join(conf, "nginx.conf"), "-g",
                        "daemon off; master_process off;"],
                       stdout=subprocess.DEVNULL, stderr=open(os.path.join(prefix, "logs", "stderr.log"), "w"))
procs.append(ngx)
if not (wait_port(HTTP_PORT) and wait_port(GRPC_PORT)):
    cleanup()
    print("nginx did not start:", open(os.path.join(prefix, "logs", "stderr.log")).read(),
          open(os.path.join(prefix, "logs", "error.log")).read())
    sys.exit(1)
print(f"3 replicas and nginx (http {HTTP_PORT}, grpc {GRPC_PORT}) up in {time.time() - T0:.1f} s", flush=True)


# ---- HTTP helpers -----------------------------------------------------------------------
def post(path, body, headers, port=HTTP_PORT, timeout=60):
    """(status, headers, json or None); a connection failure is status 0."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers.items()), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers.items()), None
    except (urllib.error.URLError, ConnectionError, socket.timeout) as e:
        return 0, {}, str(e)


def post_stream(path, body, headers, port=HTTP_PORT, timeout=60):
    """A streamed (SSE) chat completion: (status, headers, {"choices": [message], "usage"}
    rebuilt from the chunks) — status 0 when the stream broke before `data: [DONE]`."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            hdrs, text, usage, done = dict(r.headers.items()), "", None, False
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                for ch in chunk.get("choices") or []:
                    text += (ch.get("delta") or {}).get("content") or ""
                usage = chunk.get("usage") or usage
        if not done:
            return 0, hdrs, "stream ended before [DONE]"
        return 200, hdrs, {"choices": [{"message": {"content": text}}], "usage": usage}
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers.items()), None
    except (urllib.error.URLError, ConnectionError, socket.timeout, OSError, ValueError) as e:
        return 0, {}, str(e)


def metrics(addr):
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvlingo:conversation"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{")[0]
            out[name] = out.get(name, 0) + float(value)
    return out


def header(headers, name):
    return next((v for k, v in headers.items() if k.lower() == name), None)


# ---- direct: each replica says who it is ----------------------------------------------------
for r in replicas:
    with urllib.request.urlopen(f"http://{r['http']}/health", timeout=10) as resp:
        rid = header(dict(resp.headers.items()), "x-kvlingo-replica")
    check(rid == r["id"], f"replica {r['id']}: /health answers with x-kvlingo-replica: {rid}")

# ---- 30 conversations x 5 turns through nginx ----------------------------------------------
WORDS = ("list", "tuple", "dict", "sorted", "lambda", "generator", "decorator", "context", "manager", "async",
         "await", "yield", "class", "method", "property", "slots", "typing", "protocol", "dataclass", "enum")


def question(c, t):
    w = [WORDS[(c * 7 + t * 3 + k) % len(WORDS)] for k in range(12)]
    return f"Conversation {c}, question {t}: explain how {' '.join(w)} work together in Python, with an example."


history = {c: [] for c in range(N_CONV)}
turns = {c: [] for c in range(N_CONV)}  # per conversation: dicts replica, retries, prompt, cached, status
lock = threading.Lock()
kill_at = threading.Event()  # set when half of turn 3 is done
killed = {"id": None, "t": None, "metrics": None}
retries_total = [0]


def resendable(text):
    # The tiny model's random weights can produce U+0000, which kvlingod writes into its
    # JSON answer but refuses in a request body (jansson without JSON_ALLOW_NUL): a client
    # resending the history drops it.
    return text.replace("\x00", "")


def one_turn(c, t):
    msgs = history[c] + [{"role": "user", "content": question(c, t)}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    hdr = {"x-kvlingo-conversation": f"conv-{c:02d}"}
    attempts = []
    # odd conversations stream (server-sent events through nginx), even ones do not
    send = post_stream if c % 2 else post
    for attempt in range(2):  # one client retry allowed
        status, h, js = send("/v1/chat/completions", body, hdr)
        attempts.append(status)
        if status == 200 and js and js.get("choices"):
            break
        time.sleep(0.2)
    rec = {"turn": t, "status": status, "attempts": attempts, "replica": header(h, "x-kvlingo-replica")}
    if status == 200 and js:
        text = js["choices"][0]["message"]["content"]
        u = js.get("usage") or {}
        rec.update(text=text, prompt=u.get("prompt_tokens", 0),
                   cached=(u.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        history[c] = msgs + [{"role": "assistant", "content": resendable(text)}]
    with lock:
        turns[c].append(rec)
        retries_total[0] += len(attempts) - 1
    return rec


def run_round(t, kill_after=None):
    done = [0]

    def task(c):
        rec = one_turn(c, t)
        with lock:
            done[0] += 1
            if kill_after is not None and done[0] == kill_after:
                kill_at.set()
        return rec

    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as ex:
        futs = [ex.submit(task, c) for c in range(N_CONV)]
        if kill_after is not None:
            kill_at.wait(timeout=120)
            victim = killed["victim"]
            killed["metrics"] = metrics(victim["http"])  # its last word
            victim["proc"].send_signal(signal.SIGKILL)
            victim["proc"].wait()
            killed["t"] = time.time()
            print(f"     killed {victim['id']} (SIGKILL) after {kill_after} of turn {t}'s {N_CONV} requests",
                  flush=True)
        for f in futs:
            f.result()


t_conv = time.time()
run_round(1)
home = {c: turns[c][0]["replica"] for c in range(N_CONV)}
spread = {r["id"]: sum(1 for c in home if home[c] == r["id"]) for r in replicas}
check(all(turns[c][0]["status"] == 200 for c in range(N_CONV)), "turn 1: every conversation answered")
check(all(v > 0 for v in spread.values()), f"turn 1: conversations spread over the replicas {spread}")
run_round(2)
check(all(turns[c][1]["replica"] == home[c] for c in range(N_CONV)),
      "turn 2: every conversation went back to its replica")
victim = max(replicas, key=lambda r: spread[r["id"]])
killed["victim"] = victim
run_round(3, kill_after=N_CONV // 2)
run_round(4)
run_round(5)
elapsed = time.time() - t_conv
check(all(len(turns[c]) == N_TURNS and all(x["status"] == 200 and x.get("text") is not None for x in turns[c])
          for c in range(N_CONV)),
      f"{N_CONV} x {N_TURNS} turns: every turn answered ({retries_total[0]} client retries, "
      f"{N_CONV * N_TURNS / elapsed:.1f} turns/s)")
check(all(len(x["attempts"]) <= 2 for c in range(N_CONV) for x in turns[c]), "no turn needed more than one retry")
# requests nginx itself passed on to the next replica (refused or broken connection)
resent = [ln.strip() for ln in open(os.path.join(prefix, "logs", "access.log")) if "," in ln.split('"')[1]]
print(f"     nginx passed {len(resent)} requests on to another replica after {victim['id']} died"
      + "".join(f"\n       {ln}" for ln in resent[:6]), flush=True)

moved = [c for c in range(N_CONV) if home[c] == victim["id"]]
stayed = [c for c in range(N_CONV) if home[c] != victim["id"]]
check(all(x["replica"] == home[c] for c in stayed for x in turns[c]),
      f"the {len(stayed)} conversations of the surviving replicas never moved")
after_kill = {c: {x["replica"] for x in turns[c] if x["replica"] != victim["id"]} for c in moved}
check(all(len(s) == 1 for s in after_kill.values()) and all(turns[c][-1]["replica"] != victim["id"] for c in moved),
      f"the {len(moved)} conversations of {victim['id']} each moved to one survivor and stayed: "
      f"{ {c: sorted(s) for c, s in after_kill.items()} }")

# ---- server-side counters ---------------------------------------------------------------
served_conv = {r["id"]: set() for r in replicas}
served_turns = {r["id"]: 0 for r in replicas}
for c in range(N_CONV):
    for x in turns[c]:
        served_conv[x["replica"]].add(c)
        served_turns[x["replica"]] += 1
survivors = [r for r in replicas if r is not victim]
for r in survivors:
    m = metrics(r["http"])
    started = m.get("kvlingo:conversations_started_total")
    turns_total = m.get("kvlingo:conversation_turns_total")
    n_moved_here = sum(1 for c in moved if r["id"] in after_kill[c])
    check(started == len(served_conv[r["id"]]),
          f"{r['id']}: conversations_started_total {started} == {len(served_conv[r['id']])} conversations it served "
          f"({n_moved_here} of them moved here: each prefilled once)")
    check(turns_total == served_turns[r["id"]],
          f"{r['id']}: conversation_turns_total {turns_total} == {served_turns[r['id']]} turns it served")
    check(m.get("kvlingo:conversations_active") is not None, f"{r['id']}: conversations_active gauge exported "
                                                               f"({m.get('kvlingo:conversations_active')})")
vm = killed["metrics"]
check(vm.get("kvlingo:conversations_started_total") == len(moved),
      f"{victim['id']} (before the kill): conversations_started_total "
      f"{vm.get('kvlingo:conversations_started_total')} == its {len(moved)} conversations")

# the prefix cache: later turns on the same replica reuse the history; a moved
# conversation's first turn at its new replica has to prefill it
reuse = [x["cached"] for c in range(N_CONV) for i, x in enumerate(turns[c])
         if i > 0 and x["replica"] == turns[c][i - 1]["replica"]]
check(reuse and all(v > 0 for v in reuse),
      f"turns that stayed on their replica found their history cached ({len(reuse)} turns, "
      f"cached_tokens min {min(reuse) if reuse else None})")
first_new = [(turns[c][i]["cached"], turns[c][i - 1]["prompt"]) for c in moved for i in range(1, N_TURNS)
             if turns[c][i]["replica"] != turns[c][i - 1]["replica"]]
check(len(first_new) == len(moved) and all(cached < prev for cached, prev in first_new),
      f"each moved conversation re-prefilled its history at the new replica: (cached, previous prompt) {first_new}")

# ---- gRPC through nginx: affinity from the metadata ----------------------------------------
import grpc  # noqa: E402
from grpc_tools import protoc  # noqa: E402

gen = os.path.join(tmp, "pyproto")
os.makedirs(gen)
proto = os.path.join(ROOT, "proto")
assert protoc.main(["protoc", f"-I{proto}", f"--python_out={gen}", f"--grpc_python_out={gen}",
                    "kvlingo/v1/kvlingo.proto"]) == 0
sys.path.insert(0, gen)
from kvlingo.v1 import kvlingo_pb2 as pb, kvlingo_pb2_grpc as rpc  # noqa: E402

before = {r["id"]: metrics(r["http"]) for r in survivors}
N_GRPC = 8
with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as ch:
    inf = rpc.InferenceStub(ch)
    ok_calls, grpc_homes = 0, {}
    for c in range(N_GRPC):
        for t in range(2):
            req = pb.GenerateRequest(text=f"# grpc conversation {c} turn {t}\ndef f{c}(x):", model=MODEL, max_tokens=4,
                                     ignore_eos=True, sampling=pb.SamplingParams(temperature=0))
            chunks = list(inf.Generate(req, metadata=[("x-kvlingo-conversation", f"grpc-{c}")], timeout=30))
            ok_calls += bool(chunks) and chunks[-1].usage.generated_tokens == 4
            if chunks:
                grpc_homes.setdefault(c, set()).add(chunks[-1].replica)
after = {r["id"]: metrics(r["http"]) for r in survivors}
d_started = sum(after[k]["kvlingo:conversations_started_total"] - before[k]["kvlingo:conversations_started_total"]
                for k in after)
d_turns = sum(after[k]["kvlingo:conversation_turns_total"] - before[k]["kvlingo:conversation_turns_total"]
              for k in after)
check(ok_calls == 2 * N_GRPC and d_started == N_GRPC and d_turns == 2 * N_GRPC,
      f"gRPC via nginx (HTTP/2): {ok_calls} streams; {N_GRPC} conversations started {d_started} times "
      f"in all, {d_turns} turns (each conversation on one replica)")
check(len(grpc_homes) == N_GRPC and all(len(h) == 1 and h <= {r["id"] for r in survivors} for h in grpc_homes.values()),
      f"gRPC: both turns of each conversation report the same replica (GenerateResponse.replica): "
      f"{ {c: sorted(h) for c, h in grpc_homes.items()} }")

# ---- no header: spread; affinity header: sticky ------------------------------------------
spec = importlib.util.spec_from_file_location("kvl_affinity",
                                              os.path.join(ROOT, "clients", "python", "kvlingo_client", "affinity.py"))
affinity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(affinity)
plain = [{"role": "user", "content": "Write a haiku about caches."}]
seen = set()
for _ in range(6):
    st, h, _ = post("/v1/chat/completions", {"model": MODEL, "messages": plain, "max_tokens": 2, "temperature": 0}, {})
    seen.add(header(h, "x-kvlingo-replica") if st == 200 else f"status {st}")
check(len(seen) >= 2 and all(s.startswith("r") for s in seen), f"no affinity header: round-robin over {sorted(seen)}")
opening = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain list slicing."}]
aff = affinity.affinity_headers(messages=opening)
hist = list(opening)
seen = []
for t in range(3):
    st, h, js = post("/v1/chat/completions", {"model": MODEL, "messages": hist, "max_tokens": 4, "ignore_eos": True,
                                              "temperature": 0}, affinity.affinity_headers(messages=hist))
    seen.append(header(h, "x-kvlingo-replica") if st == 200 else f"status {st}")
    if st == 200:
        hist = hist + [{"role": "assistant", "content": resendable(js["choices"][0]["message"]["content"])},
                       {"role": "user", "content": f"And case {t}?"}]
check(len(set(seen)) == 1 and seen[0].startswith("r"),
      f"stateless client with {affinity.AFFINITY_HEADER}: {aff[affinity.AFFINITY_HEADER]} -> {seen}")

# ---- the end ----------------------------------------------------------------------------
ngx.send_signal(signal.SIGTERM)
for r in survivors:
    r["proc"].send_signal(signal.SIGTERM)
rcs = [r["proc"].wait(timeout=60) for r in survivors]
check(rcs == [0] * len(survivors), f"survivors drain and exit 0 on SIGTERM: {rcs}")
try:
    ngx.wait(timeout=10)
except subprocess.TimeoutExpired:
    pass
cleanup()
if check.failed:
    for r in replicas:
        print(f"--- {r['id']} log tail\n{open(r['log']).read()[-1500:]}")
    print("--- nginx error log\n" + open(os.path.join(prefix, "logs", "error.log")).read()[-3000:])
else:
    shutil.rmtree(tmp, ignore_errors=True)
print(f"test-replicas: {time.time() - T0:.1f} s")
sys.exit(1 if check.failed else 0)
