"""The Helm chart (helm/cedserve): lint, render, Kubernetes schemas, golden renders, values schema.

Everything runs offline: `helm-python-sdk` carries Helm v4's Go SDK as a shared library in its
wheel (no helm binary, no cluster), and `kubernetes-validate` carries the Kubernetes OpenAPI
schemas. LeaderWorkerSet and ServiceMonitor are CRDs it has no schema for: their pod templates are
checked as core `PodTemplate`s and their specs against the small schemas below, taken from the
LWS v1 Go types and the Prometheus Operator's ServiceMonitor.
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import json
import os
import re
import shlex
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from cedserve.decode_workers.config import DecodeConfig
from cedserve.prefill_workers.config import PrefillWorkerConfig
from cedserve.router.admission import ClassLimits
from cedserve.router.config import TABLE_FIELDS, router_table
from cedserve.serving.config import ServeConfig
from cedserve.serving.worker import read_serve_file

pytestmark = pytest.mark.unit

helm = pytest.importorskip("helm_python", reason="helm-python-sdk not installed (pip install -e '.[dev]')")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate not installed (pip install -e '.[dev]')"
)
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (a kubernetes-validate dependency) not installed")

REPO = Path(__file__).resolve().parents[2]
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and a recent one.
K8S_VERSIONS = ("1.29", "1.35")


def _load_golden_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chart_golden", REPO / "helm" / "chart_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


golden = _load_golden_module()
VALUE_SETS: dict[str, dict[str, Any]] = golden.value_sets()


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(golden.CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def renders() -> dict[str, dict[str, str]]:
    return {name: golden.render(values) for name, values in VALUE_SETS.items()}


_PARSED: dict[str, list[dict[str, Any]]] = {}


def _objects(renders: dict[str, dict[str, str]], name: str) -> list[dict[str, Any]]:
    """The parsed objects of a value set's render (parsed once; tests only read them)."""
    if name not in _PARSED:
        _PARSED[name] = golden.objects(renders[name])
    return _PARSED[name]


def _one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _render_objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    return golden.objects(golden.render(values))


def _pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    if workload["kind"] == "LeaderWorkerSet":
        return workload["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    return workload["spec"]["template"]["spec"]


def _pool_name(role: str) -> str:
    return f"{golden.RELEASE}-cedserve-{role}"


# ---------------------------------------------------------------- CRD schemas (no OpenAPI offline)

_INT_OR_STRING = {"anyOf": [{"type": "integer"}, {"type": "string"}]}
LWS_SPEC_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["leaderWorkerTemplate"],
    "properties": {
        "replicas": {"type": "integer", "minimum": 0},
        "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
        "networkConfig": {"type": "object"},
        "rolloutStrategy": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "type": {"enum": ["RollingUpdate"]},
                "rollingUpdateConfiguration": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"partition": {"type": "integer"}, "maxUnavailable": _INT_OR_STRING,
                                   "maxSurge": _INT_OR_STRING},
                },
            },
        },
        "leaderWorkerTemplate": {
            "type": "object",
            "additionalProperties": False,
            "required": ["workerTemplate"],
            "properties": {
                "leaderTemplate": {"type": "object"},
                "workerTemplate": {"type": "object"},
                "size": {"type": "integer", "minimum": 1},
                "restartPolicy": {"enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart",
                                           "None"]},
                "subGroupPolicy": {"type": "object"},
                "volumeClaimTemplates": {"type": "array"},
                "persistentVolumeClaimRetentionPolicy": {"type": "object"},
            },
        },
    },
}
SERVICE_MONITOR_SPEC_SCHEMA = {
    "type": "object",
    "required": ["selector", "endpoints"],
    "properties": {
        "selector": {"type": "object"},
        "namespaceSelector": {"type": "object", "additionalProperties": False,
                              "properties": {"any": {"type": "boolean"},
                                             "matchNames": {"type": "array", "items": {"type": "string"}}}},
        "endpoints": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["port"],
            "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                           "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                           "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}}},
    },
}


