"""The deployment recipes in deploy/: the `ray up` cluster YAML against Ray's own cluster-config
schema, the KubeRay manifests against the KubeRay CRD schemas (../shared/schemas/kuberay, skipped
where that folder is absent), the core Kubernetes objects and the Dockerfile against the shape
they must have, and every `pdcluster serve` command in them against the real CLI parser."""

from __future__ import annotations

import copy
import functools
import json
import re
import shlex
from pathlib import Path

import pytest

from cluster.commands.cli import build_parser

jsonschema = pytest.importorskip("jsonschema")
yaml = pytest.importorskip("yaml")
ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
KUBERAY_SCHEMAS = Path(__file__).resolve().parents[2] / "shared" / "schemas" / "kuberay"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayService": "ray.io_rayservices.yaml"}
ROLES = ("prefill", "decode")
SHM = "/dev/shm"


# --- helpers ---


def load_yaml_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def serve_args(command: str):
    """The arguments of the `pdcluster serve` inside a shell command, parsed by the real CLI."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    start = next(i for i in range(len(tokens) - 1) if tokens[i : i + 2] == ["pdcluster", "serve"])
    argv = []
    for token in tokens[start + 1 :]:
        if token and all(c in "();<>|&}" for c in token):
            break
        argv.append(token)
    return build_parser().parse_args(argv)


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    instructions = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def dockerfile_ray_version() -> str:
    [arg] = [
        rest for key, rest in dockerfile_instructions() if key == "ARG" and "RAY_VERSION" in rest
    ]
    return arg.split("=", 1)[1]


def role_of(resources: dict) -> str | None:
    roles = [role for role in ROLES if resources.get(role, 0) > 0]
    assert len(roles) <= 1, f"a host carries more than one role: {resources}"
    return roles[0] if roles else None


# --- ray up ---


@pytest.fixture(scope="module")
def ray_up_config() -> dict:
    return yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())


def test_ray_up_yaml_validates_against_rays_cluster_schema(ray_up_config):
    schema_path = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    schema = json.loads(schema_path.read_text())
    jsonschema.validate(ray_up_config, schema)
    node_types = ray_up_config["available_node_types"]
    assert ray_up_config["head_node_type"] in node_types
    workers = [t for name, t in node_types.items() if name != ray_up_config["head_node_type"]]
    assert sum(t.get("min_workers", 0) for t in workers) <= ray_up_config["max_workers"]


def test_ray_up_head_has_no_gpu_and_each_role_has_a_gpu_worker_type(ray_up_config):
    node_types = ray_up_config["available_node_types"]
    head = node_types[ray_up_config["head_node_type"]]
    assert head["resources"].get("GPU") == 0
    assert role_of(head["resources"]) is None
    by_role = {}
    for name, node_type in node_types.items():
        role = role_of(node_type["resources"])
        if role is not None:
            by_role[role] = node_type
            assert node_type["resources"]["GPU"] >= node_type["resources"][role] >= 1, name
            assert node_type.get("min_workers", 0) >= 1, f"{name} would start with no hosts"
    assert set(by_role) == set(ROLES)


def test_ray_up_installs_pdcluster_and_the_head_serves_what_the_workers_hold(ray_up_config):
    setup = " ".join(ray_up_config["setup_commands"])
    [(remote, local)] = ray_up_config["file_mounts"].items()
    assert local == "." and f"pip install -e {remote}" in setup
    [serve] = [c for c in ray_up_config["head_start_ray_commands"] if "pdcluster serve" in c]
    args = serve_args(serve)
    assert args.ray_address == "auto" and args.host == "0.0.0.0" and args.device == "cuda"
    assert args.wait_for_nodes > 0
    node_types = ray_up_config["available_node_types"]
    capacity = {role: 0 for role in ROLES}
    for node_type in node_types.values():
        role = role_of(node_type["resources"])
        if role is not None:
            capacity[role] += node_type["resources"][role] * node_type["min_workers"]
    assert args.prefill_nodes <= capacity["prefill"]
    assert args.decode_nodes <= capacity["decode"]
    for command in ray_up_config["worker_start_ray_commands"]:
        assert "pdcluster" not in command  # workers run Ray only; the head places the nodes


def test_ray_up_runs_the_ray_version_the_image_pins(ray_up_config):
    assert ray_up_config["docker"]["image"].split(":")[1].startswith(dockerfile_ray_version())


# --- Kubernetes ---


@pytest.fixture(scope="module")
def k8s_objects() -> list[dict]:
    objects = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if path.name != "kustomization.yaml":
            objects += load_yaml_documents(path)
    return objects


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def strict(schema: dict) -> dict:
    """The schema with unknown fields refused, as `kubectl apply` (strict field validation) does:
    a misplaced or misspelled field fails here instead of being dropped."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


@functools.cache
def load_crd(kind: str) -> dict:
    # The CRDs are large: the C loader, where PyYAML has it, reads them in a fraction of the time.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load((KUBERAY_SCHEMAS / CRD_FILES[kind]).read_text(), Loader=loader)


def crd_schema(kind: str, api_version: str) -> dict:
    crd = load_crd(kind)
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    return served["schema"]["openAPIV3Schema"]


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    manifests = {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(manifests)


def test_kuberay_resources_validate_against_the_crd_schemas(k8s_objects):
    if not KUBERAY_SCHEMAS.is_dir():
        pytest.skip(f"the KubeRay CRD schemas are not here: {KUBERAY_SCHEMAS}")
    custom = [o for o in k8s_objects if o["kind"] in CRD_FILES]
    assert custom, "deploy/k8s holds no RayCluster or RayService"
    for obj in custom:
        schema = strict(crd_schema(obj["kind"], obj["apiVersion"]))
        jsonschema.validate(obj, schema)


def test_strict_crd_validation_catches_a_misplaced_field(k8s_objects):
    if not KUBERAY_SCHEMAS.is_dir():
        pytest.skip(f"the KubeRay CRD schemas are not here: {KUBERAY_SCHEMAS}")
    [cluster] = of_kind(k8s_objects, "RayCluster")
    broken = copy.deepcopy(cluster)
    group = broken["spec"]["workerGroupSpecs"][0]
    group["tolerations"] = group["template"]["spec"].pop("tolerations")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, strict(crd_schema("RayCluster", cluster["apiVersion"])))


