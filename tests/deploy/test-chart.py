#!/usr/bin/env python3
"""test-chart.py — the deployment files render and validate, offline.

  - the Helm chart renders with the real Helm 4 engine (deploy/helm/render) for its
    default values and the variants in deploy/helm/kvlingo/ci/, and Helm's linter
    passes on each; misspelt values (values.schema.json) and impossible combinations
    are refused with a message
  - every rendered object validates against the Kubernetes schemas of the oldest and
    newest supported versions (kubernetes-validate, strict: unknown fields refused);
    the two custom resources (ServiceMonitor, ScaledObject) against the field lists in
    tests/deploy/schemas/; a deliberately broken object is refused (the validator is live)
  - what the issue asks of the objects: non-root, read-only root filesystem, no
    privilege escalation in every container; gRPC health probes on the gRPC port
    (HTTP /health with TLS on); grace period >= preStop sleep + the daemon's drain_s;
    nvidia.com/gpu for the CUDA image; selectors of Services, PDB, HPA, ServiceMonitor
    match the pods; the HPA scales on the queue-length metric
  - kvlingod accepts each ConfigMap's configuration (started on it with tiny models)
  - deploy/kustomize is what the chart renders (generate --check), and `kubectl
    kustomize` of the base and each overlay validates
  - the Dockerfiles pass hadolint, run every build command through build-steps (what
    deploy/docker/check-build-steps exercises), run as a numeric non-root user with
    kvlingod as the exec-form entrypoint
  - nginx accepts deploy/nginx/ (nginx -t), where nginx is installed

usage: test-chart.py KVLINGOD TINY_GGUF_TOOL
"""
import copy
import importlib.machinery
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

kvlingod, tiny_gguf = sys.argv[1:3]
ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
VENV_BIN = os.path.dirname(sys.executable)

missing = []
for mod in ("helm_sdkpy", "kubernetes_validate", "jsonschema", "yaml"):
    try:
        __import__(mod)
    except ImportError:
        missing.append(mod)
kubectl = shutil.which("kubectl", path=VENV_BIN) or shutil.which("kubectl")
if not kubectl:
    missing.append("kubectl")
if missing:
    print(f"missing {', '.join(missing)} (scripts/setup installs them into .venv): skipped")
    sys.exit(77)

import jsonschema  # noqa: E402
import kubernetes_validate  # noqa: E402
import yaml  # noqa: E402

render = importlib.machinery.SourceFileLoader("kvl_helm_render", os.path.join(ROOT, "deploy", "helm", "render")) \
    .load_module()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from harness import Checks  # noqa: E402

check = Checks()


KUBE_VERSIONS = ("1.30.0", "1.37.0")
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.json",
}