def _validate_object(obj: dict[str, Any], version: str) -> None:
    """Kubernetes schema (strict: unknown fields fail) or, for the two CRDs, the schemas above."""
    kind = obj["kind"]
    if kind == "LeaderWorkerSet":
        assert obj["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        jsonschema.validate(obj["spec"], LWS_SPEC_SCHEMA)
        for key in ("leaderTemplate", "workerTemplate"):
            template = obj["spec"]["leaderWorkerTemplate"].get(key)
            if template is not None:
                _validate_object({"apiVersion": "v1", "kind": "PodTemplate",
                                  "metadata": {"name": f"{obj['metadata']['name']}-{key}"},
                                  "template": template}, version)
        return
    if kind == "ServiceMonitor":
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        jsonschema.validate(obj["spec"], SERVICE_MONITOR_SPEC_SCHEMA)
        return
    kubernetes_validate.validate(obj, version, strict=True)


# ---------------------------------------------------------------- lint, render, validate, golden


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_is_clean(name: str) -> None:
    report = helm.lint(golden.CHART_DIR, VALUE_SETS[name], strict=True, namespace=golden.NAMESPACE,
                       kube_version=f"v{K8S_VERSIONS[0]}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_objects_match_kubernetes_schemas(renders: dict[str, dict[str, str]], name: str,
                                                   version: str) -> None:
    objs = _objects(renders, name)
    assert len(objs) >= 15
    errors = []
    for obj in objs:
        try:
            _validate_object(obj, version)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            path = ".".join(str(p) for p in exc.path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(exc.message)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_golden_render_is_current(renders: dict[str, dict[str, str]], name: str) -> None:
    path = golden.golden_path(name)
    assert path.is_file(), f"{path} missing: run helm/regen-golden.sh"
    assert golden.golden_text(renders[name]) == path.read_text(), (
        f"{path.name} is stale: run helm/regen-golden.sh and review the diff")


def test_every_golden_file_has_a_value_set() -> None:
    names = {p.stem for p in golden.GOLDEN_DIR.glob("*.yaml")}
    assert names == set(VALUE_SETS)


def test_examples_cover_every_checkpoint_source_and_workload() -> None:
    sources = {v.get("model", {}).get("checkpoint", {}).get("source", "none") for v in VALUE_SETS.values()}
    assert sources == {"none", "pvc", "existingClaim", "hostPath"}
    workloads = {v.get("groupWorkload", "auto") for v in VALUE_SETS.values()}
    assert {"LeaderWorkerSet", "StatefulSet"} <= workloads


# ---------------------------------------------------------------- values schema


@pytest.mark.parametrize(("values", "where"), [
    pytest.param({"decode": {"replica": 2}}, "additional properties 'replica'", id="typo-in-pool"),
    pytest.param({"routr": {}}, "additional properties 'routr'", id="typo-top-level"),
    pytest.param({"decode": {"replicas": -1}}, "/decode/replicas", id="negative-replicas"),
    pytest.param({"prefill": {"groupSize": 0}}, "/prefill/groupSize", id="empty-group"),
    pytest.param({"prefill": {"ports": {"grpc": "50061"}}}, "/prefill/ports/grpc", id="port-as-string"),
    pytest.param({"router": {"ports": {"grpc": 70000}}}, "/router/ports/grpc", id="port-out-of-range"),
    pytest.param({"groupWorkload": "lws"}, "/groupWorkload", id="unknown-workload"),
    pytest.param({"decode": {"shm": {"sizeLimit": "64GB"}}}, "/decode/shm/sizeLimit", id="bad-quantity"),
    pytest.param({"decode": {"cache": {"numBlocks": 0}}}, "/decode/cache/numBlocks", id="zero-blocks"),
    pytest.param({"config": {"cache": {"block_size": 64}}}, "additional properties 'block_size'",
                 id="snake-case-cache-key"),
    pytest.param({"model": {"checkpoint": {"source": "existingClaim"}}}, "existingClaim",
                 id="claim-without-name"),
    pytest.param({"model": {"checkpoint": {"source": "hostPath", "hostPath": {"path": "models"}}}},
                 "/model/checkpoint/hostPath/path", id="relative-host-path"),
    pytest.param({"prefill": {"autoscaling": {"metric": {"type": "Object"}}}}, "/prefill/autoscaling/metric/type",
                 id="unknown-metric-type"),
    pytest.param({"prefill": {"pdb": {"maxUnavailable": "half"}}}, "/prefill/pdb/maxUnavailable",
                 id="bad-percentage"),
    pytest.param({"prefill": {"gpusPerPod": 2}}, "/prefill/gpusPerPod", id="several-gpus-a-prefill-pod"),
    pytest.param({"router": {"settings": {"max_retry": 3}}}, "invalid propertyName 'max_retry'",
                 id="typo-in-router-settings"),
    pytest.param({"router": {"settings": {"limits": {"urgent": {"max_running": 1}}}}}, "invalid propertyName 'urgent'",
                 id="unknown-effort-class"),
    pytest.param({"router": {"settings": {"limits": {"max": {"max_running": 0}}}}},
                 "/router/settings/limits/max/max_running", id="no-running-slot"),
    pytest.param({"decode": {"engine": {"max_runing_requests": 8}}}, "invalid propertyName 'max_runing_requests'",
                 id="typo-in-engine"),
    pytest.param({"prefill": {"engine": {"worker_id": "p0"}}}, "invalid propertyName 'worker_id'", id="engine-worker-id"),
    pytest.param({"decode": {"engine": {"num_blocks": 8}}}, "invalid propertyName 'num_blocks'", id="engine-blocks-not-cache"),
    pytest.param({"prefill": {"engine": {"max_waiting_requests": 8}}}, "invalid propertyName 'max_waiting_requests'",
                 id="decode-field-on-prefill"),
    pytest.param({"prefill": {"engine": {"chunk_tokens": [2048]}}}, "/prefill/engine/chunk_tokens",
                 id="engine-value-not-scalar"),
])
def test_schema_rejects_bad_values(chart: Any, values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError) as info:
        chart.validate_schema(values)
    assert where in str(info.value)
    # The same values stop a render too (install and template validate before rendering).
    with pytest.raises(helm.HelmValuesError):
        chart.render(values, name=golden.RELEASE, namespace=golden.NAMESPACE)


def test_engine_schema_names_exactly_the_config_fields(chart: Any) -> None:
    """The chart's `<pool>.engine` keys are the worker config's fields, less those the chart sets itself,
    and `router.settings` keys the `[router]` table's."""
    schema_all = json.loads((golden.CHART_DIR / "values.schema.json").read_text())
    schema = schema_all["definitions"]
    by_pod = {"worker_id"}  # --worker-id=$(POD_NAME)
    assert schema["prefillEngine"]["propertyNames"]["enum"] == [
        name for name in PrefillWorkerConfig.__struct_fields__ if name not in by_pod]
    assert schema_all["properties"]["router"]["properties"]["settings"]["propertyNames"]["enum"] == list(TABLE_FIELDS)
    assert schema["decodeEngine"]["propertyNames"]["enum"] == [
        name for name in DecodeConfig.__struct_fields__ if name not in by_pod]


def test_engine_tables_follow_the_pods_devices_and_the_values(tmp_path: Path) -> None:
    values = {"prefill": {"gpusPerPod": 0, "engine": {"effort_queue_slack_s": 0.5, "paged_attention": "off"}},
              "decode": {"engine": {"device": "cuda:0", "preemption": "recompute", "dspark": False}}}
    (config_map,) = [o for o in _render_objects(values) if o["kind"] == "ConfigMap"]
    tables = {}
    for role in ("prefill", "decode"):
        (tmp_path / f"{role}.toml").write_text(config_map["data"][f"{role}.toml"])
        tables[role] = read_serve_file(tmp_path / f"{role}.toml", (role, "kv_transfer"))[1][role]
    prefill = PrefillWorkerConfig.from_mapping(tables["prefill"])
    assert (prefill.device, prefill.effort_queue_slack_s, prefill.paged_attention) == ("cpu", 0.5, "off")
    decode = DecodeConfig.from_mapping(tables["decode"])
    assert (decode.device, decode.preemption.value, decode.dspark) == ("cuda:0", "recompute", False)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_schema_accepts_defaults_and_examples(chart: Any, name: str) -> None:
    chart.validate_schema(VALUE_SETS[name])


@pytest.mark.parametrize(("values", "message"), [
    pytest.param({"decode": {"autoscaling": {"enabled": True}}, "groupWorkload": "StatefulSet"},
                 "a StatefulSet scales pods, not groups", id="hpa-on-statefulset-groups"),
    pytest.param({"decode": {"drain": {"timeoutSeconds": 300}}}, "decode.drain.timeoutSeconds (300) must be below",
                 id="drain-longer-than-grace"),
    pytest.param({"prefill": {"ucxPortRange": "41000-40000"}}, 'prefill.ucxPortRange "41000-40000"',
                 id="reversed-port-range"),
    pytest.param({"model": {"checkpoint": {"source": "pvc"}}, "router": {"mountCheckpoint": False}},
                 "router.mountCheckpoint is false but the router needs", id="router-without-model-files"),
])
def test_template_guards(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        golden.render(values)


def _values_key_lines() -> Iterator[tuple[int, list[str], str, bool]]:
    """(line number, key path, text after the colon, has a comment right above) for each block key."""
    lines = (golden.CHART_DIR / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    for number, line in enumerate(lines, 1):
        match = re.match(r"^( *)([A-Za-z][\w.-]*):(.*)$", line)
        if not match:
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3).strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = [k for _, k in stack] + [key]
        stack.append((indent, key))
        above = lines[number - 2].strip() if number >= 2 else ""
        yield number, path, rest, above.startswith("#")


def _schema_node(schema: dict[str, Any], path: list[str]) -> dict[str, Any] | None:
    """The schema of a values path ($refs resolved); None where the schema has no such key."""
    node: dict[str, Any] | None = schema
    for key in path:
        assert node is not None
        node = node.get("properties", {}).get(key)
        while node is not None and "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        if node is None:
            return None
    return node


def test_every_value_is_documented_and_in_the_schema(chart: Any) -> None:
    schema = chart.schema
    undocumented, unknown = [], []
    for number, path, rest, commented in _values_key_lines():
        parent = _schema_node(schema, path[:-1])
        if parent is None or parent.get("additionalProperties") is not False or path[-2:-1] == ["resources"]:
            continue  # inside a Kubernetes shape (requests/limits, securityContext): documented by its parent
        if _schema_node(schema, path) is None:
            unknown.append(f"values.yaml:{number} {'.'.join(path)}")
        elif rest and not rest.startswith("#") and not commented:
            undocumented.append(f"values.yaml:{number} {'.'.join(path)}")
    assert not unknown, f"keys missing from values.schema.json: {unknown}"
    assert not undocumented, f"values without a `# --` comment above them: {undocumented}"


# ---------------------------------------------------------------- what the objects must say


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_namespaced_only_no_cluster_rbac(renders: dict[str, dict[str, str]], name: str) -> None:
    objs = _objects(renders, name)
    kinds = {o["kind"] for o in objs}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "Namespace", "CustomResourceDefinition",
                        "PersistentVolume", "PriorityClass", "StorageClass", "MutatingWebhookConfiguration",
                        "ValidatingWebhookConfiguration"}
    assert all(o["metadata"].get("namespace") == golden.NAMESPACE for o in objs)

    role = _one(objs, "Role", f"{golden.RELEASE}-cedserve-router")
    assert {(tuple(r["apiGroups"]), tuple(r["resources"])) for r in role["rules"]} == {
        (("",), ("pods",)), (("discovery.k8s.io",), ("endpointslices",))}
    assert all(set(r["verbs"]) == {"get", "list", "watch"} for r in role["rules"])

    binding = _one(objs, "RoleBinding", f"{golden.RELEASE}-cedserve-router")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    router = _one(objs, "Deployment", f"{golden.RELEASE}-cedserve-router")
    router_sa = router["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": router_sa, "namespace": golden.NAMESPACE}]

    # Only the router holds an API token; workers and the test pod never talk to the API server.
    for obj in objs:
        pod = _pod_spec(obj) if obj["kind"] in {"StatefulSet", "LeaderWorkerSet"} else None
        if obj["kind"] == "Job":
            pod = obj["spec"]["template"]["spec"]
        if pod is not None:
            assert pod["automountServiceAccountToken"] is False, obj["metadata"]["name"]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_network_policies_fence_internal_ports(renders: dict[str, dict[str, str]], name: str) -> None:
    values = VALUE_SETS[name]
    objs = _objects(renders, name)
    policies = {o["metadata"]["name"]: o for o in objs if o["kind"] == "NetworkPolicy"}
    release = {"app.kubernetes.io/name": "cedserve", "app.kubernetes.io/instance": golden.RELEASE}
    for role in ("prefill", "decode"):
        policy = policies[_pool_name(role)]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        assert policy["spec"]["podSelector"]["matchLabels"] == {**release, "app.kubernetes.io/component": role}
        workload = next(o for o in objs if o["kind"] in {"StatefulSet", "LeaderWorkerSet"}
                        and o["metadata"]["name"] == _pool_name(role))
        ports = {p["name"]: p["containerPort"] for p in _pod_spec(workload)["containers"][0]["ports"]}
        env = {e["name"]: e.get("value") for e in _pod_spec(workload)["containers"][0]["env"]}
        first, last = (int(x) for x in env["UCX_TCP_PORT_RANGE"].split("-"))
        opened: dict[int, list[dict[str, Any]] | None] = {}
        for rule in policy["spec"]["ingress"]:
            for port in rule.get("ports", [{"port": "*"}]):
                opened.setdefault(port["port"], rule.get("from"))
            if "ports" not in rule:
                # Every port, but only from the same pool (torch.distributed/NCCL inside a group).
                assert rule["from"] == [{"podSelector": {"matchLabels": {**release,
                                                                         "app.kubernetes.io/component": role}}}]
        for port in (ports["grpc"], ports["nixl"], first):
            assert opened[port] == [{"podSelector": {"matchLabels": release}}], (role, port)
        ucx_rule = next(p for r in policy["spec"]["ingress"] for p in r.get("ports", []) if p["port"] == first)
        assert ucx_rule["endPort"] == last
        assert opened[ports["metrics"]] == (values.get("networkPolicy", {}).get("metricsFrom") or None)

    router = policies[f"{golden.RELEASE}-cedserve-router"]
    public = router["spec"]["ingress"][0]
    http = values.get("router", {}).get("http", {})
    http_ports = [{"port": http.get("port", 8000), "protocol": "TCP"}] if http.get("enabled") else []
    assert public["ports"] == [{"port": 50051, "protocol": "TCP"}, *http_ports]  # the HTTP API only when on
    assert public.get("from") == (values.get("networkPolicy", {}).get("clientsFrom") or None)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_pool_pods_request_devices_and_drain(renders: dict[str, dict[str, str]], name: str) -> None:
    objs = _objects(renders, name)
    for role in ("prefill", "decode"):
        v = _merged(name)[role]
        workload = next(o for o in objs if o["kind"] in {"StatefulSet", "LeaderWorkerSet"}
                        and o["metadata"]["name"] == _pool_name(role))
        pod = _pod_spec(workload)
        (container,) = pod["containers"]
        res = container["resources"]
        if v["gpusPerPod"]:
            assert res["requests"][v["gpuResourceName"]] == res["limits"][v["gpuResourceName"]] == v["gpusPerPod"]
        if v["rdma"]["enabled"]:
            assert res["limits"][v["rdma"]["resourceName"]] == v["rdma"]["count"]
        else:
            assert not any(k.startswith("rdma/") for k in res["limits"])
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
        shm = next(vol for vol in pod["volumes"] if vol["name"] == "shm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": v["shm"]["sizeLimit"]}
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        # compiled Triton kernels go to a volume of their own, so a restarted container keeps them
        cache = next(vol for vol in pod["volumes"] if vol["name"] == "kernel-cache")
        assert cache["emptyDir"] == {"sizeLimit": v["kernelCache"]["sizeLimit"]}
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert {"name": "kernel-cache", "mountPath": env["TRITON_CACHE_DIR"]} in container["volumeMounts"]
        # With TLS on the gRPC port, probes and the drain go to the plaintext health listener.
        probe_port = v["ports"]["health" if _merged(name)["tls"]["internal"]["enabled"] else "grpc"]
        for probe, service in (("startupProbe", ""), ("readinessProbe", ""), ("livenessProbe", "liveness")):
            assert container[probe]["grpc"] == {"port": probe_port, "service": service}
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[:3] == ["cedserve", "drain", f"--address=127.0.0.1:{probe_port}"]
        assert v["drain"]["timeoutSeconds"] < pod["terminationGracePeriodSeconds"]


def _merged(name: str) -> dict[str, Any]:
    """Chart defaults coalesced with the value set, as Helm does."""
    with helm.Chart.load(golden.CHART_DIR) as loaded:
        return loaded.merge_values(VALUE_SETS[name])  # type: ignore[no-any-return]


_ENGINE_CONFIG: dict[str, Callable[[dict[str, Any]], Any]] = {
    "prefill": PrefillWorkerConfig.from_mapping, "decode": DecodeConfig.from_mapping}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_config_map_files_load_as_serve_config(renders: dict[str, dict[str, str]], name: str,
                                               tmp_path: Path) -> None:
    merged = _merged(name)
    config_map = _one(_objects(renders, name), "ConfigMap", f"{golden.RELEASE}-cedserve-config")
    assert set(config_map["data"]) == {"router.toml", "prefill.toml", "decode.toml"}
    for filename, text in config_map["data"].items():
        (tmp_path / filename).write_text(text)
        role = filename.removesuffix(".toml")
        if role == "router":  # the real decoders (`cedserve router`'s): unknown fields fail
            loaded, tables = ServeConfig.load_with_sections(tmp_path / filename, ("router",))
            settings = router_table(tables.get("router", {}))
            expected = dict(merged["router"]["settings"])
            expected_limits = {k: ClassLimits(**v) for k, v in expected.pop("limits", {}).items()}
            assert settings == {**expected, **({"limits": expected_limits} if expected_limits else {})}
        else:  # what the worker processes read: ServeConfig plus their own tables
            loaded, extra = read_serve_file(tmp_path / filename, (role, "kv_transfer"))
            assert extra["kv_transfer"]["auth_token_file"] == "/var/run/secrets/cedserve/kv-transfer/token"
            engine = _ENGINE_CONFIG[role](extra[role])  # the workers' own decoders: unknown fields fail
            expected = {"device": "cuda:0" if merged[role]["gpusPerPod"] else "cpu", **merged[role]["engine"]}
            assert extra[role] == expected
            assert all(getattr(engine, key) == value for key, value in expected.items() if key != "preemption")
        cache = {**merged["config"]["cache"], **(merged[role]["cache"] if role != "router" else {})}
        assert loaded.cache.num_blocks == cache["numBlocks"]
        assert loaded.cache.block_size == cache["blockSize"]
        assert loaded.port == merged[role]["ports"]["grpc"]
        if merged["model"]["checkpoint"]["source"] == "none":
            assert loaded.model.preset == merged["model"]["preset"] and loaded.model.checkpoint is None
        else:
            assert loaded.model.checkpoint == merged["model"]["checkpoint"]["mountPath"]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_tls_secrets_are_mounted_where_the_configs_point(renders: dict[str, dict[str, str]], name: str,
                                                         tmp_path: Path) -> None:
    tls = _merged(name)["tls"]
    objs = _objects(renders, name)
    files = _one(objs, "ConfigMap", f"{golden.RELEASE}-cedserve-config")["data"]
    planes = {"router": ("public", "internal"), "prefill": ("internal",), "decode": ("internal",)}
    for obj in objs:
        if obj["kind"] not in {"Deployment", "StatefulSet", "LeaderWorkerSet"}:
            continue
        role = obj["metadata"]["labels"]["app.kubernetes.io/component"]
        pod, container = _pod_spec(obj), _container(obj)
        (tmp_path / "serve.toml").write_text(files[f"{role}.toml"])
        serve, _ = read_serve_file(tmp_path / "serve.toml", (role, "kv_transfer"))
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        for plane in planes[role]:
            loaded = serve.tls if plane == "public" else serve.internal_tls
            if not tls[plane]["enabled"]:
                assert not loaded.enabled and f"tls-{plane}" not in mounts
                continue
            assert secrets[f"tls-{plane}"] == tls[plane]["secretName"]
            assert loaded.cert == f"{mounts[f'tls-{plane}']}/tls.crt" and loaded.key == f"{mounts[f'tls-{plane}']}/tls.key"
            assert loaded.require_client_cert == tls[plane]["requireClientCert"]
        served = "public" if role == "router" else "internal"  # the plane of this process's gRPC port
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ("health" in ports) == tls[served]["enabled"]
        assert (f"--health-port={ports.get('health')}" in container["args"]) == tls[served]["enabled"]


@pytest.mark.parametrize("enabled", [True, False])
def test_router_and_workers_share_the_worker_token(enabled: bool, tmp_path: Path) -> None:
    """With `workerToken.enabled` (the default) every process's `internal_token_file` is the
    kv-transfer Secret's `token`, mounted where the file points; off, nobody names or mounts it."""
    objs = _render_objects({"workerToken": {"enabled": enabled}})
    files = _one(objs, "ConfigMap", f"{golden.RELEASE}-cedserve-config")["data"]
    seen = set()
    for obj in objs:
        if obj["kind"] not in {"Deployment", "StatefulSet", "LeaderWorkerSet"}:
            continue
        role = obj["metadata"]["labels"]["app.kubernetes.io/component"]
        (tmp_path / "serve.toml").write_text(files[f"{role}.toml"])
        serve, _ = read_serve_file(tmp_path / "serve.toml", (role, "kv_transfer"))
        pod, container = _pod_spec(obj), _container(obj)
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        seen.add(role)
        if not enabled:
            assert serve.internal_token_file is None
            continue
        assert secrets["kv-transfer-token"] == f"{golden.RELEASE}-cedserve-kv-transfer"
        assert serve.internal_token_file == f"{mounts['kv-transfer-token']}/token"
        # No mount may nest inside another (a Secret volume is read-only: kubelet cannot add a mount point).
        paths = sorted(mounts.values())
        assert not any(b.startswith(a.rstrip("/") + "/") for a in paths for b in paths if a != b), paths
    assert seen == {"router", "prefill", "decode"}


def test_prefill_and_decode_render_through_the_same_templates() -> None:
    """Give both pools identical values: their objects differ only in the role's name."""
    with helm.Chart.load(golden.CHART_DIR) as loaded:
        pool = copy.deepcopy(loaded.values["decode"])
    for workload in ("StatefulSet", "LeaderWorkerSet"):
        pool["autoscaling"]["enabled"] = workload == "LeaderWorkerSet"
        pool["rdma"]["enabled"] = True
        objs = _render_objects({"groupWorkload": workload, "prefill": pool, "decode": pool,
                                "serviceMonitor": {"enabled": True}})
        by_role: dict[str, list[str]] = {"prefill": [], "decode": []}
        for obj in objs:
            component = obj["metadata"]["labels"].get("app.kubernetes.io/component")
            if component in by_role:
                text = yaml.safe_dump(obj, sort_keys=True)
                by_role[component].append(text.replace("prefill", "ROLE").replace("decode", "ROLE"))
        assert len(by_role["prefill"]) >= 4  # Service, workload, PDB, NetworkPolicy (+ HPA)
        assert sorted(by_role["prefill"]) == sorted(by_role["decode"]), workload


# ---------------------------------------------------------------- command lines (the worker contract)


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    return _pod_spec(obj)["containers"][0]  # type: ignore[no-any-return]


def test_lws_workers_take_group_identity_from_lws_env(renders: dict[str, dict[str, str]]) -> None:
    objs = _objects(renders, "multi-node-lws")
    for role in ("prefill", "decode"):
        lws = _one(objs, "LeaderWorkerSet", _pool_name(role))
        container = _container(lws)
        assert container["command"] == ["cedserve"]
        args = container["args"]
        assert args[:2] == ["worker", f"--role={role}"]
        assert args[-3:] == ["--group-size=$(LWS_GROUP_SIZE)", "--rank=$(LWS_WORKER_INDEX)",
                             "--leader-address=$(LWS_LEADER_ADDRESS)"]
        assert f"--config=/etc/cedserve/{role}.toml" in args
        assert "--checkpoint=/models/checkpoint" in args
    decode = _one(objs, "LeaderWorkerSet", _pool_name("decode"))
    assert decode["spec"]["leaderWorkerTemplate"]["size"] == 4  # four 8-GPU pods, 32 ranks
    assert decode["metadata"]["annotations"] == {
        "leaderworkerset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    hpa = _one(objs, "HorizontalPodAutoscaler", _pool_name("prefill"))
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "leaderworkerset.x-k8s.io/v1",
                                             "kind": "LeaderWorkerSet", "name": _pool_name("prefill")}
    assert "replicas" not in _one(objs, "LeaderWorkerSet", _pool_name("prefill"))["spec"]


def _exported_metrics() -> dict[str, set[str]]:
    """Metric names by exporter: the router's registry, and the prefill and decode workers' own."""
    from cedserve.decode_workers.metrics import DecodeMetrics
    from cedserve.prefill_workers.metrics import PrefillMetrics
    from cedserve.router.metrics import RouterMetrics

    return {kind: {m.name for m in metrics.registry.collect()} | {s.name for m in metrics.registry.collect()
                                                                  for s in m.samples}
            for kind, metrics in (("router", RouterMetrics()), ("prefill", PrefillMetrics()),
                                  ("decode", DecodeMetrics()))}


def test_every_autoscaler_metric_is_exported(renders: dict[str, dict[str, str]]) -> None:
    """An HPA scales on a router metric (External) or on its own pool's pods' metric (Pods): each must
    be a series the code exports, under that name, or the HPA never gets a value."""
    exported, seen = _exported_metrics(), []
    for name in renders:
        for hpa in (o for o in _objects(renders, name) if o["kind"] == "HorizontalPodAutoscaler"):
            role = hpa["metadata"]["labels"]["app.kubernetes.io/component"]
            for metric in hpa["spec"]["metrics"]:
                kind = metric["type"]
                metric_name = metric[kind[0].lower() + kind[1:]]["metric"]["name"]
                assert metric_name in exported["router" if kind == "External" else role], (name, metric_name)
                seen.append((kind, metric_name))
    assert {"External", "Pods"} <= {kind for kind, _ in seen}  # the examples cover both kinds


@pytest.mark.skipif(not Path("/bin/sh").exists(), reason="needs /bin/sh to run the rank derivation")
@pytest.mark.parametrize(("ordinal", "rank", "leader_ordinal"), [(0, 0, 0), (1, 1, 0), (2, 0, 2), (3, 1, 2)])
def test_statefulset_rank_and_leader_come_from_the_ordinal(renders: dict[str, dict[str, str]], tmp_path: Path,
                                                           ordinal: int, rank: int, leader_ordinal: int) -> None:
    """Run the rendered shell preamble with a stand-in `cedserve` that prints its argv."""
    sts = _one(_objects(renders, "multi-node-statefulset"), "StatefulSet", _pool_name("decode"))
    assert sts["spec"]["replicas"] == 4  # 2 groups x 2 pods
    container = _container(sts)
    fake = tmp_path / "cedserve"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    pod = f"{_pool_name('decode')}-{ordinal}"
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}", "POD_NAME": pod}
    out = subprocess.run([*container["command"], *container["args"]], env=env, capture_output=True, text=True,
                         check=True, timeout=10).stdout.splitlines()
    assert out[: len(container["args"])] == container["args"], shlex.join(out)
    headless = sts["spec"]["serviceName"]
    assert out[len(container["args"]):] == [
        "--group-size=2", f"--rank={rank}",
        f"--leader-address={_pool_name('decode')}-{leader_ordinal}.{headless}.{golden.NAMESPACE}.svc.cluster.local"]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_decode_pods_run_a_rank_per_gpu_and_open_their_agents_ports(renders: dict[str, dict[str, str]],
                                                                     name: str) -> None:
    objs = _objects(renders, name)
    for role in ("prefill", "decode"):
        v = _merged(name)[role]
        workload = next(o for o in objs if o["kind"] in {"StatefulSet", "LeaderWorkerSet"}
                        and o["metadata"]["name"] == _pool_name(role))
        args = _container(workload)["args"]
        local = [a for a in args if a.startswith("--local-ranks")]
        assert local == ([f"--local-ranks={v['gpusPerPod']}"] if v["gpusPerPod"] > 1 else [])
        policy = _one(objs, "NetworkPolicy", _pool_name(role)) if v["gpusPerPod"] else None
        if policy is not None:
            nixl = next(p for p in policy["spec"]["ingress"][0]["ports"] if p["port"] == v["ports"]["nixl"])
            assert nixl.get("endPort", nixl["port"]) == v["ports"]["nixl"] + max(v["gpusPerPod"], 1) - 1
    if name == "multi-node-lws":  # the case the test is for is among the value sets
        assert _merged(name)["decode"]["gpusPerPod"] == 8


