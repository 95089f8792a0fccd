"""kvlingo_client — a typed Python client for kvlingod's gRPC API (docs/api.md).

    from kvlingo_client import Client
    with Client("127.0.0.1:50051", token=None) as c:
        for chunk in c.generate("def fibonacci(n):", max_tokens=64, temperature=0):
            print(chunk.text, end="", flush=True)
        reply = c.chat([{"role": "user", "content": "Reverse a list in Python"}])
        print(reply.text, reply.usage.generated_tokens)

The message classes are generated from the repository's proto/ files at first import
(grpcio-tools, into ~/.cache/kvlingo/pyproto/<hash of the protos>), so the client always
matches the server built from the same tree. Set KVLINGO_PROTO to a proto/ directory to
use another one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import sys
from typing import Iterator, Optional, Sequence, Union

import grpc

__all__ = ["Client", "Chunk", "Completion", "Usage", "Routing", "KvlingoError"]


def _proto_dir() -> str:
    env = os.environ.get("KVLINGO_PROTO")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "..", "proto"))


def _load_stubs():
    src = _proto_dir()
    files = [("kvlingo/v1/kvlingo.proto", src), ("health.proto", os.path.join(src, "grpc", "health", "v1"))]
    h = hashlib.sha256()
    for f, inc in files:
        with open(os.path.join(inc, f), "rb") as fh:
            h.update(fh.read())
    out = os.path.join(os.path.expanduser("~/.cache/kvlingo/pyproto"), h.hexdigest()[:16])
    if not os.path.exists(os.path.join(out, "ok")):
        from grpc_tools import protoc

        os.makedirs(out, exist_ok=True)
        for f, inc in files:
            if protoc.main(["protoc", f"-I{inc}", f"--python_out={out}", f"--grpc_python_out={out}", f]) != 0:
                raise RuntimeError(f"protoc failed on {f}")
        open(os.path.join(out, "ok"), "w").close()
    if out not in sys.path:
        sys.path.insert(0, out)
    return (importlib.import_module("kvlingo.v1.kvlingo_pb2"), importlib.import_module("kvlingo.v1.kvlingo_pb2_grpc"),
            importlib.import_module("health_pb2"), importlib.import_module("health_pb2_grpc"))


pb, rpc, health_pb, health_rpc = _load_stubs()

_FINISH = {0: None, 1: "stop", 2: "length", 3: "cancelled", 4: "error"}


class KvlingoError(Exception):
    """A call failed: `code` is the gRPC status name, `message` the server's explanation."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


@dataclasses.dataclass
class Usage:
    prompt_tokens: int = 0
    cached_native_tokens: int = 0
    cached_translated_tokens: int = 0
    translated_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token_s: float = 0.0
    total_s: float = 0.0
    untranslatable_tokens: int = 0
    declined_tokens: int = 0
    handoffs: int = 0


@dataclasses.dataclass
class Routing:
    """Why the server chose the model: policy, decision, a sentence of reason; for a
    cascade handoff, the model that answered first and the first token from the new one."""
    policy: str = ""
    decision: str = ""
    reason: str = ""
    from_model: str = ""
    handoff_token: int = -1


_OUTCOME = {0: None, 1: "not_needed", 2: "applied", 3: "fallback_reprefill", 4: "unsupported"}


@dataclasses.dataclass
class Chunk:
    text: str
    model: str
    token_ids: list
    finish_reason: Optional[str] = None
    usage: Optional[Usage] = None
    logprobs: Optional[list] = None
    translation: Optional[str] = None    # last chunk: applied, fallback_reprefill, unsupported, not_needed
    routing: Optional[Routing] = None    # last chunk
    replica: str = ""                    # last chunk


@dataclasses.dataclass
class Completion:
    text: str
    model: str
    token_ids: list
    finish_reason: Optional[str]
    usage: Usage
    logprobs: Optional[list] = None
    translation: Optional[str] = None
    routing: Optional[Routing] = None
    replica: str = ""


def _usage(m) -> Usage:
    u, t = m.usage, m.timings
    return Usage(u.prompt_tokens, u.cached_native_tokens, u.cached_translated_tokens, u.translated_tokens,
                 u.prefilled_tokens, u.generated_tokens, t.time_to_first_token_seconds, t.total_seconds,
                 u.untranslatable_tokens, u.declined_tokens, u.handoffs)


def _routing(m) -> Optional[Routing]:
    if not m.HasField("routing"):
        return None
    r = m.routing
    return Routing(r.policy, r.decision, r.reason, r.from_model, r.handoff_token)


Messages = Sequence[dict]


