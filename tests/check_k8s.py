"""The manifests of deploy/k8s against what they must say, for CI without a
cluster (kubeconform is used too when it is installed): every object is
well-formed Kubernetes, the DaemonSet shares the socket directory through a
hostPath, probes with `mokctl health` and drains on preStop, and the example
job mounts that same directory and points libmok at the socket in it."""

import glob
import os
import shutil
import subprocess
import sys

import yaml

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
errors = []


def need(cond, where, what):
    if not cond:
        errors.append("%s: %s" % (where, what))
    return cond


def get(obj, path, default=None):
    for key in path.split("."):
        if not isinstance(obj, dict) or key not in obj:
            return default
        obj = obj[key]
    return obj


def check_pod(spec, where):
    """The pod spec's containers, and every volumeMount naming a volume."""
    if not need(isinstance(spec, dict), where, "no pod spec"):
        return {}
    volumes = {v.get("name"): v for v in spec.get("volumes", [])}
    containers = spec.get("containers") or []
    need(containers, where, "no containers")
    for c in containers:
        cw = "%s container %s" % (where, c.get("name"))
        need(c.get("name") and c.get("image"), cw, "a container needs a name and an image")
        for m in c.get("volumeMounts", []):
            need(m.get("name") in volumes, cw, "mounts volume %r that the pod does not have"
                 % m.get("name"))
            need(str(m.get("mountPath", "")).startswith("/"), cw, "mountPath is not absolute")
        for e in c.get("env", []):
            need("name" in e and ("value" in e or "valueFrom" in e), cw, "env entry %r" % e)
    return volumes


def health_probe(c, kind, where):
    cmd = get(c, kind + ".exec.command", [])
    need(any("mokctl" in str(w) for w in cmd) and "health" in cmd, where,
         "%s must run mokctl health" % kind)


def socket_dir(volumes, container, where):
    """The mountPath of the hostPath volume holding the socket (/run/mokd)."""
    for m in container.get("volumeMounts", []):
        v = volumes.get(m["name"], {})
        if get(v, "hostPath.path") == "/run/mokd":
            return m["mountPath"]
    need(False, where, "no hostPath volume of /run/mokd mounted")
    return None


def main():
    files = sorted(glob.glob(os.path.join(ROOT, "deploy", "k8s", "*.yaml")))
    need(files, "deploy/k8s", "no manifests")
    kinds = {}
    for path in files:
        name = os.path.relpath(path, ROOT)
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
        for d in docs:
            where = "%s: %s %s" % (name, d.get("kind"), get(d, "metadata.name"))
            need(d.get("apiVersion") and d.get("kind") and get(d, "metadata.name"), where,
                 "apiVersion, kind and metadata.name are required")
            kinds.setdefault(d.get("kind"), []).append((where, d))
    for where, ds in kinds.get("DaemonSet", []):
        need(ds["apiVersion"] == "apps/v1", where, "DaemonSet is apps/v1")
        sel = get(ds, "spec.selector.matchLabels", {})
        labels = get(ds, "spec.template.metadata.labels", {})
        need(sel and all(labels.get(k) == v for k, v in sel.items()), where,
             "spec.selector.matchLabels must match the template's labels")
        spec = get(ds, "spec.template.spec")
        volumes = check_pod(spec, where)
        c = (spec.get("containers") or [{}])[0]
        for kind in ("readinessProbe", "livenessProbe"):
            health_probe(c, kind, where)
        need(get(c, "lifecycle.preStop.exec.command"), where, "no preStop drain")
        need(get(volumes.get("socket-dir", {}), "hostPath.type") == "DirectoryOrCreate",
             where, "the daemon makes the socket directory (DirectoryOrCreate)")
        d = socket_dir(volumes, c, where)
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        need(d and env.get("MOKD_SOCKET", "").startswith(d + "/"), where,
             "MOKD_SOCKET must be in the socket directory")
        need(spec.get("terminationGracePeriodSeconds", 30) >= 60, where,
             "terminationGracePeriodSeconds leaves no time to drain")
    need(kinds.get("DaemonSet"), "deploy/k8s", "no DaemonSet")
    jobs = kinds.get("Job", []) + kinds.get("Pod", [])
    need(jobs, "deploy/k8s", "no example job")
    for where, job in jobs:
        spec = get(job, "spec.template.spec") if job["kind"] == "Job" else job.get("spec")
        volumes = check_pod(spec, where)
        c = (spec.get("containers") or [{}])[0]
        d = socket_dir(volumes, c, where)
        env = {e["name"]: e for e in c.get("env", [])}
        need(d and env.get("MOKD_SOCKET", {}).get("value", "").startswith(d + "/"), where,
             "MOKD_SOCKET must be in the mounted socket directory")
        need("MOKD_JOB_ID" in env, where, "the job names itself (MOKD_JOB_ID)")
        need(2000 in get(spec, "securityContext.supplementalGroups", []), where,
             "the job needs the socket's group (2000) to connect")
    if shutil.which("kubeconform"):
        r = subprocess.run(["kubeconform", "-strict", "-summary"] + files)
        need(r.returncode == 0, "kubeconform", "failed")
    for e in errors:
        print("check_k8s: " + e, file=sys.stderr)
    print("check_k8s: %d manifests, %s" % (len(files), "FAILED" if errors else "ok"))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
