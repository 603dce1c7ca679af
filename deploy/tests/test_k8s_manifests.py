#!/usr/bin/env python3
"""Static checks of deploy/k8s/*.yaml (no cluster, no kubectl).

  test_k8s_manifests.py DEPLOY_DIR KVPOOL_SERVER

Parses every manifest (PyYAML, Debian python3-yaml) and checks what a cluster would only show
at run time: probes and Services point at ports the container declares; selectors match the
pod template's labels; no load-balancing Service fronts several independent pools; the
StatefulSet's serviceName is a headless Service; readiness does not flap on one miss; no
capability is claimed that a non-root user cannot have; a PodDisruptionBudget and a
NetworkPolicy cover the pods; the container's args, the ConfigMap's keys and the image's
default config name flags that `KVPOOL_SERVER --help` lists; the Dockerfile's CMD config path is
where the ConfigMap is mounted. Prints each problem; exits 1 if any, else 0.
"""
import glob
import os
import re
import subprocess
import sys

try:
    import yaml
except ImportError:
    sys.exit("test_k8s_manifests: PyYAML missing: install python3-yaml (scripts/setup.sh)")

problems = []


def check(cond, msg):
    if not cond:
        problems.append(msg)


GIB = 1 << 30


def byte_size(v):
    """Bytes of a kvpool size ("8GiB", "512MiB", digits) or a Kubernetes quantity ("10Gi")."""
    m = re.fullmatch(r"(\d+)\s*(|Ki|Mi|Gi|Ti|KiB|MiB|GiB|TiB)", str(v).strip())
    check(m is not None, f"cannot read the size {v!r}")
    if not m:
        return 0
    unit = {"": 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[m.group(2).removesuffix("B")]
    return int(m.group(1)) << unit


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in (selector or {}).items())


