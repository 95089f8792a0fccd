"""Chat-template rendering against Python's jinja2, byte for byte.

For every template (the `tokenizer.chat_template` of each Qwen GGUF file found in
MODELS_DIR, read with the `gguf` package, plus tests/fixtures/templates/*.jinja) this
generates conversations from a fixed seed (system prompt or not, multi-turn, empty and
None content, unicode and emoji, text that looks like template syntax or special tokens,
tool definitions, assistant tool calls, tool results, add_generation_prompt both ways),
renders each with jinja2 configured as transformers configures it and with kvlingo's
interpreter (tests/tools/template-render --batch), and requires the same bytes, or an
error from both.

usage: test-template-oracle.py PATH/TO/template-render MODELS_DIR [N_PER_TEMPLATE]

Exit 0 when everything matches, 1 on any difference, 77 when jinja2 is not installed.
GGUF files that are missing are reported and skipped; the fixtures always run.
"""
import json
import os
import random
import subprocess
import sys
from datetime import datetime
from pathlib import Path

try:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:
    print("jinja2 is not installed (scripts/requirements.txt): skipped")
    sys.exit(77)

QWEN_FILES = [
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
]
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "templates"


# ---- jinja2 as transformers configures it ----------------------------------------------
# Mirrors transformers.utils.chat_template_utils._compile_jinja_template (5.x):
# ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the
# loopcontrols extension and a {% generation %} tag, `tojson` = json.dumps with
# ensure_ascii=False, and the globals raise_exception, strftime_now, dict, namespace.
# When transformers itself is importable, its own function is used instead.

class GenerationTag(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def compile_like_hf(source):
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
        return _compile_jinja_template(source), "transformers"
    except ImportError:
        pass

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError("underscore-prefixed namespace attribute")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source), "jinja2 (HF configuration replicated)"


# ---- conversations ---------------------------------------------------------------------

WORDS = ["hello", "Hello", "world", "a", "code", "function", "print", "The", "answer", "is",
         "42", "data", "x", "abc", "banana", "Are", "you", "there?", "Yes!", "ok"]
ODD = [
    "é", "ü", "ß", "naïve", "中文", "日本語", "한국어", "Привет", "Ωμέγα", "😀", "👍🏽", "🇫🇷",
    "עברית", "مرحبا", "\u200b", "\u00a0", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    "<tool_call>", "</tool_response>", "{{ messages }}", "{% if %}", "{#", "#}", "{", "}",
    "{}", "[]", "'", '"', "\\", "\\n", "\\u0041", "\n", "\n\n", "\r\n", "\t", "  ", "%",
    "%s", "~", "|", "${x}", "`code`", "```python\nprint('hi')\n```", "null", "None",
    "\x00", "\x1f", "\x7f",
]


def text(rng, allow_empty=True):
    r = rng.random()
    if allow_empty and r < 0.06:
        return ""
    if r < 0.10:
        return rng.choice(["   ", "\n", " padded ", "\tx\t", "Hello?", "Hi!"])
    parts = []
    for _ in range(rng.randint(1, 14)):
        parts.append(rng.choice(ODD) if rng.random() < 0.3 else rng.choice(WORDS))
    sep = rng.choice([" ", " ", " ", "", "\n"])
    return sep.join(parts)


def json_value(rng, depth=0):
    r = rng.random()
    if depth > 2 or r < 0.5:
        return rng.choice([
            0, 1, -5, 123456789, 2**53 + 1, -2**62, 0.5, -0.0, 1e-7, 1.5e20, 3.14159, 1e16,
            0.1, 100.0, True, False, None, "", "str", text(rng), "é\"\\/\n",
        ])
    if r < 0.75:
        return [json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(WORDS + ODD[:12]) + str(i): json_value(rng, depth + 1)
            for i in range(rng.randint(0, 3))}


def tool(rng, i):
    props = {}
    for k in range(rng.randint(0, 3)):
        spec = {"type": rng.choice(["string", "integer", "number", "boolean", "array"]),
                "description": text(rng)}
        if rng.random() < 0.3:
            spec["enum"] = [json_value(rng) for _ in range(2)]
        props[f"arg{k}_{rng.choice(WORDS)}"] = spec
    fn = {"name": f"tool_{i}_{rng.choice(WORDS)}", "description": text(rng),
          "parameters": {"type": "object", "properties": props,
                         "required": list(props)[: rng.randint(0, len(props))]}}
    if rng.random() < 0.15:
        del fn["description"]
    return {"type": "function", "function": fn} if rng.random() < 0.85 else fn


def tool_call(rng, tools):
    if tools:
        t = rng.choice(tools)
        name = t.get("function", t)["name"]
    else:
        name = f"fn_{rng.choice(WORDS)}"
    args = {f"k{j}": json_value(rng) for j in range(rng.randint(0, 3))}
    if rng.random() < 0.25:
        args = json.dumps(args)  # some clients send arguments as a JSON string
    if rng.random() < 0.1:
        return {"name": name, "arguments": args}  # no "function" wrapper
    return {"type": "function", "id": f"call_{rng.randint(0, 999)}",
            "function": {"name": name, "arguments": args}}


