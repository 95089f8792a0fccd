"""kvlingo_client.affinity — a routing key for clients that keep no conversation id.

Behind several kvlingod replicas a load balancer hashes a header to pick the replica
(deploy/nginx/kvlingo.conf, docs/deployment.md). A client with a conversation id sends
it as `x-kvlingo-conversation`. A stateless client resends the whole history on every
turn; what stays the same from turn to turn is the opening of the prompt, the part that
fills the conversation's first KV block. This module turns that opening into a key for
the `x-kvlingo-affinity` header, so that every turn of one conversation reaches the
replica that already holds its cache, while different conversations spread out.

    from kvlingo_client.affinity import affinity_headers
    headers = affinity_headers(messages=history)      # {"x-kvlingo-affinity": "…"}
    openai_client.chat.completions.create(..., extra_headers=headers)

This file uses the standard library only (the package's __init__ loads grpcio; a client
that wants none of that can copy this one file).
"""
from __future__ import annotations

import hashlib
import json
from typing import Mapping, Optional, Sequence, Union

__all__ = ["CONVERSATION_HEADER", "AFFINITY_HEADER", "REPLICA_HEADER", "OPENING_CHARS", "affinity_key",
           "affinity_headers"]

CONVERSATION_HEADER = "x-kvlingo-conversation"
AFFINITY_HEADER = "x-kvlingo-affinity"
REPLICA_HEADER = "x-kvlingo-replica"  # set by kvlingod on every HTTP answer

# How much of a plain-text prompt makes its opening. The daemon's cache blocks hold 16
# tokens; 16 tokens of code or prose are rarely more than ~100 characters, so 256
# characters cover the first block with room to spare, and stay clear of the text
# that a completion client appends turn after turn.
OPENING_CHARS = 256


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


def affinity_key(messages: Optional[Sequence[Mapping]] = None,
                 prompt: Optional[Union[str, Sequence[int]]] = None) -> str:
    """A 16-hex-digit key from the opening of a conversation.

    messages: chat messages (OpenAI shape). The opening is every message up to and
        including the first user message: system prompt plus first question, which a
        stateless client resends unchanged on every turn. Two conversations that share
        a system prompt still differ by their first question.
    prompt: a completion prompt (text, or token ids); the opening is its first
        OPENING_CHARS characters (or first 16 token ids).
    The model is deliberately not part of the key: a conversation that moves between
    models stays on one replica, where the incoming model translates the other one's
    cache instead of prefilling the history.
    """
    if (messages is None) == (prompt is None):
        raise ValueError("give exactly one of messages or prompt")
    h = hashlib.sha256()
    if messages is not None:
        opening = []
        for m in messages:
            opening.append([str(m.get("role", "")), _content_text(m.get("content"))])
            if m.get("role") == "user":
                break
        h.update(json.dumps(opening, ensure_ascii=False, separators=(",", ":")).encode())
    elif isinstance(prompt, str):
        h.update(prompt[:OPENING_CHARS].encode())
    else:
        h.update(json.dumps([int(t) for t in list(prompt)[:16]]).encode())
    return h.hexdigest()[:16]


def affinity_headers(messages: Optional[Sequence[Mapping]] = None,
                     prompt: Optional[Union[str, Sequence[int]]] = None,
                     conversation_id: Optional[str] = None) -> dict:
    """The routing headers for one request: the conversation id when there is one,
    the opening's key otherwise."""
    if conversation_id:
        return {CONVERSATION_HEADER: conversation_id}
    return {AFFINITY_HEADER: affinity_key(messages=messages, prompt=prompt)}