def main(deploy_dir, server):
    help_text = subprocess.run([server, "--help"], capture_output=True, text=True).stdout
    flags = set(re.findall(r"--([a-z][a-z0-9-]*)", help_text))
    check("listen" in flags and "capacity" in flags, f"{server} --help lists no --listen/--capacity")

    docs = []
    for path in sorted(glob.glob(os.path.join(deploy_dir, "k8s", "*.yaml"))):
        with open(path, encoding="utf-8") as f:
            for d in yaml.safe_load_all(f):
                if d is not None:
                    docs.append((os.path.basename(path), d))
    check(docs, "no manifests found")
    by_kind = {}
    for name, d in docs:
        check("apiVersion" in d and "kind" in d and "name" in d.get("metadata", {}),
              f"{name}: a document lacks apiVersion, kind or metadata.name")
        by_kind.setdefault(d.get("kind"), []).append(d)

    def config_keys_ok(where, text):
        cfg = yaml.safe_load(text)
        check(isinstance(cfg, dict), f"{where}: not a YAML map")
        for k in cfg or {}:
            check(k in flags, f"{where}: key '{k}' is no kvpool-server flag")

    configmaps = {c["metadata"]["name"]: c for c in by_kind.get("ConfigMap", [])}
    for c in configmaps.values():
        for key, text in c.get("data", {}).items():
            config_keys_ok(f"ConfigMap {c['metadata']['name']} {key}", text)
    example = os.path.join(deploy_dir, "k8s", "kvpool.yaml.example")
    with open(example, encoding="utf-8") as f:
        config_keys_ok("kvpool.yaml.example", f.read())

    services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
    workloads = by_kind.get("StatefulSet", []) + by_kind.get("Deployment", [])
    check(workloads, "no StatefulSet or Deployment")
    for w in workloads:
        wname = f"{w['kind']} {w['metadata']['name']}"
        spec = w["spec"]
        tmpl = spec["template"]
        labels = tmpl["metadata"].get("labels", {})
        check(matches(spec["selector"]["matchLabels"], labels),
              f"{wname}: selector does not match the pod template's labels")
        replicas = spec.get("replicas", 1)
        pod = tmpl["spec"]
        pod_sc = pod.get("securityContext", {})
        ports = {}
        for c in pod["containers"]:
            cname = f"{wname} container {c['name']}"
            for p in c.get("ports", []):
                ports[p["containerPort"]] = p
                if "name" in p:
                    ports[p["name"]] = p
            args = c.get("args", [])
            for a in args:
                if a.startswith("--"):
                    check(a[2:].split("=")[0] in flags, f"{cname}: arg {a} is no kvpool-server flag")
            # --config must be a file of a mounted ConfigMap.
            if "--config" in args:
                cfg_path = args[args.index("--config") + 1]
                mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
                vol = mounts.get(os.path.dirname(cfg_path))
                check(vol is not None, f"{cname}: --config {cfg_path} is in no mounted volume")
                vols = {v["name"]: v for v in pod.get("volumes", [])}
                cm = vols.get(vol, {}).get("configMap", {}).get("name")
                check(cm in configmaps and os.path.basename(cfg_path) in configmaps[cm]["data"],
                      f"{cname}: --config {cfg_path} is not a key of a ConfigMap volume")
                # The memory limit covers the pinned capacity, the registrations held outside it
                # (--max-registration-bytes, default 1GiB) and ~1 GiB of process overhead; an
                # unset registration bound was left out of the sizing (newcomer report s6 #10).
                if cm in configmaps and os.path.basename(cfg_path) in configmaps[cm]["data"]:
                    cfg = yaml.safe_load(configmaps[cm]["data"][os.path.basename(cfg_path)]) or {}
                    check("max-registration-bytes" in cfg,
                          f"{cname}: the config leaves --max-registration-bytes at its default; "
                          "set it so the memory limit can count it")
                    need = (byte_size(cfg.get("capacity", "64GiB")) +
                            byte_size(cfg.get("max-registration-bytes", "1GiB")) + GIB)
                    limit = c.get("resources", {}).get("limits", {}).get("memory")
                    check(limit is not None and byte_size(limit) >= need,
                          f"{cname}: memory limit {limit} < capacity + max-registration-bytes + "
                          f"1 GiB overhead = {need} bytes")
            for probe_name in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = c.get(probe_name)
                check(probe is not None, f"{cname}: no {probe_name}")
                if not probe:
                    continue
                for kind in ("grpc", "httpGet", "tcpSocket"):
                    if kind in probe:
                        port = probe[kind]["port"]
                        check(port in ports, f"{cname}: {probe_name} port {port} is not declared")
                        if kind == "grpc":
                            check(probe[kind].get("service") in ("kvpool.v1.KvPool", "liveness"),
                                  f"{cname}: {probe_name} asks an unknown health service")
            rp = c.get("readinessProbe", {})
            check(rp.get("failureThreshold", 3) >= 2,
                  f"{cname}: readinessProbe failureThreshold < 2 flaps on one slow answer")
            check(rp.get("timeoutSeconds", 1) >= 2,
                  f"{cname}: readinessProbe timeoutSeconds < 2 flaps on a loaded node")
            sc = c.get("securityContext", {})
            user = sc.get("runAsUser", pod_sc.get("runAsUser"))
            added = sc.get("capabilities", {}).get("add", [])
            if user not in (None, 0) or pod_sc.get("runAsNonRoot") or sc.get("runAsNonRoot"):
                check(not added, f"{cname}: capabilities.add {added} gives a non-root user nothing")
            check(sc.get("allowPrivilegeEscalation") is False,
                  f"{cname}: allowPrivilegeEscalation is not false")
        # Services that select these pods.
        for s in services.values():
            sname = f"Service {s['metadata']['name']}"
            if not matches(s["spec"].get("selector"), labels):
                continue
            headless = s["spec"].get("clusterIP") == "None"
            check(headless or replicas <= 1,
                  f"{sname} load-balances over {replicas} independent pools of {wname}")
            for p in s["spec"].get("ports", []):
                tp = p.get("targetPort", p["port"])
                check(tp in ports, f"{sname}: targetPort {tp} is no container port of {wname}")
        if w["kind"] == "StatefulSet":
            svc = services.get(spec.get("serviceName"))
            check(svc is not None and svc["spec"].get("clusterIP") == "None",
                  f"{wname}: serviceName {spec.get('serviceName')} is not a headless Service")
        check(any(matches(p["spec"]["selector"]["matchLabels"], labels)
                  for p in by_kind.get("PodDisruptionBudget", [])),
              f"{wname}: no PodDisruptionBudget selects its pods")
        nps = [n for n in by_kind.get("NetworkPolicy", [])
               if matches(n["spec"]["podSelector"].get("matchLabels"), labels)]
        check(nps, f"{wname}: no NetworkPolicy selects its pods (docs/OPERATIONS.md trust model)")
        for n in nps:
            types = n["spec"].get("policyTypes", [])
            check("Ingress" in types and "Egress" in types,
                  f"NetworkPolicy {n['metadata']['name']}: must restrict Ingress and Egress")
            ingress_ports = {p.get("port") for r in n["spec"].get("ingress", [])
                             for p in r.get("ports", [])}
            check(all(isinstance(p, int) and p in ports for p in ingress_ports),
                  f"NetworkPolicy {n['metadata']['name']}: ingress ports {ingress_ports} are not "
                  "all container ports")

    # The image's default command reads the file the manifests mount.
    with open(os.path.join(deploy_dir, "Dockerfile"), encoding="utf-8") as f:
        dockerfile = f.read()
    m = re.search(r'^CMD \["--config", "([^"]+)"\]', dockerfile, re.M)
    check(m is not None, "Dockerfile: no CMD [\"--config\", FILE]")
    if m:
        check(any("--config" in c.get("args", []) and
                  c["args"][c["args"].index("--config") + 1] == m.group(1)
                  for w in workloads for c in w["spec"]["template"]["spec"]["containers"]),
              f"Dockerfile CMD config {m.group(1)} differs from the manifests' --config")

    for p in problems:
        print("test_k8s_manifests:", p)
    if problems:
        return 1
    print(f"test_k8s_manifests: {len(docs)} documents checked "
          f"({', '.join(sorted(k for k in by_kind))})")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
