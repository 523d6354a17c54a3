"""The Kubernetes manifests (k8s/): the RayService validates strictly (unknown fields are errors,
as `kubectl apply --validate=strict` makes them) against KubeRay's vendored CRD; its Serve config
is configs/cluster.yaml, rendered, never edited by hand; the pods run as non-root without
privilege escalation; only the Serve port is open to the network."""

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

from stepserve import kuberay

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "k8s"
CRD = Path(__file__).parent / "kuberay-v1.7.0" / "ray.io_rayservices.yaml"


def strict(schema):
    """The CRD's schema with every object closed to fields it does not declare (the API server
    prunes or, with strict validation, refuses them), except where it keeps unknown fields."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def validator():
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))


@pytest.fixture(scope="module")
def service():
    return yaml.safe_load((K8S / "rayservice.yaml").read_text())


def errors(validator, manifest) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]


def test_the_rayservice_validates_strictly_against_kuberays_crd(validator, service):
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    assert errors(validator, service) == []


def test_strict_validation_catches_a_misspelled_field(validator, service):
    wrong = copy.deepcopy(service)
    wrong["spec"]["rayClusterConfig"]["enableInTreeAutoscalling"] = True
    head = wrong["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["securityContex"] = head.pop("securityContext")
    found = errors(validator, wrong)
    assert len(found) == 2 and all("Additional properties are not allowed" in e for e in found)


def test_its_serve_config_is_configs_cluster_yaml_as_rendered(service):
    assert yaml.safe_load(service["spec"]["serveConfigV2"]) == yaml.safe_load(
        (ROOT / "configs" / "cluster.yaml").read_text())
    assert (K8S / "rayservice.yaml").read_text() == kuberay.rendered(ROOT)  # nobody edited it by hand
    assert kuberay.main(["--check", "--root", str(ROOT)]) == 0


def test_rendering_needs_its_marker_once():
    with pytest.raises(ValueError, match="exactly once"):
        kuberay.render("spec:\n  serveConfigV2: |\n    nothing\n", "a: 1\n")
    assert kuberay.render("#! a note\nx: |\n  @SERVE_CONFIG@\ny: 2\n", "a: 1\n\nb: 2\n") == (
        kuberay.HEADER + "x: |\n  a: 1\n\n  b: 2\ny: 2\n")


def pods(service):
    cluster = service["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def test_pods_run_unprivileged_and_keys_stay_on_the_head(service):
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0" and cluster["authOptions"] == {"mode": "token"}
    assert cluster["enableInTreeAutoscaling"] and cluster["gcsFaultToleranceOptions"]["redisPassword"]["valueFrom"]
    for group in cluster["workerGroupSpecs"]:
        assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    for template in pods(service):
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] != 0
        for container in spec["containers"]:
            assert container["image"] == "stepserve"  # kustomization.yaml sets the registry and tag
            assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                    "capabilities": {"drop": ["ALL"]}}
    head, *workers = pods(service)

    def secrets(pod):
        return {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for c in pod["spec"]["containers"]
                for e in c.get("env", ())}

    # The API keys only where the app is built (it hands digests on); the job store's Redis
    # password wherever the store may run.
    assert secrets(head) == {"STEPSERVE_API_KEYS": "stepserve-api-keys", "STEPSERVE_REDIS_PASSWORD": "stepserve-redis"}
    assert all(secrets(w) == {"STEPSERVE_REDIS_PASSWORD": "stepserve-redis"} for w in workers)
    models = [v for w in workers for v in w["spec"]["volumes"] if v["name"] == "models"]
    assert models and all(v["persistentVolumeClaim"]["readOnly"] for v in models)
    pvc = yaml.safe_load((K8S / "models-pvc.yaml").read_text())
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]


def test_only_the_serve_port_is_open_to_the_network():
    ray_policy, redis_policy = yaml.safe_load_all((K8S / "networkpolicy.yaml").read_text())
    open_rules = [rule for rule in ray_policy["spec"]["ingress"] if "from" not in rule]
    assert [rule["ports"] for rule in open_rules] == [[{"port": 8000, "protocol": "TCP"}]]
    assert all(rule["from"] for rule in redis_policy["spec"]["ingress"])


def test_kustomize_lists_every_manifest_and_finds_the_rayservices_images():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "kustomizeconfig.yaml",
                                                          "rayservice.template.yaml"}
    assert set(kustomization["resources"]) == manifests
    paths = [entry["path"] for entry in yaml.safe_load((K8S / "kustomizeconfig.yaml").read_text())["images"]]
    service = yaml.safe_load((K8S / "rayservice.yaml").read_text())
    for path in paths:  # each path reaches the containers' images
        nodes = [service]
        for part in path.split("/"):
            key = part.removesuffix("[]")
            nodes = [n[key] for n in nodes]
            if part.endswith("[]"):
                nodes = [item for n in nodes for item in n]
        assert nodes and set(nodes) == {"stepserve"}, path