def ray_cluster_spec(k8s_objects: list[dict]) -> dict:
    clusters = of_kind(k8s_objects, "RayCluster")
    services = of_kind(k8s_objects, "RayService")
    specs = [c["spec"] for c in clusters] + [s["spec"]["rayClusterConfig"] for s in services]
    assert len(specs) == 1, "deploy/k8s should describe one Ray cluster"
    return specs[0]


def group_resources(group: dict) -> dict[str, float]:
    """The custom resources a group declares to `ray start` (KubeRay quotes the JSON)."""
    declared = group.get("rayStartParams", {}).get("resources")
    return json.loads(declared.strip().strip("'\"").replace('\\"', '"')) if declared else {}


def test_worker_groups_are_gpu_pods_of_one_role_with_shared_memory(k8s_objects):
    spec = ray_cluster_spec(k8s_objects)
    roles = {}
    for group in spec["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        [container] = pod["containers"]
        limits = container["resources"]["limits"]
        gpus = int(limits["nvidia.com/gpu"])
        assert gpus >= 1, group["groupName"]
        assert int(container["resources"].get("requests", limits)["nvidia.com/gpu"]) == gpus
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"]), group["groupName"]
        shm_volumes = {
            v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"
        }
        assert any(
            m["mountPath"] == SHM and m["name"] in shm_volumes for m in container["volumeMounts"]
        ), f"{group['groupName']} does not mount a memory-backed {SHM}"
        role = role_of(group_resources(group))
        assert role is not None, f"{group['groupName']} declares no prefill/decode resource"
        assert group_resources(group)[role] <= gpus
        roles[role] = group
    assert set(roles) == set(ROLES)


def head_container(spec: dict) -> dict:
    [container] = spec["headGroupSpec"]["template"]["spec"]["containers"]
    return container


def test_head_has_no_gpu_and_serves_what_the_worker_groups_hold(k8s_objects):
    spec = ray_cluster_spec(k8s_objects)
    head = head_container(spec)
    for amounts in head.get("resources", {}).values():
        assert "nvidia.com/gpu" not in amounts
    assert spec["headGroupSpec"]["rayStartParams"].get("num-gpus") == "0"
    args = serve_args(" ".join(head["command"] + head.get("args", [])))
    assert args.ray_address == "auto" and args.host == "0.0.0.0" and args.device == "cuda"
    capacity = {role: 0 for role in ROLES}
    for group in spec["workerGroupSpecs"]:
        resources = group_resources(group)
        role = role_of(resources)
        capacity[role] += resources[role] * group["minReplicas"]
    assert args.prefill_nodes <= capacity["prefill"]
    assert args.decode_nodes <= capacity["decode"]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["api"] == args.port


def test_api_service_selects_the_head_and_exposes_the_api_port(k8s_objects):
    [cluster] = of_kind(k8s_objects, "RayCluster")
    [service] = of_kind(k8s_objects, "Service")
    assert service["apiVersion"] == "v1"
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", service["metadata"]["name"])
    spec = service["spec"]
    assert spec.get("type", "ClusterIP") in ("ClusterIP", "NodePort", "LoadBalancer")
    assert spec["selector"] == {
        "ray.io/cluster": cluster["metadata"]["name"],
        "ray.io/node-type": "head",
    }
    head_ports = {p["name"]: p["containerPort"] for p in head_container(cluster["spec"])["ports"]}
    for port in spec["ports"]:
        assert isinstance(port["port"], int) and 0 < port["port"] < 65536
        assert port.get("protocol", "TCP") == "TCP"
    targets = {p["targetPort"] for p in spec["ports"]}
    assert "api" in targets or head_ports["api"] in targets


def test_every_container_runs_the_image_kustomize_rewrites(k8s_objects):
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    [image] = kustomization["images"]
    spec = ray_cluster_spec(k8s_objects)
    templates = [spec["headGroupSpec"]["template"]] + [
        g["template"] for g in spec["workerGroupSpecs"]
    ]
    for template in templates:
        for container in template["spec"]["containers"]:
            assert container["image"].split(":")[0] == image["name"]
    assert spec["rayVersion"] == dockerfile_ray_version()


# --- image ---


def test_dockerfile_builds_on_cuda_installs_pdcluster_and_serves_on_all_interfaces():
    instructions = dockerfile_instructions()
    [base] = [rest for key, rest in instructions if key == "FROM"]
    assert base.startswith("nvidia/cuda:")
    runs = [rest for key, rest in instructions if key == "RUN"]
    copies = [rest for key, rest in instructions if key == "COPY"]
    assert ". ." in copies
    assert any(re.search(r"pip install (\S+ )*\"?\.(\[[a-z,]+\])?\"?( |$)", run) for run in runs)
    [cmd] = [rest for key, rest in instructions if key in ("CMD", "ENTRYPOINT")]
    argv = json.loads(cmd)
    assert argv[:2] == ["pdcluster", "serve"]
    args = build_parser().parse_args(argv[1:])
    assert args.host == "0.0.0.0"
    [exposed] = [rest for key, rest in instructions if key == "EXPOSE"]
    assert int(exposed) == args.port


def test_docker_build_context_leaves_out_the_venv_and_git():
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
