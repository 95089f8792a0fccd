#!/usr/bin/env python3
"""daemon-prefill.py — a kvlingod's own prefill time against bench-prefill-decode's, to
catch overhead that only the daemon has (threads, OpenMP teams, scheduling).

    .venv/bin/python bench/daemon-prefill.py [--kvlingod build-dev/daemon/kvlingod]
                                             [-n 32,544] [-r 3] [--yaml 'key: value']

Starts a kvlingod with the real pair (benchlib's configuration, plus --yaml lines), sends
each model -r requests of n fresh token ids with `reprefill` and max_tokens 1, and prints
per request the daemon's own time to first token, the client's, and the daemon process's
CPU time over it (/proc/<pid>/stat): CPU time well under 2x wall on 2 cores means the
cores sat partly idle. Prints only; nothing is written (compare with
`bench-prefill-decode -p 32,544 -n 0 -r 3` run just before or after).
"""
import argparse
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from benchlib import LARGE, SMALL, Daemon  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvlingod", default=os.path.join(ROOT, "build", "daemon", "kvlingod"))
    ap.add_argument("-n", default="32,544", help="prompt lengths (default 32,544)")
    ap.add_argument("-r", type=int, default=3, help="requests per model and length (default 3)")
    ap.add_argument("--yaml", default="", help="configuration lines added (\\n between lines)")
    a = ap.parse_args()
    from kvlingo_client import pb, rpc  # noqa: E402
    import grpc  # noqa: E402
    d = Daemon(a.kvlingod, extra_yaml=a.yaml.replace("\\n", "\n") + ("\n" if a.yaml else ""))
    stub = rpc.InferenceStub(grpc.insecure_channel(d.grpc))
    rng = random.Random(1)
    tick = os.sysconf("SC_CLK_TCK")

    def cpu_ms():
        f = open(f"/proc/{d.proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / tick * 1e3

    def one(model, n):
        ids = [151644] + [rng.randrange(200, 150000) for _ in range(n - 1)]
        req = pb.GenerateRequest(tokens=pb.TokenIds(ids=ids), model=model, max_tokens=1, ignore_eos=True,
                                 reprefill=True, sampling=pb.SamplingParams(temperature=0))
        c0, t0, first, last = cpu_ms(), time.perf_counter(), None, None
        for m in stub.Generate(req, timeout=600):
            if first is None and m.token_ids:
                first = time.perf_counter()
            last = m
        return (first - t0) * 1e3, last.timings.time_to_first_token_seconds * 1e3, cpu_ms() - c0

    try:
        for model in (SMALL, LARGE):
            one(model, 64)  # untimed: pages faulted in
            for n in (int(x) for x in a.n.split(",")):
                for _ in range(a.r):
                    client, daemon, cpu = one(model, n)
                    print(f"{model} {n} tokens: daemon ttft {daemon:.0f} ms, client {client:.0f} ms, "
                          f"daemon cpu {cpu:.0f} ms ({cpu / daemon:.2f} cores)", flush=True)
    finally:
        d.stop()


if __name__ == "__main__":
    main()