def test_router_discovers_pools_through_headless_services(renders: dict[str, dict[str, str]]) -> None:
    objs = _objects(renders, "default")
    router = _container(_one(objs, "Deployment", f"{golden.RELEASE}-cedserve-router"))
    for role in ("prefill", "decode"):
        service = _one(objs, "Service", f"{_pool_name(role)}-headless")
        assert service["spec"]["clusterIP"] == "None"
        assert f"--{role}-service={service['metadata']['name']}" in router["args"]
        assert {p["name"] for p in service["spec"]["ports"]} >= {"grpc", "nixl", "metrics"}
    assert "--api-key-file=/var/run/secrets/cedserve/api-key" in router["args"]


@pytest.mark.parametrize("name", ["default", "single-node"])
def test_the_http_api_is_off_by_default_and_public_when_on(renders: dict[str, dict[str, str]], name: str) -> None:
    """`router.http.enabled` (on in the single-node example) adds `--http-port`, the container port and
    the public Service's port; the default render has none of them."""
    objs = _objects(renders, name)
    enabled = bool(_merged(name)["router"]["http"]["enabled"])
    assert enabled == (name == "single-node")
    router = _container(_one(objs, "Deployment", f"{golden.RELEASE}-cedserve-router"))
    service = _one(objs, "Service", f"{golden.RELEASE}-cedserve-router")
    expected = [8000] if enabled else []
    assert [a for a in router["args"] if a.startswith("--http-port")] == [f"--http-port={p}" for p in expected]
    assert [p["containerPort"] for p in router["ports"] if p["name"] == "http"] == expected
    assert [p["port"] for p in service["spec"]["ports"] if p["name"] == "http"] == expected


