"""deploy/kubernetes, rendered and checked offline.

`kubectl kustomize` renders each overlay. It reads only the local files, and it never talks
to a cluster here: it runs with a kubeconfig whose current context does not exist, because
the kubectl that gcloud installs is a dispatcher that would otherwise ask the configured
server (by default localhost:8080) for its version before running. Every rendered object is
validated against the Kubernetes schemas that the kubernetes-validate package bundles (strict:
an unknown field fails), for each of `K8S_VERSIONS`.

Then what the manifests mean for turnkv, read against the project's own code: the engines'
`--kv-transfer-config` is the launcher's (`turnkv_server.launcher.kv_transfer`); the router's
arguments parse with the router's own command line, and name every engine and its side
channel through Services that reach them; probes ask for paths the servers serve; the
Secrets are placeholders, and referenced.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from importlib.util import find_spec
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from tests.support.prerequisites import cannot_run
from turnkv_server.connector.cluster_secret import check_secret
from turnkv_server.connector.settings import ConnectorSettings
from turnkv_server.launcher.engine import SECRET_ENV
from turnkv_server.launcher.kv_transfer import kv_transfer_config
from turnkv_server.router.__main__ import parse_args
from turnkv_server.router.app import create_app
from turnkv_server.router.config import from_args
from turnkv_server.router.modes.base import NixlPeer

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu", "gpu-efa")
GPU_OVERLAYS = ("gpu", "gpu-efa")
# The base renders too (someone will apply it as it is): it must be valid, and pull nothing.
TARGETS = ("base", *OVERLAYS)
# 1.32: the kubectl on these machines; 1.29: an older release still run widely.
K8S_VERSIONS = ("1.29.0", "1.32.0")
KUBECTL = shutil.which("kubectl")
PLACEHOLDER = "REPLACE-ME"
CONNECTOR_SOURCES = [ROOT / "server_ext" / "turnkv_server" / "connector" / name
                     for name in ("vllm_connector.py", "settings.py")]
# A kubeconfig naming a context it does not define: kubectl fails to build a client from it,
# so the dispatcher skips its server-version query (no socket at all) and runs kustomize.
OFFLINE_KUBECONFIG = ("apiVersion: v1\nkind: Config\ncurrent-context: turnkv-offline\n"
                      "contexts: []\nclusters: []\nusers: []\n")


@pytest.fixture(scope="module", autouse=True)
def kubectl_installed() -> None:
    """Without kubectl, skipped (under CI: failed) with the reason."""
    if KUBECTL is None:
        cannot_run("kubectl is not installed: the Kubernetes manifests cannot be rendered "
                   "(kustomize comes with kubectl)")


Obj = dict[str, Any]


@cache
def rendered(overlay: str) -> tuple[Obj, ...]:
    assert KUBECTL is not None
    folder = DEPLOY / "base" if overlay == "base" else DEPLOY / "overlays" / overlay
    with TemporaryDirectory() as home:
        kubeconfig = Path(home) / "kubeconfig"
        kubeconfig.write_text(OFFLINE_KUBECONFIG)
        result = subprocess.run(
            [KUBECTL, "kustomize", str(folder)],
            env={"PATH": "/usr/bin:/bin", "HOME": home, "KUBECONFIG": str(kubeconfig)},
            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, f"kubectl kustomize {overlay} failed:\n{result.stderr}"
    return tuple(o for o in yaml.safe_load_all(result.stdout) if o)


def objects(overlay: str, kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in rendered(overlay) if o["kind"] == kind}


def engines(overlay: str) -> dict[str, Obj]:
    return {name: d for name, d in objects(overlay, "Deployment").items()
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"}


def router(overlay: str) -> Obj:
    return objects(overlay, "Deployment")["turnkv-router"]


def containers(deployment: Obj) -> list[Obj]:
    return list(deployment["spec"]["template"]["spec"]["containers"])


def secret_value(overlay: str, name: str, key: str) -> str:
    secret = objects(overlay, "Secret")[name]
    values = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    return str({**values, **secret.get("stringData", {})}[key])


def container_env(overlay: str, container: Obj) -> dict[str, str]:
    """The container's environment as the kubelet builds it: values from Secrets and
    ConfigMaps, and `$(VAR)` references to variables defined before."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[item["name"]] = secret_value(overlay, ref["name"], ref["key"])
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[item["name"]] = objects(overlay, "ConfigMap")[ref["name"]]["data"][ref["key"]]
        elif "fieldRef" in source:
            env[item["name"]] = "10.0.0.7"  # status.podIP, as a pod would see it
        else:
            env[item["name"]] = expand(str(item.get("value", "")), env)
    return env