def conversation(rng, case):
    tools = [tool(rng, i) for i in range(rng.randint(1, 3))] if rng.random() < 0.35 else None
    msgs = []
    if rng.random() < 0.45:
        msgs.append({"role": "system", "content": text(rng)})
    for turn in range(rng.randint(1, 5)):
        msgs.append({"role": "user", "content": text(rng)})
        if rng.random() < 0.1 and msgs[-1]["content"]:
            msgs[-1]["name"] = rng.choice(WORDS)
        if turn == 0 and rng.random() < 0.15:
            break  # ends on a user turn
        if rng.random() < 0.3:
            calls = [tool_call(rng, tools) for _ in range(rng.randint(1, 3))]
            content = rng.choice([None, "", text(rng)])
            msgs.append({"role": "assistant", "content": content, "tool_calls": calls})
            for _ in range(rng.randint(1, len(calls))):
                m = {"role": "tool", "content": text(rng)}
                if rng.random() < 0.5:
                    m["name"] = calls[0].get("function", calls[0])["name"]
                msgs.append(m)
            if rng.random() < 0.7:
                msgs.append({"role": "assistant", "content": text(rng)})
        else:
            msgs.append({"role": "assistant", "content": text(rng)})
        if rng.random() < 0.05:
            msgs.append({"role": "system", "content": text(rng)})  # a system turn mid-chat
    if rng.random() < 0.4 and msgs[-1]["role"] == "assistant":
        msgs.pop()
    # a few inputs that must fail in both renderers
    r = rng.random()
    if r < 0.02:
        msgs = []
    elif r < 0.04:
        msgs[-1]["content"] = None
    elif r < 0.05:
        msgs[0]["role"] = rng.choice(["tool", "developer"])
    ctx = {"messages": msgs, "add_generation_prompt": rng.random() < 0.5,
           "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    if tools is not None or rng.random() < 0.5:
        ctx["tools"] = tools  # transformers passes tools=None when there are none
    return ctx


# ---- comparison ------------------------------------------------------------------------

def run_ours(tool_path, template_arg, contexts):
    lines = "".join(json.dumps(c) + "\n" for c in contexts).encode()
    proc = subprocess.run([tool_path, *template_arg, "--batch"], input=lines,
                          capture_output=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"template-render failed: {proc.stderr.decode(errors='replace')}")
    out, pos, results = proc.stdout, 0, []
    while pos < len(out):
        nl = out.index(b"\n", pos)
        tag, n = out[pos:nl].split(b" ")
        n = int(n)
        body = out[nl + 1: nl + 1 + n]
        results.append((tag.decode(), body))
        pos = nl + 1 + n + 1
    return results


def check(name, source, template_arg, tool_path, n_cases, seed):
    tpl, how = compile_like_hf(source)
    rng = random.Random(seed)
    contexts = [conversation(rng, i) for i in range(n_cases)]
    ours = run_ours(tool_path, template_arg, contexts)
    if len(ours) != len(contexts):
        print(f"FAIL {name}: {len(ours)} results for {len(contexts)} contexts")
        return False
    same = both_err = 0
    bad = []
    for i, (ctx, (tag, body)) in enumerate(zip(contexts, ours)):
        try:
            ref = tpl.render(**ctx).encode("utf-8", "surrogatepass")
            ref_err = None
        except Exception as e:  # noqa: BLE001 - any template failure counts as an error
            ref, ref_err = None, f"{type(e).__name__}: {e}"
        if ref_err is None and tag == "OK" and body == ref:
            same += 1
        elif ref_err is not None and tag == "ERR":
            both_err += 1
        else:
            bad.append((i, ctx, ref, ref_err, tag, body))
    print(f"{'ok  ' if not bad else 'FAIL'} {name}: {n_cases} conversations, "
          f"{same} byte-identical, {both_err} rejected by both, {len(bad)} different  [{how}]")
    has = lambda f: sum(1 for c in contexts if f(c))  # noqa: E731
    print(f"     covering: {has(lambda c: c.get('tools'))} with tools, "
          f"{has(lambda c: any(m.get('tool_calls') for m in c['messages']))} with tool calls, "
          f"{has(lambda c: any(m['role'] == 'tool' for m in c['messages']))} with tool results, "
          f"{has(lambda c: c['messages'] and c['messages'][0]['role'] == 'system')} with a system "
          f"prompt, {has(lambda c: c['add_generation_prompt'])} with add_generation_prompt")
    for i, ctx, ref, ref_err, tag, body in bad[:3]:
        print(f"  case {i}: context {json.dumps(ctx)[:600]}")
        if ref_err is None and tag == "OK":
            at = next((k for k in range(min(len(ref), len(body))) if ref[k] != body[k]),
                      min(len(ref), len(body)))
            print(f"    first difference at byte {at} of {len(ref)} (jinja2) / {len(body)} (ours)")
            print(f"    jinja2: {ref[max(0, at - 80):at + 80]!r}")
            print(f"    ours:   {body[max(0, at - 80):at + 80]!r}")
        else:
            print(f"    jinja2: {ref_err or ref!r}"[:1000])
            print(f"    ours:   {tag} {body!r}"[:1000])
    return not bad


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    tool_path, models_dir = sys.argv[1], Path(sys.argv[2])
    n_cases = int(sys.argv[3]) if len(sys.argv) > 3 else 300
    ok = True
    seed = 20240601
    for fname in QWEN_FILES:
        path = models_dir / fname
        if not path.exists():
            print(f"skip {fname}: not in {models_dir}")
            continue
        from gguf import GGUFReader
        source = GGUFReader(str(path)).fields["tokenizer.chat_template"].contents()
        ok &= check(fname, source, ["--gguf", str(path)], tool_path, n_cases, seed)
        seed += 1
    for path in sorted(FIXTURES.glob("*.jinja")):
        with open(path, encoding="utf-8", newline="") as f:
            source = f.read()
        ok &= check(f"fixtures/templates/{path.name}", source, [str(path)], tool_path, n_cases,
                    seed)
        seed += 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
