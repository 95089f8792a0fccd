"""benchlib.py — what the Python benchmarks share: the machine they ran on, the report in
shared/BENCH-FORMAT.md's shape, and a kvlingod of their own (port 0, gone with the script)."""
import datetime
import os
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL, LARGE = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"


def machine():
    cpu, flags = "unknown", []
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                want = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile", "fma")
                flags = [f for f in line.split(":", 1)[1].split() if f in want]
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "flags": flags, "cores": os.cpu_count(), "mem_gib": round(mem)}


def report(name, results, command=None):
    """The benchmark's JSON object: name, commit, date, machine, command, results."""
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"benchmark": name, "git": git or "unknown",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "machine": machine(),
            "command": command or " ".join(shlex.quote(x) for x in sys.argv), "results": results}


def _die_with_parent():  # the daemon goes when the script goes, however it ends
    import ctypes
    import signal
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Daemon:
    """A kvlingod with the real pair and the given YAML lines added to its configuration.
    .grpc and .http are its addresses ("127.0.0.1:PORT"); stop() ends it."""

    def __init__(self, kvlingod, extra_yaml="", translators="distilled", max_len=4096, http=True):
        self.tmp = tempfile.mkdtemp(prefix="kvl-bench-")
        cfg = os.path.join(self.tmp, "kvlingod.yaml")
        suffix = f".{translators}" if translators else ""
        with open(cfg, "w") as f:
            f.write(f"listen: 127.0.0.1\ngrpc_port: 0\nhttp_port: {0 if http else -1}\nlog_level: warn\n"
                    f"spill_dir: {self.tmp}\nmax_prompt_tokens: {max_len}\nmax_concurrent: 4\n"
                    "quality_gate: {shadow_fraction: 0}\n"  # no background shadows while measuring
                    "models:\n"
                    f"  - {{name: {SMALL}, path: {SMALL}, hot_mib: 2048, cold_mib: 512, max_model_len: {max_len + 64}}}\n"
                    f"  - {{name: {LARGE}, path: {LARGE}, hot_mib: 3072, cold_mib: 512, max_model_len: {max_len + 64}}}\n"
                    "translators:\n" +
                    "".join(f"  - {ROOT}/translator/maps/{x}-to-{y}{suffix}.safetensors\n"
                            for x, y in ((SMALL, LARGE), (LARGE, SMALL))) + extra_yaml)
        self.proc = subprocess.Popen([kvlingod, "--config", cfg], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, preexec_fn=_die_with_parent)
        line = self.proc.stdout.readline()
        if not line.startswith("kvlingod listening"):
            sys.exit(f"kvlingod did not start: {line}")
        ports = dict(p.split("=", 1) for p in line.split()[2:])
        self.grpc, self.http = ports.get("grpc"), ports.get("http")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=120)