def test_existing_api_key_secret_is_used_not_generated(renders: dict[str, dict[str, str]]) -> None:
    objs = _objects(renders, "multi-node-statefulset")
    # Only the KV-transfer token is generated; the API key comes from the existing Secret.
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "Secret"] == [f"{golden.RELEASE}-cedserve-kv-transfer"]
    router = _one(objs, "Deployment", f"{golden.RELEASE}-cedserve-router")
    volume = next(v for v in router["spec"]["template"]["spec"]["volumes"] if v["name"] == "api-key")
    assert volume["secret"] == {"secretName": "cedserve-api-key", "items": [{"key": "token", "path": "api-key"}]}


def test_generated_api_key_is_random_and_masked_in_golden() -> None:
    keys = []
    for _ in range(2):
        manifests = golden.render()
        raw = yaml.safe_load(manifests["cedserve/templates/secret-api-key.yaml"])
        keys.append(base64.b64decode(raw["data"]["api-key"]))
        masked = _one(golden.objects(manifests), "Secret", f"{golden.RELEASE}-cedserve-api-key")
        assert masked["data"]["api-key"] == golden.GENERATED
    assert all(len(key) == 48 and key.isalnum() for key in keys)
    assert keys[0] != keys[1]


@pytest.mark.parametrize("name", ["default", "multi-node-lws"])
def test_helm_test_runs_kv_transfer_between_group_leaders(renders: dict[str, dict[str, str]], name: str) -> None:
    objs = _objects(renders, name)
    (job,) = [o for o in objs if o["kind"] == "Job"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["cedserve"] and container["args"][:2] == ["bench", "kv-transfer"]
    args = dict(a.split("=", 1) for a in container["args"][2:])
    for role in ("prefill", "decode"):
        workload = next(o for o in objs if o["kind"] in {"StatefulSet", "LeaderWorkerSet"}
                        and o["metadata"]["name"] == _pool_name(role))
        # Pod 0 leads group 0 both ways; LWS pods live under a Service named after the LWS.
        subdomain = workload["spec"].get("serviceName", _pool_name(role))
        assert args[f"--{role}-address"] == (
            f"{_pool_name(role)}-0.{subdomain}.{golden.NAMESPACE}.svc.cluster.local:50061")
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/instance"] == golden.RELEASE  # so the NetworkPolicies admit it
    # The live-worker mode of `cedserve bench kv-transfer` parses exactly these arguments, and the files
    # they name are the mounted token Secret (the workers' own) and, with tls.internal, the plane's Secret.
    from cedserve.bench.kv_transfer.link_bench import check_arguments, client_tls
    from cedserve.bench.kv_transfer.loadtest import build_parser

    parsed = build_parser().parse_args(container["args"][2:])
    check_arguments(parsed)
    test = _merged(name)["tests"]["kvTransfer"]
    assert (parsed.size_mib, parsed.iterations, parsed.min_gbps, parsed.timeout_s) == (
        test["sizeMiB"], test["iterations"], test["minGbps"], test["timeoutSeconds"])
    pod = job["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"]}
    assert secrets["kv-transfer-token"] == f"{golden.RELEASE}-cedserve-kv-transfer"
    assert parsed.token_file == f"{mounts['kv-transfer-token']}/token"
    internal = _merged(name)["tls"]["internal"]
    tls = client_tls(parsed)
    assert tls.enabled == internal["enabled"] == ("tls-internal" in secrets)
    if internal["enabled"]:
        assert secrets["tls-internal"] == internal["secretName"]
        assert (tls.ca, tls.cert, tls.key) == tuple(f"{mounts['tls-internal']}/{f}" for f in ("ca.crt", "tls.crt", "tls.key"))
        assert tls.server_name == internal["serverName"]


