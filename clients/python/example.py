#!/usr/bin/env python3
"""Example: stream a completion and hold a two-turn chat with a running kvlingod.

    build/daemon/kvlingod &            # or scripts/run
    .venv/bin/python clients/python/example.py [HOST:PORT]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvlingo_client import Client  # noqa: E402

server = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"
with Client(server, token=os.environ.get("KVLINGO_TOKEN")) as c:
    print("models:", [m["name"] for m in c.models()])
    for chunk in c.generate("def fibonacci(n):", max_tokens=48, temperature=0):
        print(chunk.text, end="", flush=True)
        if chunk.usage:
            print(f"\n[{chunk.model}: {chunk.usage.generated_tokens} tokens, {chunk.finish_reason}]")
    history = [{"role": "user", "content": "Write a one-line Python list reversal."}]
    reply = c.chat(history, max_tokens=64, temperature=0)
    print("assistant:", reply.text)
    history += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "Now without slicing."}]
    print("assistant:", c.chat(history, max_tokens=96, temperature=0).text)