class Client:
    """A connection to one kvlingod. Thread-safe (one gRPC channel)."""

    def __init__(self, server: str = "127.0.0.1:50051", token: Optional[str] = None, timeout: Optional[float] = None):
        self._ch = grpc.insecure_channel(server)
        self._md = [("authorization", f"Bearer {token}")] if token else []
        self._timeout = timeout
        self._inf = rpc.InferenceStub(self._ch)
        self._health = health_rpc.HealthStub(self._ch)

    def close(self) -> None:
        self._ch.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, prompt: Union[str, Sequence[int], Messages], model: str, max_tokens: int,
                 temperature: Optional[float], top_p: Optional[float], top_k: Optional[int], seed: Optional[int],
                 stop: Sequence[str], conversation_id: str, logprobs: bool = False):
        sp = pb.SamplingParams()
        if temperature is not None:
            sp.temperature = temperature
        if top_p is not None:
            sp.top_p = top_p
        if top_k is not None:
            sp.top_k = top_k
        if seed is not None:
            sp.seed = seed
        req = pb.GenerateRequest(model=model, max_tokens=max_tokens, sampling=sp, stop=list(stop),
                                 conversation_id=conversation_id, logprobs=1 if logprobs else 0)
        if isinstance(prompt, str):
            req.text = prompt
        elif prompt and isinstance(prompt[0], dict):
            req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
        else:
            req.tokens.ids.extend(prompt)
        return req

    def generate(self, prompt: Union[str, Sequence[int], Messages], *, model: str = "auto", max_tokens: int = 0,
                 temperature: Optional[float] = None, top_p: Optional[float] = None, top_k: Optional[int] = None,
                 seed: Optional[int] = None, stop: Sequence[str] = (), conversation_id: str = "",
                 logprobs: bool = False) -> Iterator[Chunk]:
        """Stream a generation: text, token ids or chat messages in; Chunks out, the last
        with finish_reason, usage, translation outcome and routing. A conversation_id keeps
        the conversation's KV in every model the server switches it through."""
        req = self._request(prompt, model, max_tokens, temperature, top_p, top_k, seed, stop, conversation_id,
                            logprobs)
        try:
            for m in self._inf.Generate(req, metadata=self._md, timeout=self._timeout):
                fin = _FINISH.get(m.finish_reason)
                last = m.HasField("usage")
                yield Chunk(m.text, m.model, list(m.token_ids), fin, _usage(m) if last else None,
                            list(m.logprobs) if logprobs else None, _OUTCOME.get(m.translation) if last else None,
                            _routing(m), m.replica)
        except grpc.RpcError as e:
            raise KvlingoError(e.code().name, e.details()) from None

    def complete(self, prompt: Union[str, Sequence[int], Messages], **kw) -> Completion:
        """The whole generation at once (the unary Complete call)."""
        req = self._request(prompt, kw.pop("model", "auto"), kw.pop("max_tokens", 0), kw.pop("temperature", None),
                            kw.pop("top_p", None), kw.pop("top_k", None), kw.pop("seed", None), kw.pop("stop", ()),
                            kw.pop("conversation_id", ""), kw.pop("logprobs", False))
        if kw:
            raise TypeError(f"unknown arguments {sorted(kw)}")
        try:
            r = self._inf.Complete(req, metadata=self._md, timeout=self._timeout)
        except grpc.RpcError as e:
            raise KvlingoError(e.code().name, e.details()) from None
        ch = r.choices[0]
        return Completion(ch.text, r.model, list(ch.token_ids), _FINISH.get(ch.finish_reason), _usage(r),
                          list(ch.logprobs) if req.logprobs else None, _OUTCOME.get(r.translation), _routing(r),
                          r.replica)

    def chat(self, messages: Messages, **kw) -> Completion:
        return self.complete(list(messages), **kw)

    def tokenize(self, text: str, model: str = "auto") -> list:
        try:
            return list(self._inf.Tokenize(pb.TokenizeRequest(model=model, text=text), metadata=self._md).ids)
        except grpc.RpcError as e:
            raise KvlingoError(e.code().name, e.details()) from None

    def models(self) -> list:
        r = self._inf.ListModels(pb.ListModelsRequest(), metadata=self._md)
        return [dict(name=m.name, architecture=m.architecture, n_layer=m.n_layer, max_model_len=m.max_model_len,
                     kv_dtype=m.kv_dtype) for m in r.models]

    def healthy(self) -> bool:
        try:
            return self._health.Check(health_pb.HealthCheckRequest(), timeout=5).status == \
                health_pb.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False
