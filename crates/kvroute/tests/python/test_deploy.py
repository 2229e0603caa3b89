"""`deploy/`: each kustomize overlay renders offline (`kubectl kustomize`), every object it
renders passes its schema (Kubernetes' own OpenAPI schemas, strict, through
kubernetes-validate; the InferencePool and HTTPRoute CRDs' OpenAPI v3 schemas from their
repositories, in deploy/schemas), the picker's configuration is one `kvroute frontend`
accepts, and the objects point at each other. The Prometheus rules pass `promtool check
rules` and `promtool test rules`.

Not checked: the CRDs' CEL rules (x-kubernetes-validations), which only an API server runs."""

import copy
import json
import os
import pathlib
import shutil
import subprocess
import re
import tempfile
import tomllib

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[4]
DEPLOY = ROOT / "deploy"
OVERLAYS = ["aggregated", "disaggregated"]
KUBERNETES = "1.32.0"


def tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if not path:
        # scripts/test installs it (Debian's package); a developer without it is told how.
        pytest.fail(f"`{name}` is needed: `apt-get install {package}`")
    return path


def render(overlay: str) -> list[dict]:
    out = subprocess.run(
        [tool("kubectl", "kubernetes-client"), "kustomize", str(DEPLOY / "overlays" / overlay)],
        check=True, capture_output=True, text=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def crd_schemas() -> dict:
    schemas = {}
    for path in (DEPLOY / "schemas").glob("*.json"):
        s = json.loads(path.read_text())
        schemas[(s["apiVersion"], s["kind"])] = s["schema"]
    return schemas


def problems(doc: dict, schemas: dict) -> list[str]:
    """What the object's schema finds wrong with it (nothing: it passes)."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in schemas:
        validator = jsonschema.Draft7Validator(schemas[key])
        return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [str(e)]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"no schema: {e}"]
    return []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_passes_its_schema(overlay):
    schemas = crd_schemas()
    docs = render(overlay)
    kinds = sorted({d["kind"] for d in docs})
    for want in ["ConfigMap", "Deployment", "HTTPRoute", "InferencePool", "Role", "RoleBinding", "Service", "StatefulSet"]:
        assert want in kinds, kinds
    for doc in docs:
        assert problems(doc, schemas) == [], f"{doc['kind']}/{doc['metadata']['name']}"


def test_the_schemas_refuse_what_is_wrong():
    """The checks can fail: a broken object of each kind is refused."""
    schemas = crd_schemas()
    docs = {d["kind"]: d for d in render("aggregated")}
    pool = copy.deepcopy(docs["InferencePool"])
    pool["spec"]["targetPorts"] = [{"number": "eight thousand"}]
    assert problems(pool, schemas)
    route = copy.deepcopy(docs["HTTPRoute"])
    route["spec"]["rules"][0]["backendRefs"][0]["weight"] = -1
    assert problems(route, schemas)
    deployment = copy.deepcopy(docs["Deployment"])
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["port"] = "grpc"
    assert problems(deployment, schemas)
    deployment = copy.deepcopy(docs["Deployment"])
    deployment["spec"]["replicaz"] = 2
    assert problems(deployment, schemas), "strict: an unknown field is refused"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_objects_point_at_each_other_and_the_picker_config_is_accepted(overlay):
    docs = render(overlay)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    pool = by[("InferencePool", "kvroute-pool")]
    # The pool's picker is the picker's Service, on its gRPC port.
    ref = pool["spec"]["endpointPickerRef"]
    service = by[("Service", ref["name"])]
    grpc = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert grpc and grpc[0]["appProtocol"] == "http2"
    # The pool selects the model servers, and only them.
    selector = pool["spec"]["selector"]["matchLabels"]
    servers = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] != "kvroute-nats"]
    assert servers
    for s in servers:
        labels = s["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), s["metadata"]["name"]
    picker = by[("Deployment", "kvroute-picker")]
    assert not selector.items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    # The route sends to the pool.
    route = by[("HTTPRoute", "kvroute-pool")]
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["kind"], backend["name"]) == ("InferencePool", "kvroute-pool")
    # The picker's settings are ones `kvroute frontend` takes, with ext_proc on the port the
    # Service uses and health on the port the probes use, and every endpoint of the pool file a configured worker.
    config = by[("ConfigMap", "kvroute-config")]["data"]["kvroute.toml"]
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "kvroute.toml"
        path.write_text(config)
        shown = subprocess.run(
            [os.environ.get("KVROUTE_BIN", "kvroute"), "frontend", "--config", str(path), "--print-config"],
            check=True, capture_output=True, text=True,
        ).stdout
    assert "ext_proc_port = 9002" in shown
    # TLS on the picker's port (#64), health in plain text where the probes ask.
    assert "ext_proc_self_signed = true" in shown
    assert "ext_proc_health_port = 9003" in shown
    container = picker["spec"]["template"]["spec"]["containers"][0]
    for probe in ["livenessProbe", "readinessProbe", "startupProbe"]:
        assert container[probe]["grpc"]["port"] == 9003
    if "kube_pool" in config:
        # The workers are the InferencePool's ready pods, watched through the API: the pool
        # named is this one, the template uses its target port, and the picker's service
        # account may do exactly what the watch needs, in its namespace only.
        settings = tomllib.loads(config)
        assert settings["kube_pool"] == pool["metadata"]["name"]
        assert "{port}" in settings["worker_template"]
        assert "workers" not in settings and "endpoints_file" not in settings
        role = by[("Role", "kvroute-picker")]
        rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): sorted(r["verbs"]) for r in role["rules"]}
        assert rules == {
            (("inference.networking.k8s.io",), ("inferencepools",)): ["get"],
            (("",), ("pods",)): ["list", "watch"],
        }, rules
        binding = by[("RoleBinding", "kvroute-picker")]
        assert binding["roleRef"]["name"] == "kvroute-picker"
        sa = picker["spec"]["template"]["spec"]["serviceAccountName"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa}]
        assert by[("ServiceAccount", sa)]["automountServiceAccountToken"] is True
        assert not any(d["kind"] in ("ClusterRole", "ClusterRoleBinding") for d in docs)
    elif "discover_dns" in config:
        # The workers are the pool's headless Service's ready pods, by DNS: the name is that
        # Service's, and the template's ports are the ports it publishes.
        settings = tomllib.loads(config)
        service = by[("Service", settings["discover_dns"])]
        assert service["spec"]["clusterIP"] == "None", "a headless Service answers its pods"
        assert selector.items() <= service["spec"]["selector"].items()
        published = {p["port"] for p in service["spec"]["ports"]}
        used = {int(p) for p in re.findall(r"\{host\}:(\d+)", settings["worker_template"])}
        assert used and used <= published, (used, published)
        assert "workers" not in settings and "endpoints_file" not in settings
    else:
        endpoints = by[("ConfigMap", "kvroute-pool")]["data"]["endpoints"]
        listed = [l.split("#")[0].strip() for l in endpoints.splitlines()]
        for endpoint in filter(None, listed):
            assert f'url = "http://{endpoint}"' in config, endpoint


def test_the_prometheus_rules_pass_promtool():
    promtool = tool("promtool", "prometheus")
    monitoring = DEPLOY / "monitoring"
    subprocess.run([promtool, "check", "rules", "kvroute-rules.yaml"], cwd=monitoring, check=True)
    subprocess.run([promtool, "test", "rules", "kvroute-rules-test.yaml"], cwd=monitoring, check=True)


def test_the_dashboard_reads_only_metrics_kvroute_serves_or_records():
    """Every panel's query names a recorded series of the rules or a metric the code
    registers (the live test in crates/kvroute/tests/prometheus.rs runs them all)."""
    dashboard = json.loads((DEPLOY / "monitoring" / "grafana-dashboard.json").read_text())
    rules = yaml.safe_load((DEPLOY / "monitoring" / "kvroute-rules.yaml").read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    sources = "".join(p.read_text() for p in (ROOT / "crates").rglob("*.rs"))
    for expr in exprs:
        import re

        names = set(re.findall(r"\b(kvroute:[a-z_0-9:]+|kvroute_[a-z_]+|inference_[a-z_]+)", expr))
        assert names, expr
        for name in names:
            if ":" in name:
                assert name in recorded, name
            else:
                base = re.sub(r"_(total|bucket|sum|count)$", "", name)
                assert f'"{base}"' in sources, name