def expand(text: str, env: dict[str, str]) -> str:
    # Kubernetes leaves a reference to an unknown variable as it is.
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def command_line(overlay: str, container: Obj) -> list[str]:
    env = container_env(overlay, container)
    return [expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]


def option(argv: list[str], name: str) -> str:
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
    values += [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]
    assert len(values) == 1, f"{name} given {len(values)} times in {argv}"
    return values[0]


def container_port(container: Obj, port: int | str) -> int:
    """A container port, by number or by name."""
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return int(p["containerPort"])
    raise AssertionError(f"{container['name']} has no port {port!r}")


def service_target(overlay: str, host: str, port: int) -> tuple[Obj, int]:
    """The Deployment behind Service `host` and the container port that `port` reaches."""
    service = objects(overlay, "Service")[host]
    selector = service["spec"]["selector"]
    behind = [d for d in objects(overlay, "Deployment").values()
              if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    assert len(behind) == 1, f"Service {host} selects {len(behind)} Deployments"
    (spec_port,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    return behind[0], container_port(containers(behind[0])[0], spec_port["targetPort"])


def router_config(overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The router's settings from its rendered command line and environment, read by the
    router's own parser, its --api-keys file taken from the Secret mounted there."""
    (container,) = containers(router(overlay))
    argv = command_line(overlay, container)
    assert argv[:3] == ["python3", "-m", "turnkv_server.router"]
    keys_path = Path(option(argv, "--api-keys"))
    mount = next(m for m in container["volumeMounts"] if keys_path.is_relative_to(m["mountPath"]))
    volume = next(v for v in router(overlay)["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    item = next(i for i in volume["secret"]["items"]
                if Path(mount["mountPath"]) / i["path"] == keys_path)
    local = tmp_path / "api-keys.json"
    local.write_text(secret_value(overlay, volume["secret"]["secretName"], item["key"]))
    argv = [str(local) if a == str(keys_path) else a for a in argv]
    for name in ("TURNKV_ADMIN_KEY", "TURNKV_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in container_env(overlay, container).items():
        monkeypatch.setenv(name, value)
    return from_args(parse_args(argv[3:]))


def vllm_get_routes() -> set[str]:
    """The GET paths vLLM's servers declare, read from its source (importing it is slow)."""
    spec = find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed"
    found: set[str] = set()
    for folder in spec.submodule_search_locations:
        for path in (Path(folder) / "entrypoints").rglob("*.py"):
            found.update(re.findall(r"\.get\(\s*[\"'](/[^\"']*)[\"']", path.read_text()))
    return found


def http_probes(container: Obj) -> Iterator[tuple[str, Obj]]:
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        if "httpGet" in container.get(kind, {}):
            yield kind, container[kind]["httpGet"]


@pytest.mark.parametrize("overlay", TARGETS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates(overlay: str, version: str) -> None:
    kinds = {o["kind"] for o in rendered(overlay)}
    assert {"Deployment", "Service", "Secret", "ConfigMap", "PodDisruptionBudget"} <= kinds
    for obj in rendered(overlay):
        where = f"{overlay}: {obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{where}: no Kubernetes {version} schema for this kind")
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{where} is not valid Kubernetes {version}: {path}: {exc.message}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_load_the_turnkv_connector_as_the_launcher_does(overlay: str) -> None:
    deployments = engines(overlay)
    assert {d["metadata"]["labels"]["turnkv/role"] for d in deployments.values()} == {
        "prefill", "decode"}
    known = {f.name for f in dataclasses.fields(ConnectorSettings)} | {
        name for source in CONNECTOR_SOURCES
        for name in re.findall(r"extra\.get\(\"(\w+)\"", source.read_text())}
    engine_ids = set()
    for name, deployment in deployments.items():
        assert deployment["spec"]["replicas"] == 1, name
        (container,) = containers(deployment)
        argv = command_line(overlay, container)
        config = json.loads(option(argv, "--kv-transfer-config"))
        assert config["kv_connector"] == "TurnkvConnector"
        extra = config["kv_connector_extra_config"]
        assert config == kv_transfer_config(
            "turnkv", deployment["metadata"]["labels"]["turnkv/role"], config["engine_id"],
            connector_settings=extra), name
        assert set(extra) <= known, f"{name}: settings the connector never reads"
        # The secret stays off the command line; the connector takes it from the environment.
        assert "side_channel_secret" not in extra
        assert not any(PLACEHOLDER in a for a in argv), name
        ref = next(e for e in container["env"] if e["name"] == SECRET_ENV)
        assert ref["valueFrom"]["secretKeyRef"]["name"] == "turnkv-side-channel"
        engine_ids.add(config["engine_id"])
        env = container_env(overlay, container)
        assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
        assert int(option(argv, "--port")) == container_port(container, "http")
        assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == container_port(
            container, "side-channel")
        assert env.get("UCX_NET_DEVICES") != "lo", "UCX would offer loopback to other hosts"
        model = option(argv, "--model") if "--model" in argv else argv[argv.index("serve") + 1]
        # A local folder on a read-only claim the user fills: no hub download at run time.
        assert model.startswith("/"), f"{name}: model {model!r} is not a local path"
        mount = next(m for m in container["volumeMounts"]
                     if Path(model).is_relative_to(m["mountPath"]))
        volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"]
                      if v["name"] == mount["name"])
        assert mount.get("readOnly") and "persistentVolumeClaim" in volume, name
    assert len(engine_ids) == len(deployments), "two engines share an engine_id"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_reaches_every_engine_and_side_channel(
        overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = router_config(overlay, tmp_path, monkeypatch)
    assert config.mode == "turnkv"
    assert config.api_keys and config.admin_key
    listed = []
    for role, urls, sides in (("prefill", config.prefill, config.prefill_nixl),
                              ("decode", config.decode, config.decode_nixl)):
        for index, (url, side) in enumerate(zip(urls, sides, strict=True)):
            parts = urlsplit(url)
            assert parts.hostname is not None and parts.port is not None
            deployment, port = service_target(overlay, parts.hostname, parts.port)
            labels = deployment["spec"]["template"]["metadata"]["labels"]
            # The router names engines by position: its stats' prefill-0 is this pod.
            assert labels["turnkv/engine"] == f"{role}-{index}", url
            (container,) = containers(deployment)
            assert port == container_port(container, "http")
            # The side channel this router hands the engine's peers reaches the same pod,
            # at the port its connector binds.
            peer = NixlPeer.parse(side)
            side_deployment, side_port = service_target(overlay, peer.host, peer.port)
            assert side_deployment is deployment, side
            env = container_env(overlay, container)
            assert side_port == int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]), side
            engine_id = json.loads(option(command_line(overlay, container),
                                          "--kv-transfer-config"))["engine_id"]
            assert peer.engine_id == engine_id
            listed.append(deployment["metadata"]["name"])
    assert sorted(listed) == sorted(engines(overlay)), "every engine, once"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_two_routers_share_sessions_through_redis(
        overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert router(overlay)["spec"]["replicas"] == 2
    config = router_config(overlay, tmp_path, monkeypatch)
    assert config.redis_url is not None, "routers without --redis keep sessions apart"
    url = urlsplit(config.redis_url)
    assert url.hostname is not None and url.port is not None
    deployment, port = service_target(overlay, url.hostname, url.port)
    (redis,) = containers(deployment)
    argv = command_line(overlay, redis)
    assert url.password == option(argv, "--requirepass")
    assert port == 6379 and "--port" not in argv
    pdb = objects(overlay, "PodDisruptionBudget")["turnkv-router"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= (
        router(overlay)["spec"]["template"]["metadata"]["labels"].items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ask_for_paths_the_servers_serve(
        overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    router_paths = {getattr(r, "path", None)
                    for r in create_app(router_config(overlay, tmp_path, monkeypatch)).routes}
    served = {"engine": vllm_get_routes(), "router": router_paths}
    for name, deployment in objects(overlay, "Deployment").items():
        component = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        for container in containers(deployment):
            assert {"livenessProbe", "readinessProbe"} <= set(container), name
            requests = container.get("resources", {}).get("requests", {})
            assert {"cpu", "memory"} <= set(requests), f"{name}: no resource requests"
            probes = list(http_probes(container))
            if component in served:
                assert any(kind == "readinessProbe" for kind, _ in probes), name
            for kind, probe in probes:
                assert probe["path"] in served[component], f"{name} {kind}: {probe['path']}"
                container_port(container, probe["port"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_placeholders_and_the_deployments_use_them(overlay: str) -> None:
    secrets = objects(overlay, "Secret")
    assert {"turnkv-side-channel", "turnkv-router-keys", "turnkv-redis"} <= set(secrets)
    for name, secret in secrets.items():
        assert "data" not in secret, f"{name}: encoded values hide whether they are real"
        for key, value in secret["stringData"].items():
            assert PLACEHOLDER in value, f"{name}/{key} is not marked as a placeholder"
    used: set[str] = set()
    for name, deployment in objects(overlay, "Deployment").items():
        spec = deployment["spec"]["template"]["spec"]
        refs = [(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
                for c in spec["containers"] for e in c.get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})]
        refs += [(v["secret"]["secretName"], i["key"]) for v in spec.get("volumes", [])
                 if "secret" in v for i in v["secret"].get("items", [])]
        for secret, key in refs:
            assert key in secrets[secret]["stringData"], f"{name}: {secret}/{key} missing"
            used.add(secret)
    assert used == set(secrets), f"Secrets no Deployment uses: {set(secrets) - used}"
    for engine in engines(overlay).values():
        (container,) = containers(engine)
        assert container_env(overlay, container)[SECRET_ENV] == secret_value(
            overlay, "turnkv-side-channel", "secret")
    # Deployed as it is, the placeholder stops the engines: the connector refuses it.
    with pytest.raises(ValueError, match="placeholder"):
        check_secret(secret_value(overlay, "turnkv-side-channel", "secret").encode())


def selected_deployments(overlay: str, selector: Obj) -> set[str]:
    """The Deployments whose pods a NetworkPolicy's `podSelector` picks."""
    assert set(selector) == {"matchLabels"}, "only matchLabels are read here"
    return {name for name, d in objects(overlay, "Deployment").items()
            if selector["matchLabels"].items()
            <= d["spec"]["template"]["metadata"]["labels"].items()}


@pytest.mark.parametrize("overlay", TARGETS)
def test_only_engines_and_routers_reach_the_engines(overlay: str) -> None:
    """NIXL's data path (UCX) is neither authenticated nor encrypted: the engines take
    connections from each other (any port: UCX picks its own) and the routers' to their HTTP
    port, from nothing else."""
    (policy,) = objects(overlay, "NetworkPolicy").values()
    spec = policy["spec"]
    assert selected_deployments(overlay, spec["podSelector"]) == set(engines(overlay))
    assert spec["policyTypes"] == ["Ingress"]
    allowed: dict[str, set[int] | None] = {}  # source Deployment -> engine ports (None: all)
    for rule in spec["ingress"]:
        assert all(set(peer) == {"podSelector"} for peer in rule["from"]), (
            "a rule lets in more than pods of this deployment")
        for peer in rule["from"]:
            for source in selected_deployments(overlay, peer["podSelector"]):
                ports = None
                if "ports" in rule:
                    ports = {container_port(containers(d)[0], p["port"])
                             for d in engines(overlay).values() for p in rule["ports"]}
                allowed[source] = ports
    assert allowed == {**dict.fromkeys(engines(overlay)), "turnkv-router": {8000}}
    for engine in engines(overlay).values():
        (container,) = containers(engine)
        assert container_port(container, "http") == 8000
        assert container_port(container, "side-channel") not in allowed["turnkv-router"]


@pytest.mark.parametrize("overlay", TARGETS)
def test_images_are_placeholders_the_user_names(overlay: str) -> None:
    for name, deployment in objects(overlay, "Deployment").items():
        for container in containers(deployment):
            # registry.invalid never resolves: nothing is pulled until the overlay names it.
            assert container["image"].startswith("registry.invalid/"), (
                f"{name}: image {container['image']!r} is not one of the overlay's "
                "placeholders")
    if overlay != "base":
        # Each overlay's own engine image (vllm-cpu or CUDA vLLM): its `images:` applied.
        base_image = containers(engines("base")["turnkv-prefill-0"])[0]["image"]
        assert all(containers(d)[0]["image"] != base_image for d in engines(overlay).values())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_gives_engines_their_hardware(overlay: str) -> None:
    for name, deployment in engines(overlay).items():
        (container,) = containers(deployment)
        resources = container["resources"]
        env = container_env(overlay, container)
        capabilities = container.get("securityContext", {}).get("capabilities", {})
        if overlay in GPU_OVERLAYS:
            assert resources["limits"]["nvidia.com/gpu"] == "1", name
            assert resources["requests"]["nvidia.com/gpu"] == "1", name
            # RDMA and EFA register (pin) the KV cache for the NIC.
            assert "IPC_LOCK" in capabilities.get("add", []), name
        else:
            assert "nvidia.com/gpu" not in resources.get("limits", {}), name
            assert env["UCX_TLS"] == "tcp" and "VLLM_CPU_KVCACHE_SPACE" in env, name
            # vllm-cpu's `vllm` console script does not start; the launcher runs this module.
            assert command_line(overlay, container)[:3] == [
                "python3", "-m", "vllm.entrypoints.openai.api_server"], name
        if overlay == "gpu":
            assert "rc" in env["UCX_TLS"].split(","), name
        if overlay == "gpu-efa":
            assert resources["limits"]["vpc.amazonaws.com/efa"] == "1", name
            assert env["FI_PROVIDER"] == "efa", name
            # UCX picks SRD on the EFA devices by itself; a transport list could exclude it.
            assert "UCX_TLS" not in env, name
