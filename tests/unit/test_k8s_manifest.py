"""deploy/k8s/forge.yaml against forge and the router: forge's arguments parse with `forge serve`'s parser, its
probes name routes the gateway serves without a key on the ports the container exposes and forge listens on,
the pod outlives its drain, and the router's arguments parse with vllm-router's own parser and select the
forge pods on forge's port."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from actors.daemon_cli import register
from actors.http.gateway import Gateway, GatewayConfig
from actors.ops.metrics import Metrics
from forge.core_cli import build_parser

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "forge.yaml"


def documents() -> dict[tuple[str, str], Any]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(MANIFEST.read_text())}


def container(kind: str, name: str) -> dict[str, Any]:
    [c] = documents()[(kind, name)]["spec"]["template"]["spec"]["containers"]
    return c


def test_forges_arguments_parse_and_its_probes_name_its_routes_and_ports() -> None:
    forge = container("Deployment", "forge")
    args = build_parser(register).parse_args(forge["args"])
    ports = {p["name"]: p["containerPort"] for p in forge["ports"]}
    assert args.addr.rsplit(":", 1)[1] == str(ports["http"])
    assert args.kv_events and args.kv_events_endpoint.rsplit(":", 1)[1] == str(ports["kv-events"])
    paths = {route.path for route in Gateway(GatewayConfig(), Metrics()).app().routes}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = forge[probe]["httpGet"]
        assert get["path"] in paths and get["path"] in ("/healthz", "/health"), probe   # no key needed
        assert get["port"] in ports, probe


def test_the_pod_outlives_its_drain() -> None:
    pod = documents()[("Deployment", "forge")]["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert pod["terminationGracePeriodSeconds"] > float(env["FORGE_DRAIN_TIMEOUT"])
    assert env["FORGE_DOWNLOAD"] == "0"


def test_the_routers_arguments_parse_and_select_the_forge_pods() -> None:
    launch = pytest.importorskip("vllm_router.launch_router")
    router = container("Deployment", "vllm-router")
    parsed = launch.parse_router_args(router["args"])
    forge = documents()[("Deployment", "forge")]
    labels = forge["spec"]["template"]["metadata"]["labels"]
    assert parsed.service_discovery and parsed.selector and parsed.selector.items() <= labels.items()
    forge_ports = {p["name"]: p["containerPort"] for p in forge["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert parsed.service_discovery_port == forge_ports["http"]
    assert parsed.policy in ("cache_aware", "kv_aware", "round_robin", "power_of_two")
    service = documents()[("Service", "forge")]
    assert service["spec"]["selector"].items() <= labels.items()