def validate(obj):
    """'' if the object is valid for every supported version, else the first problem."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in CRD_SCHEMAS:
        with open(os.path.join(ROOT, "tests", "deploy", "schemas", CRD_SCHEMAS[key])) as f:
            schema = json.load(f)
        try:
            jsonschema.validate(obj, schema)
        except jsonschema.ValidationError as e:
            return f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        return ""
    for v in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, v, strict=True)
        except kubernetes_validate.ValidationError as e:
            return f"{v}: {'/'.join(map(str, e.path))}: {e.message}"
        except kubernetes_validate.SchemaNotFoundError:
            return f"{v}: no schema for {key}"
    return ""


def parse(manifest):
    return [o for o in yaml.safe_load_all(manifest) if o]


def by_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def pod_spec(objs):
    w = by_kind(objs, "Deployment") + by_kind(objs, "StatefulSet")
    return w[0], w[0]["spec"]["template"]["spec"]


def daemon_config(objs):
    return yaml.safe_load(by_kind(objs, "ConfigMap")[0]["data"]["kvlingod.yaml"])


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


# ---- render each variant ------------------------------------------------------------------
ci = os.path.join(ROOT, "deploy", "helm", "kvlingo", "ci")
variants = [("default", [], True), ("default, no Prometheus Operator", [], False)] + \
           [(f"ci/{f}", [os.path.join(ci, f)], True) for f in sorted(os.listdir(ci)) if f.endswith(".yaml")]
rendered = {}
for name, files, mon in variants:
    try:
        rendered[name] = parse(render.render(files, monitoring_api=mon))
        kinds = sorted(o["kind"] for o in rendered[name])
        check(True, f"helm renders {name}: {' '.join(kinds)}")
    except Exception as e:  # noqa: BLE001
        check(False, f"helm renders {name}: {e}")
    ok, msgs = render.lint(files)
    check(ok, f"helm lint {name}" + ("" if ok else f": {msgs}"))

# ---- every object validates -----------------------------------------------------------
for name, objs in rendered.items():
    bad = [(o["kind"], o["metadata"]["name"], validate(o)) for o in objs]
    bad = [b for b in bad if b[2]]
    check(not bad, f"{name}: all {len(objs)} objects valid (Kubernetes {' and '.join(KUBE_VERSIONS)} strict; "
                   f"CRDs by tests/deploy/schemas)" + (f": {bad}" if bad else ""))

# the validators are live: broken objects are refused
dep = copy.deepcopy(pod_spec(rendered["default"])[0])
dep["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpcc"] = {"port": 1}
check(validate(dep) != "", f"a Deployment with an unknown field is refused: {validate(dep)}")
dep = copy.deepcopy(pod_spec(rendered["default"])[0])
dep["spec"]["replicas"] = "two"
check(validate(dep) != "", f"a Deployment with replicas 'two' is refused: {validate(dep)}")
so = copy.deepcopy(by_kind(rendered["ci/keda-values.yaml"], "ScaledObject")[0])
so["spec"]["triggers"][0]["metadata"]["threshold"] = 4
check(validate(so) != "", f"a ScaledObject with a numeric trigger threshold is refused: {validate(so)}")

# ---- what the issue asks of the objects -------------------------------------------------
for name, objs in rendered.items():
    wl, ps = pod_spec(objs)
    labels = wl["spec"]["template"]["metadata"]["labels"]
    cfg = daemon_config(objs)
    psc = ps.get("securityContext", {})
    containers = ps.get("initContainers", []) + ps["containers"]
    secure = psc.get("runAsNonRoot") is True and psc.get("runAsUser", 0) > 0 and all(
        c["securityContext"].get("readOnlyRootFilesystem") is True and
        c["securityContext"].get("allowPrivilegeEscalation") is False and
        "ALL" in c["securityContext"].get("capabilities", {}).get("drop", []) for c in containers)
    check(secure, f"{name}: non-root, read-only root filesystem, no privilege escalation, no capabilities "
                  f"({len(containers)} containers)")
    d = ps["containers"][0]
    pre = d["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = ps["terminationGracePeriodSeconds"]
    check(grace >= pre + cfg["drain_s"], f"{name}: terminationGracePeriodSeconds {grace} >= preStop {pre} + "
                                         f"drain_s {cfg['drain_s']}")
    live = d["livenessProbe"]
    check(live["periodSeconds"] * live["failureThreshold"] > cfg["drain_s"] + pre,
          f"{name}: liveness cannot kill a draining pod ({live['failureThreshold']} x {live['periodSeconds']} s)")
    tls = "tls_cert" in cfg
    probes = [d[p] for p in ("startupProbe", "readinessProbe", "livenessProbe")]
    if tls:
        check(all(p.get("httpGet", {}).get("path") == "/health" and p["httpGet"]["port"] == "http" for p in probes),
              f"{name}: TLS on gRPC, so the probes use plaintext HTTP /health")
    else:
        check(all(p.get("grpc", {}).get("port") == cfg["grpc_port"] and p["grpc"].get("service") == ""
                  for p in probes), f"{name}: startup/readiness/liveness probes on grpc.health.v1 at the gRPC port")
    ports = {p["name"]: p["containerPort"] for p in d["ports"]}
    check(ports == {"grpc": cfg["grpc_port"], "http": cfg["http_port"]} and cfg["listen"] == "0.0.0.0",
          f"{name}: container ports = the daemon's ports {ports}, listening on all interfaces")
    env = {e["name"]: e for e in d["env"]}
    check(env["KVLINGO_REPLICA_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name" and
          env["KVLINGO_MODELS"]["value"] == "/models", f"{name}: replica id = pod name, models from /models")
    mounts = {m["mountPath"]: m for m in d["volumeMounts"]}
    check(mounts["/models"].get("readOnly") is True and cfg["spill_dir"] in mounts and "/tmp" in mounts,
          f"{name}: models read-only, spill dir and /tmp writable volumes")
    init = {c["name"]: c for c in ps.get("initContainers", [])}
    check("fetch-models" in init and init["fetch-models"]["command"][0] == "/opt/kvlingo/scripts/fetch-models" and
          init["fetch-models"]["image"] == d["image"], f"{name}: init container fills the model volume with the "
                                                       f"image's own fetch-models")
    limits = d["resources"]["limits"]
    cuda = d["image"].endswith("-cuda")
    check(("nvidia.com/gpu" in limits) == cuda and "memory" in limits and "cpu" in d["resources"]["requests"],
          f"{name}: resources {d['resources']}" + (" (GPU for the CUDA image)" if cuda else ""))
    for svc in by_kind(objs, "Service"):
        sp = {p["name"]: p for p in svc["spec"]["ports"]}
        check(matches(svc["spec"]["selector"], labels) and sp["grpc"]["targetPort"] == "grpc" and
              sp["http"]["targetPort"] == "http", f"{name}: Service {svc['metadata']['name']} selects the pods")
    for pdb in by_kind(objs, "PodDisruptionBudget"):
        check(matches(pdb["spec"]["selector"]["matchLabels"], labels), f"{name}: PodDisruptionBudget selects the pods")
    for hpa in by_kind(objs, "HorizontalPodAutoscaler"):
        m = hpa["spec"]["metrics"][0]
        check(hpa["spec"]["scaleTargetRef"]["kind"] == wl["kind"] and
              hpa["spec"]["scaleTargetRef"]["name"] == wl["metadata"]["name"] and m["type"] == "Pods" and
              "num_requests_waiting" in m["pods"]["metric"]["name"] and "replicas" not in wl["spec"],
              f"{name}: HPA scales the {wl['kind']} on {m['pods']['metric']['name']} and owns the replica count")
    for so in by_kind(objs, "ScaledObject"):
        check(so["spec"]["scaleTargetRef"]["name"] == wl["metadata"]["name"] and
              "vllm:num_requests_waiting" in so["spec"]["triggers"][0]["metadata"]["query"] and
              "replicas" not in wl["spec"], f"{name}: KEDA ScaledObject on vllm:num_requests_waiting")
    for sm in by_kind(objs, "ServiceMonitor"):
        sel = [s for s in by_kind(objs, "Service") if matches(sm["spec"]["selector"]["matchLabels"],
                                                               s["metadata"]["labels"])]
        check(len(sel) == 1 and sm["spec"]["endpoints"][0]["port"] == "http" and
              sm["spec"]["endpoints"][0]["path"] == "/metrics",
              f"{name}: ServiceMonitor scrapes /metrics through exactly one Service ({len(sel)})")
    if wl["kind"] == "StatefulSet":
        claims = [c["metadata"]["name"] for c in wl["spec"].get("volumeClaimTemplates", [])]
        check(wl["spec"]["serviceName"] in [s["metadata"]["name"] for s in by_kind(objs, "Service")
                                            if s["spec"].get("clusterIP") == "None"] and "spill" in claims,
              f"{name}: StatefulSet with a headless service and per-replica claims {claims}")
check(not by_kind(rendered["default, no Prometheus Operator"], "ServiceMonitor") and
      by_kind(rendered["default"], "ServiceMonitor"), "ServiceMonitor rendered only where the cluster has its API")

# ---- combinations that cannot work are refused ---------------------------------------
tmpd = tempfile.mkdtemp(prefix="kvl-chart-test-")
for values, word in (("kvlingod: {drainSeconds: 120}\nterminationGracePeriodSeconds: 60\n", "shorter than"),
                     ("autoscaling: {enabled: true}\nkeda: {enabled: true}\n", "turn one off"),
                     ("workload: DaemonSet\n", "'Deployment', 'StatefulSet'"),
                     ("replicas: 3\n", "additional properties 'replicas'"),
                     ("kvlingod: {models: [{name: a, path: b, hot_mb: 64}]}\n", "additional properties 'hot_mb'"),
                     ("spill: {persistent: true}\n", "StatefulSet")):
    f = os.path.join(tmpd, "v.yaml")
    with open(f, "w") as fh:
        fh.write(values)
    try:
        render.render([f])
        check(False, f"refused: {values.strip()!r} rendered")
    except Exception as e:  # noqa: BLE001
        msg = next((ln.strip() for ln in str(e).splitlines() if word in ln), str(e)[-160:])
        check(word in str(e), f"refused: {values.strip()!r}: {msg[-160:]}")

# ---- kvlingod accepts every ConfigMap's configuration ------------------------------------
tiny = os.path.join(tmpd, "tiny.gguf")
subprocess.run([tiny_gguf, tiny, "2", "1"], check=True)
with open(os.path.join(ROOT, "docs", "daemon.md")) as f:
    documented = set(re.findall(r"`([a-z_]+)`", "\n".join(line.split("|")[1] for line in f
                                                           if line.startswith("| `"))))
for name, objs in rendered.items():
    cfg = daemon_config(objs)
    undocumented = sorted(set(cfg) - documented)
    check(not undocumented, f"{name}: every configuration key is in docs/daemon.md" +
          (f" (not: {undocumented})" if undocumented else ""))
    # the same file with what only exists in a pod replaced: tiny models, no translators
    # (they fit the real pair only), ports 0 on loopback, a temporary spill dir, no TLS files
    cfg.update(listen="127.0.0.1", grpc_port=0, http_port=0, spill_dir=os.path.join(tmpd, "spill"), translators=[])
    for m in cfg["models"]:
        m["path"] = tiny
    cfg.pop("tls_cert", None)
    cfg.pop("tls_key", None)
    cf = os.path.join(tmpd, "kvlingod.yaml")
    with open(cf, "w") as fh:
        yaml.safe_dump(cfg, fh)
    d = subprocess.Popen([kvlingod, "--config", cf], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = d.stdout.readline()
    d.send_signal(signal.SIGTERM)
    try:
        _, err = d.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        d.kill()
        _, err = d.communicate()
    check(line.startswith("kvlingod listening") and d.returncode == 0,
          f"{name}: kvlingod starts on the chart's configuration" + ("" if line else f": {err[-300:]}"))

# ---- deploy/kustomize -----------------------------------------------------------------
g = subprocess.run([sys.executable, os.path.join(ROOT, "deploy", "kustomize", "generate"), "--check"],
                   capture_output=True, text=True)
check(g.returncode == 0, f"deploy/kustomize is the chart's rendering: {(g.stdout + g.stderr).strip()}")
kdir = os.path.join(ROOT, "deploy", "kustomize")
for overlay in ["base"] + [os.path.join("overlays", o) for o in sorted(os.listdir(os.path.join(kdir, "overlays")))]:
    k = subprocess.run([kubectl, "kustomize", os.path.join(kdir, overlay)], capture_output=True, text=True)
    if not check(k.returncode == 0, f"kubectl kustomize {overlay}" + (f": {k.stderr}" if k.returncode else "")):
        continue
    objs = parse(k.stdout)
    bad = [(o["kind"], validate(o)) for o in objs if validate(o)]
    check(not bad, f"kustomize {overlay}: {len(objs)} objects valid" + (f": {bad}" if bad else ""))
    if overlay.endswith("cuda"):
        _, ps = pod_spec(objs)
        c = ps["containers"][0]
        check(c["image"].endswith("-cuda") and "nvidia.com/gpu" in c["resources"]["limits"] and
              [i["image"] for i in ps["initContainers"]] == [c["image"]],
              f"kustomize cuda: {c['image']} with nvidia.com/gpu, init container on the same image")

# ---- Dockerfiles ----------------------------------------------------------------------
hadolint = shutil.which("hadolint", path=VENV_BIN) or shutil.which("hadolint")
cbs = importlib.machinery.SourceFileLoader("kvl_cbs", os.path.join(ROOT, "deploy", "docker", "check-build-steps")) \
    .load_module()
for flavor in ("cpu", "cuda"):
    df = os.path.join(ROOT, "deploy", "docker", f"Dockerfile.{flavor}")
    if hadolint:
        h = subprocess.run([hadolint, df], capture_output=True, text=True)
        check(h.returncode == 0, f"hadolint Dockerfile.{flavor}" + (f": {h.stdout}{h.stderr}" if h.returncode else ""))
    else:
        print(f"skip hadolint Dockerfile.{flavor}: hadolint not installed")
    runs = cbs.run_instructions(df)
    check(runs and all(re.fullmatch(r"build-steps [^;|`$]+?( && build-steps [^;|`$]+)*", c) for _, c in runs),
          f"Dockerfile.{flavor}: all {len(runs)} RUN steps are build-steps calls (check-build-steps runs them)")
    text = open(df).read()
    stages = text.split("\nFROM ")
    final = stages[-1]
    check(re.search(r"^USER 10001:10001$", final, re.M) and
          re.search(r'^ENTRYPOINT \["/opt/kvlingo/bin/kvlingod"\]$', final, re.M) and len(stages) >= 3,
          f"Dockerfile.{flavor}: multi-stage, runs as 10001, kvlingod is PID 1 (exec-form entrypoint)")

# ---- nginx ----------------------------------------------------------------------------
nginx = shutil.which("nginx") or (os.path.exists("/usr/sbin/nginx") and "/usr/sbin/nginx")
if nginx:
    prefix = os.path.join(tmpd, "nginx")
    shutil.copytree(os.path.join(ROOT, "deploy", "nginx"), os.path.join(prefix, "conf"))
    os.makedirs(os.path.join(prefix, "logs"))
    t = subprocess.run([nginx, "-t", "-p", prefix, "-c", os.path.join(prefix, "conf", "nginx.conf"),
                        "-g", f"pid {prefix}/nginx.pid; error_log stderr;"], capture_output=True, text=True)
    check(t.returncode == 0, f"nginx -t accepts deploy/nginx: {t.stderr.strip().splitlines()[-1:]}")
else:
    print("skip nginx -t: nginx not installed")

shutil.rmtree(tmpd, ignore_errors=True)
sys.exit(1 if check.failed else 0)