def test_deploy_doc_lists_every_flag_the_chart_passes(renders: dict[str, dict[str, str]]) -> None:
    """docs/deploy.md is the contract the entry points implement: every flag used must be in it."""
    doc = (REPO / "docs" / "deploy.md").read_text()
    used: set[str] = set()
    for name in VALUE_SETS:
        text = golden.golden_text(renders[name])
        used.update(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+(?==)", text))
    missing = sorted(flag for flag in used if f"`{flag}" not in doc)
    assert not missing, f"flags the chart passes but docs/deploy.md does not document: {missing}"
    for verb in ("cedserve router", "cedserve worker", "cedserve drain", "cedserve bench kv-transfer"):
        assert verb in doc


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_cli_accepts_what_the_chart_runs(renders: dict[str, dict[str, str]], name: str, tmp_path: Path) -> None:
    """Every command line the chart runs parses with `cedserve`'s own parser, and the router's
    resolves to a discovery config and a served model (from the rendered router.toml)."""
    from cedserve.cli import _discovery, _router_model, build_parser, router_settings

    parser = build_parser()
    env = {"POD_NAMESPACE": golden.NAMESPACE, "POD_IP": "10.0.0.7", "POD_NAME": "pod-0", "LWS_GROUP_SIZE": "2",
           "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "leader"}

    def expand(args: list[str]) -> list[str]:
        return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]

    objs = _objects(renders, name)
    files = next(o for o in objs if o["kind"] == "ConfigMap")["data"]
    for obj in objs:
        if obj["kind"] not in {"Deployment", "StatefulSet", "LeaderWorkerSet"}:
            continue
        container = _container(obj)
        args = expand(container["args"])
        if container["command"][0] != "cedserve":  # the StatefulSet preamble appends the group flags
            args += ["--group-size=2", "--rank=1", "--leader-address=leader"]
        parsed = parser.parse_args(args)
        drain = container["lifecycle"]["preStop"]["exec"]["command"]
        assert parser.parse_args(drain[1:]).verb == "drain"
        if parsed.verb != "router":
            assert parsed.worker_id == "pod-0"  # discovery names workers after their pods
            continue
        config = tmp_path / "router.toml"
        config.write_text(files["router.toml"])
        parsed.config = str(config)
        discovery = _discovery(parsed)
        assert discovery is not None and discovery.namespace == golden.NAMESPACE
        assert discovery.services == {"prefill": f"{_pool_name('prefill')}-headless",
                                      "decode": f"{_pool_name('decode')}-headless"}
        serve, tables = ServeConfig.load_with_sections(config, ("router",))  # as `cedserve router` reads it
        checkpoint, preset = _router_model(parsed, serve)
        assert checkpoint or preset
        router_settings(parsed, tables.get("router", {}))  # its [router] table passes the router's checks


_CLAIM = {"source": "existingClaim", "existingClaim": "weights"}


@pytest.mark.parametrize(("values", "folder"), [
    pytest.param({"model": {"checkpoint": _CLAIM}}, "/models/checkpoint", id="checkpoint-mounted"),
    pytest.param({"model": {"checkpoint": _CLAIM}, "router": {"mountCheckpoint": False, "modelFiles": {
        "configMap": {"name": "model-files"}}}}, "/models/router", id="model-files-only"),
    pytest.param({"model": {"checkpoint": {"source": "none"}}, "router": {"mountCheckpoint": False}}, None,
                 id="preset"),
])
def test_the_router_reads_only_what_its_pod_mounts(values: dict[str, Any], folder: str | None,
                                                    tmp_path: Path) -> None:
    """The folder the router resolves (its own parser over the rendered args and router.toml) is a
    volume its pod mounts: the checkpoint, or with `mountCheckpoint: false` the `modelFiles` volume."""
    from cedserve.cli import _router_model, build_parser

    objs = _render_objects(values)
    router = _one(objs, "Deployment", f"{golden.RELEASE}-cedserve-router")
    container, pod = _container(router), _pod_spec(router)
    config = tmp_path / "router.toml"
    config.write_text(_one(objs, "ConfigMap", f"{golden.RELEASE}-cedserve-config")["data"]["router.toml"])
    parsed = build_parser().parse_args([a.replace("/etc/cedserve/router.toml", str(config))
                                        for a in container["args"]])
    serve = ServeConfig.load(config)
    checkpoint, preset = _router_model(parsed, serve)
    assert (checkpoint or None) == folder and serve.model.checkpoint == folder
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    if folder is None:
        assert preset == "tiny" and not {"checkpoint", "model-files"} & set(volumes)
        return
    assert folder in mounts and mounts[folder] in volumes
    if folder == "/models/router":
        assert volumes["model-files"]["configMap"] == {"name": "model-files"} and "checkpoint" not in volumes
