#!/usr/bin/env python3
"""router.py — a dynamic model router on kvlingod: the cheapest adequate model per turn.

Each turn of a conversation goes to the small model unless it looks hard; the small
model's answer is kept only when it was confident (mean and lowest token log-prob over
bars), otherwise the turn is asked again of the large model. Every request carries the
conversation id, so the daemon keeps the conversation's KV in *both* models and a switch
costs a translation of the turns the other model wrote, not a re-read of the whole
conversation (the usage printed per turn shows it: translated vs prefilled positions).

    router.py [-s HOST:PORT] [--small NAME] [--large NAME] [--min-mean-logprob -0.9]
              [--min-logprob -7] [--hard-words prove,optimize,...] [--max-tokens 200]
              [--json] [TURN ...]

With no TURN arguments it reads one user turn per line from standard input. With
--json it prints one JSON object per turn (model, why, text, usage) for scripts.
The same policy, decided by the server in one request, is the daemon's own `cascade`
router (docs/switching.md); this client shows how to build one of your own through the API.
"""
import argparse
import json
import math
import os
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvlingo_client import Client, KvlingoError  # noqa: E402

HARD_WORDS = ("prove", "optimize", "optimise", "refactor", "concurrency", "race condition", "complexity", "design",
              "architecture", "security", "deadlock", "explain why")


class Router:
    """Keeps one conversation's messages and picks a model for each turn."""

    def __init__(self, client, small, large, min_mean_logprob=-0.9, min_logprob=-7.0, hard_words=HARD_WORDS,
                 max_tokens=200, system="You are a concise coding assistant."):
        self.c, self.small, self.large = client, small, large
        self.min_mean, self.min_lp, self.hard = min_mean_logprob, min_logprob, tuple(w.lower() for w in hard_words)
        self.max_tokens = max_tokens
        self.conv = "router-" + uuid.uuid4().hex[:12]
        self.messages = [{"role": "system", "content": system}]

    def _ask(self, model):
        return self.c.chat(self.messages, model=model, max_tokens=self.max_tokens, temperature=0,
                           conversation_id=self.conv, logprobs=True)

    def turn(self, text):
        """Answer one user turn: (completion, model, why)."""
        self.messages.append({"role": "user", "content": text})
        lowered = text.lower()
        hard = [w for w in self.hard if w in lowered]
        if hard or len(text) > 600:
            why = f"looks hard ({', '.join(hard) if hard else f'{len(text)} characters'})"
            r, model = self._ask(self.large), self.large
        else:
            r, model = self._ask(self.small), self.small
            lps = [x for x in (r.logprobs or []) if not math.isnan(x)]
            mean = sum(lps) / len(lps) if lps else 0.0
            low = min(lps) if lps else 0.0
            if mean < self.min_mean or low < self.min_lp:
                why = (f"{self.small} was unsure (mean log-prob {mean:.2f}, lowest {low:.2f}): asked {self.large}")
                r, model = self._ask(self.large), self.large
            else:
                why = f"{self.small} was confident (mean log-prob {mean:.2f}, lowest {low:.2f})"
        self.messages.append({"role": "assistant", "content": r.text})
        return r, model, why


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-s", "--server", default=os.environ.get("KVLINGO_SERVER", "127.0.0.1:50051"))
    ap.add_argument("--token", default=os.environ.get("KVLINGO_AUTH_TOKEN"))
    ap.add_argument("--small", default="qwen2.5-coder-0.5b")
    ap.add_argument("--large", default="qwen2.5-coder-1.5b")
    ap.add_argument("--min-mean-logprob", type=float, default=-0.9)
    ap.add_argument("--min-logprob", type=float, default=-7.0)
    ap.add_argument("--hard-words", default=",".join(HARD_WORDS))
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--json", action="store_true", help="one JSON object per turn")
    ap.add_argument("turns", nargs="*", help="user turns (default: one per line on stdin)")
    a = ap.parse_args()
    turns = a.turns or (line.rstrip("\n") for line in sys.stdin if line.strip())
    with Client(a.server, token=a.token) as c:
        rt = Router(c, a.small, a.large, a.min_mean_logprob, a.min_logprob, a.hard_words.split(","), a.max_tokens)
        for i, t in enumerate(turns):
            try:
                r, model, why = rt.turn(t)
            except KvlingoError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            u = r.usage
            if a.json:
                print(json.dumps({"turn": i, "model": model, "why": why, "text": r.text, "translation": r.translation,
                                  "usage": {"prompt": u.prompt_tokens, "cached": u.cached_native_tokens +
                                            u.cached_translated_tokens, "translated": u.translated_tokens,
                                            "prefilled": u.prefilled_tokens, "generated": u.generated_tokens,
                                            "ttft_s": round(u.time_to_first_token_s, 4)}}), flush=True)
            else:
                print(f"--- turn {i}: {model} — {why}")
                print(r.text)
                print(f"    [{u.prompt_tokens} prompt tokens: {u.cached_native_tokens + u.cached_translated_tokens} "
                      f"cached, {u.translated_tokens} translated, {u.prefilled_tokens} prefilled; "
                      f"first token {u.time_to_first_token_s * 1e3:.0f} ms]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
