"""The docker-compose stack and its Grafana wiring, checked offline (there is no Docker engine).

Each checker returns a list of problems; the tests assert the repository's files have none, and
that each checker finds the fault planted in a broken copy, so none of them passes vacuously.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from spanprof import SloPolicy

from .conftest import require

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"
DEPLOY = REPO / "deploy"

CPU_PROFILE = "process_cpu:cpu:nanoseconds:cpu:nanoseconds"
# Where a service's span-labelled allocations land in Pyroscope, by the exporter that sends
# them: the push as Pyroscope's `memory` type; OTLP under `process_cpu`, the name Pyroscope's
# OTLP ingest gives every profile that is not off-CPU.
MEMORY_PROFILES = {
    "pyroscope": "memory:alloc_space:bytes:space:bytes",
    "otlp": "process_cpu:alloc_space:bytes:space:bytes",
}
# The first Pyroscope server that keeps trace_id out of series labels (grafana/pyroscope#5220).
PYROSCOPE_MIN = (2, 0, 3)
# Long-running services whose images have nothing inside to run a probe with.
NO_PROBE = {
    "tempo": "distroless image: no shell, no HTTP client",
    "otel-collector": "FROM scratch image: no shell, no HTTP client",
}
# Jobs that run to completion; nothing may wait for them to become healthy.
ONE_SHOT = {"traffic"}
# The sample services' settings the Grafana links depend on.
SAMPLE_ENV = (
    "OTEL_SERVICE_NAME",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_SEMCONV_STABILITY_OPT_IN",
    "PYROSCOPE_SERVER_ADDRESS",
    "SPANPROF_SLO_SECONDS",
    "SPANPROF_ROUTE_SLO",
)


@dataclass
class Stack:
    """Every file of the stack, parsed."""

    compose: Any
    collector: Any
    prometheus: Any
    tempo: Any
    datasources: Any
    dashboards: Any
    dashboard: Any
    dockerfile: str
    dockerignore: str


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_stack() -> Stack:
    """Parse the repository's stack files."""
    grafana = DEPLOY / "grafana"
    return Stack(
        compose=_yaml(COMPOSE),
        collector=_yaml(DEPLOY / "otel-collector.yaml"),
        prometheus=_yaml(DEPLOY / "prometheus.yml"),
        tempo=_yaml(DEPLOY / "tempo.yaml"),
        datasources=_yaml(grafana / "provisioning" / "datasources" / "datasources.yaml"),
        dashboards=_yaml(grafana / "provisioning" / "dashboards" / "dashboards.yaml"),
        dashboard=json.loads((grafana / "dashboards" / "spanprof.json").read_text()),
        dockerfile=(DEPLOY / "Dockerfile").read_text(),
        dockerignore=(DEPLOY / "Dockerfile.dockerignore").read_text(),
    )


@pytest.fixture(scope="module")
def stack() -> Stack:
    """The parsed stack, shared read-only by the tests (mutations work on deep copies)."""
    return load_stack()


# ---- compose helpers -----------------------------------------------------------------------


def services(compose: Any) -> dict[str, Any]:
    """The compose services by name."""
    found: dict[str, Any] = compose["services"]
    return found


def service_by_image(compose: Any, repository: str) -> tuple[str, Any]:
    """The one service running ``repository`` (any tag)."""
    matches = [
        (name, svc)
        for name, svc in services(compose).items()
        if split_image(svc.get("image", ""))[0] == repository
    ]
    assert len(matches) == 1, f"expected one service running {repository}, found {matches}"
    return matches[0]


def split_image(reference: str) -> tuple[str, str | None]:
    """``registry/repo:tag@digest`` to ``(registry/repo, tag or None)``."""
    name = reference.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    repo_part, sep, tag = last.partition(":")
    return (f"{head}/{repo_part}" if head else repo_part), (tag if sep else None)


def environment(svc: Any) -> dict[str, str]:
    """A service's environment as a mapping, whichever compose syntax it uses."""
    env = svc.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def command(svc: Any) -> list[str]:
    """A service's command as a list of arguments."""
    cmd = svc.get("command") or []
    return cmd.split() if isinstance(cmd, str) else [str(arg) for arg in cmd]


def bind_mounts(svc: Any) -> Iterator[tuple[str, str]]:
    """``(host source, container target)`` of a service's bind mounts."""
    for volume in svc.get("volumes") or []:
        if isinstance(volume, dict):
            if volume.get("type") == "bind":
                yield volume["source"], volume["target"]
            continue
        source, _, rest = volume.partition(":")
        if source.startswith((".", "/", "~")):
            yield source, rest.split(":", 1)[0]


def host_path(svc: Any, container_path: str, root: Path) -> Path | None:
    """The repository file a container sees at ``container_path``, through its bind mounts."""
    wanted = PurePosixPath(container_path)
    for source, target in bind_mounts(svc):
        mount = PurePosixPath(target)
        if wanted == mount or mount in wanted.parents:
            return (root / source / wanted.relative_to(mount)).resolve()
    return None


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``flag=value`` or ``flag value`` in ``args``."""
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def listen_port(args: list[str]) -> int | None:
    """The port a uvicorn (``--port``) or gunicorn (``--bind host:port``) command listens on."""
    port = flag_value(args, "--port")
    bind = flag_value(args, "--bind")
    if port is not None:
        return int(port)
    if bind is not None:
        return int(bind.rsplit(":", 1)[1])
    return None


def url_host_port(url: str) -> tuple[str, int]:
    """Host and port of an ``http://host:port/...`` URL (``""``/``0`` where absent)."""
    parts = urlsplit(url if "://" in url else f"tcp://{url}")
    return parts.hostname or "", parts.port or 0


def component_type(component_id: str) -> str:
    """``otlp_http/tempo`` to ``otlp_http``: a collector component id's type."""
    return component_id.split("/", 1)[0]


def memory_profile_types(compose: Any) -> set[str]:
    """The profile types the sample services' span-labelled allocations arrive as.

    Only the exact sampler labels memory by span; it runs where the event loop runs in the main
    thread (the uvicorn service). The gunicorn gthread service runs pyroscope-io, whose memory
    samples carry no span.
    """
    types = set()
    for svc in sample_services(compose).values():
        if command(svc)[:1] != ["uvicorn"]:
            continue
        chosen = environment(svc).get("SPANPROF_PROFILES_EXPORTER", "pyroscope").split(",")
        types |= {MEMORY_PROFILES[e.strip()] for e in chosen if e.strip() in MEMORY_PROFILES}
    return types


def sample_services(compose: Any) -> dict[str, Any]:
    """The long-running services built from this repository (the two sample apps)."""
    return {
        name: svc
        for name, svc in services(compose).items()
        if "build" in svc and name not in ONE_SHOT
    }


# ---- checkers ------------------------------------------------------------------------------


def mount_problems(stack: Stack, root: Path) -> list[str]:
    """Bind-mount sources, build contexts and Dockerfiles that are missing from the repo."""
    problems = []
    for name, svc in services(stack.compose).items():
        for source, _ in bind_mounts(svc):
            if not (root / source).exists():
                problems.append(f"{name}: bind mount {source} does not exist")
        build = svc.get("build")
        if build is not None:
            spec = {"context": build} if isinstance(build, str) else build
            context = root / spec.get("context", ".")
            dockerfile = context / spec.get("dockerfile", "Dockerfile")
            if not dockerfile.is_file():
                problems.append(f"{name}: Dockerfile {dockerfile} does not exist")
    return problems


def image_problems(stack: Stack) -> list[str]:
    """Images that are unpinned, ``latest``, or a Pyroscope too old to keep trace_id unindexed."""
    problems = []
    references = [(name, svc.get("image")) for name, svc in services(stack.compose).items()]
    references += [
        ("deploy/Dockerfile", line.split()[1])
        for line in stack.dockerfile.splitlines()
        if line.upper().startswith("FROM ")
    ]
    for name, image in references:
        if image is None:
            continue
        repository, tag = split_image(image)
        if tag is None:
            problems.append(f"{name}: image {image} has no tag")
        elif tag == "latest":
            problems.append(f"{name}: image {image} uses the latest tag")
    for name, svc in services(stack.compose).items():
        if "image" not in svc and "build" not in svc:
            problems.append(f"{name}: neither image nor build")
        repository, tag = split_image(svc.get("image", ""))
        if repository == "grafana/pyroscope" and tag not in (None, "latest"):
            numbers = tuple(int(n) for n in re.findall(r"\d+", tag)[:3])
            if numbers < PYROSCOPE_MIN:
                problems.append(
                    f"{name}: Pyroscope {tag} < 2.0.3 turns every trace_id into a series"
                )
    return problems


def port_problems(stack: Stack) -> list[str]:
    """Published ports that are not bound to 127.0.0.1."""
    problems = []
    for name, svc in services(stack.compose).items():
        if svc.get("network_mode") == "host":
            problems.append(f"{name}: network_mode host bypasses the loopback binding")
        for port in svc.get("ports") or []:
            if isinstance(port, dict):
                bound = port.get("host_ip") == "127.0.0.1"
            else:
                bound = str(port).startswith("127.0.0.1:") and str(port).count(":") == 2
            if not bound:
                problems.append(f"{name}: port {port} is not bound to 127.0.0.1")
    return problems


def healthcheck_problems(stack: Stack) -> list[str]:
    """Long-running services without a probe, and probes that check the wrong port."""
    problems = []
    for name, svc in services(stack.compose).items():
        check = svc.get("healthcheck")
        if name in ONE_SHOT:
            if svc.get("restart", "no") != "no":
                problems.append(f"{name}: a one-shot job must not restart")
            continue
        if name in NO_PROBE:
            if check is not None:
                problems.append(f"{name}: has a healthcheck now; drop it from NO_PROBE")
            continue
        if check is None or check.get("disable"):
            problems.append(f"{name}: long-running service without a healthcheck")
            continue
        test = check.get("test")
        if not isinstance(test, list) or test[0] not in ("CMD", "CMD-SHELL") or len(test) < 2:
            problems.append(f"{name}: healthcheck test must be a CMD list, got {test!r}")
            continue
        port = listen_port(command(svc))
        if port is not None and f"{port}" not in " ".join(test):
            problems.append(f"{name}: healthcheck does not probe the port {port} it listens on")
    return problems


def depends_on_problems(stack: Stack) -> list[str]:
    """``depends_on`` entries without the condition their target can satisfy."""
    problems = []
    all_services = services(stack.compose)
    for name, svc in all_services.items():
        depends = svc.get("depends_on")
        if depends is None:
            continue
        if not isinstance(depends, dict):
            problems.append(f"{name}: depends_on must map each service to a condition")
            continue
        for target, spec in depends.items():
            if target not in all_services:
                problems.append(f"{name}: depends on unknown service {target}")
                continue
            if target in ONE_SHOT:
                expected = "service_completed_successfully"
            elif all_services[target].get("healthcheck") is not None:
                expected = "service_healthy"
            else:
                expected = "service_started"
            condition = (spec or {}).get("condition")
            if condition != expected:
                problems.append(f"{name} → {target}: condition {condition}, expected {expected}")
    return problems


def prometheus_problems(stack: Stack) -> list[str]:
    """Prometheus without exemplar storage, the OTLP receiver, or the service_name label."""
    problems = []
    _, svc = service_by_image(stack.compose, "prom/prometheus")
    args = command(svc)
    features = {
        feature
        for arg in args
        if arg.startswith("--enable-feature=")
        for feature in arg.split("=", 1)[1].split(",")
    }
    if "exemplar-storage" not in features:
        problems.append("prometheus: --enable-feature=exemplar-storage is missing")
    if "--web.enable-otlp-receiver" not in args:
        problems.append("prometheus: --web.enable-otlp-receiver is missing")
    promoted = (stack.prometheus.get("otlp") or {}).get("promote_resource_attributes") or []
    if "service.name" not in promoted:
        problems.append("prometheus: service.name is not promoted to the service_name label")
    return problems


def sample_env_problems(stack: Stack) -> list[str]:
    """Sample services whose OTLP, Pyroscope or SLO settings miss the stack's endpoints."""
    problems = []
    all_services = services(stack.compose)
    collector_name, _ = service_by_image(stack.compose, "otel/opentelemetry-collector-contrib")
    pyroscope_name, _ = service_by_image(stack.compose, "grafana/pyroscope")
    receiver_http = stack.collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    names = []
    for name, svc in sample_services(stack.compose).items():
        env = environment(svc)
        missing = [key for key in SAMPLE_ENV if key not in env]
        if missing:
            problems.append(f"{name}: environment lacks {missing}")
            continue
        names.append(env["OTEL_SERVICE_NAME"])
        if url_host_port(env["OTEL_EXPORTER_OTLP_ENDPOINT"]) != (
            collector_name,
            url_host_port(receiver_http)[1],
        ):
            problems.append(f"{name}: OTEL_EXPORTER_OTLP_ENDPOINT misses the collector")
        if url_host_port(env["PYROSCOPE_SERVER_ADDRESS"]) != (pyroscope_name, 4040):
            problems.append(f"{name}: PYROSCOPE_SERVER_ADDRESS misses {pyroscope_name}:4040")
        if "http" not in env["OTEL_SEMCONV_STABILITY_OPT_IN"].split(","):
            problems.append(f"{name}: OTEL_SEMCONV_STABILITY_OPT_IN must include http")
        try:
            SloPolicy.build(slo_seconds=None, route_slos=None, environ=env)
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
        for peer in all_services:
            for value in env.values():
                if f"//{peer}:" in value and peer not in (svc.get("depends_on") or {}):
                    problems.append(f"{name}: talks to {peer} but does not depend on it")
    if len(set(names)) != len(names):
        problems.append(f"sample services share an OTEL_SERVICE_NAME: {names}")
    return problems


def collector_problems(stack: Stack) -> list[str]:
    """Pipelines that do not carry traces to Tempo and metrics to Prometheus's OTLP receiver."""
    problems = []
    collector = stack.collector
    tempo_name, _ = service_by_image(stack.compose, "grafana/tempo")
    prometheus_name, _ = service_by_image(stack.compose, "prom/prometheus")
    for protocol, spec in collector["receivers"]["otlp"]["protocols"].items():
        # Receivers default to localhost: other containers could not reach them.
        if not str(spec["endpoint"]).startswith("0.0.0.0:"):
            problems.append(f"collector: otlp {protocol} receiver must listen on 0.0.0.0")
    pipelines = collector["service"]["pipelines"]
    for pipeline_id, pipeline in pipelines.items():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind) or []:
                if component not in (collector.get(kind) or {}):
                    problems.append(f"collector: {pipeline_id} uses {component}, not defined")
    tempo_http = stack.tempo["distributor"]["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    tempo_target = (tempo_name, url_host_port(tempo_http)[1])
    exporters = collector.get("exporters") or {}

    def endpoints(pipeline_id: str) -> list[tuple[str, str]]:
        listed = (pipelines.get(pipeline_id) or {}).get("exporters") or []
        return [
            (component_type(e), str((exporters.get(e) or {}).get("endpoint", ""))) for e in listed
        ]

    if not any(
        kind in ("otlp_http", "otlphttp") and url_host_port(url) == tempo_target
        for kind, url in endpoints("traces")
    ):
        problems.append(f"collector: no traces exporter reaches Tempo's OTLP/HTTP {tempo_target}")
    if not any(
        kind in ("otlp_http", "otlphttp")
        and url_host_port(url) == (prometheus_name, 9090)
        and urlsplit(url).path.rstrip("/") == "/api/v1/otlp"
        for kind, url in endpoints("metrics")
    ):
        problems.append("collector: no metrics exporter reaches Prometheus's /api/v1/otlp")
    pyroscope_name, _ = service_by_image(stack.compose, "grafana/pyroscope")
    if not any(
        kind in ("otlp_http", "otlphttp") and url_host_port(url) == (pyroscope_name, 4040)
        for kind, url in endpoints("profiles")
    ):
        problems.append("collector: no profiles exporter reaches Pyroscope's OTLP endpoint")
    _, collector_service = service_by_image(stack.compose, "otel/opentelemetry-collector-contrib")
    if "--feature-gates=service.profilesSupport" not in (collector_service.get("command") or []):
        problems.append("collector: the profiles pipeline needs the service.profilesSupport gate")
    return problems


def datasource_problems(stack: Stack) -> list[str]:
    """Datasources whose cross-references (exemplars → Tempo → Pyroscope) do not line up."""
    problems = []
    by_type: dict[str, Any] = {}
    for ds in stack.datasources["datasources"]:
        by_type.setdefault(ds["type"], ds)  # the first of each type: the one the others name
    uids = [ds["uid"] for ds in stack.datasources["datasources"]]
    if len(set(uids)) != len(uids):
        problems.append(f"datasource uids are not unique: {uids}")
    for needed in ("prometheus", "tempo", "grafana-pyroscope-datasource"):
        if needed not in by_type:
            return [*problems, f"no {needed} datasource"]
    prometheus, tempo = by_type["prometheus"], by_type["tempo"]
    pyroscope = by_type["grafana-pyroscope-datasource"]
    for ds in stack.datasources["datasources"]:
        host, _ = url_host_port(ds["url"])
        if host not in services(stack.compose):
            problems.append(f"datasource {ds['name']}: {host} is not a compose service")
    if url_host_port(tempo["url"])[1] != stack.tempo["server"]["http_listen_port"]:
        problems.append("Tempo datasource port is not Tempo's http_listen_port")
    profiles = tempo.get("jsonData", {}).get("tracesToProfiles") or {}
    if profiles.get("datasourceUid") != pyroscope["uid"]:
        problems.append("tracesToProfiles.datasourceUid is not the Pyroscope datasource uid")
    if profiles.get("profileTypeId") != CPU_PROFILE:
        problems.append(f"tracesToProfiles.profileTypeId is not {CPU_PROFILE}")
    if {"key": "service.name", "value": "service_name"} not in (profiles.get("tags") or []):
        problems.append("tracesToProfiles does not map service.name to service_name")
    if profiles.get("customQuery") is not False:
        problems.append("tracesToProfiles.customQuery must be false (select by span id)")
    metrics = tempo.get("jsonData", {}).get("tracesToMetrics")
    if metrics is not None and metrics.get("datasourceUid") != prometheus["uid"]:
        problems.append("tracesToMetrics.datasourceUid is not the Prometheus datasource uid")
    arriving = memory_profile_types(stack.compose)
    memory = [
        ds["jsonData"]["tracesToProfiles"]
        for ds in stack.datasources["datasources"]
        if ds["type"] == "tempo"
        and str((ds.get("jsonData", {}).get("tracesToProfiles") or {}).get("profileTypeId"))
        .partition(":")[2]
        .startswith("alloc_space:")
    ]
    if not memory:
        problems.append(f"no Tempo datasource links spans to their memory ({sorted(arriving)})")
    for link in memory:
        if link.get("datasourceUid") != pyroscope["uid"] or link.get("customQuery") is not False:
            problems.append("the memory tracesToProfiles must select Pyroscope by span id")
        if link.get("profileTypeId") not in arriving:
            problems.append(
                f"the memory link queries {link.get('profileTypeId')}, but the services' "
                f"span-labelled memory arrives as {sorted(arriving)}"
            )
    destinations = prometheus.get("jsonData", {}).get("exemplarTraceIdDestinations") or []
    if not destinations:
        problems.append("Prometheus has no exemplarTraceIdDestinations")
    for destination in destinations:
        if destination.get("datasourceUid") != tempo["uid"]:
            problems.append("exemplarTraceIdDestinations[].datasourceUid is not the Tempo uid")
        if destination.get("name") != "trace_id":
            problems.append("exemplarTraceIdDestinations[].name must be the label trace_id")
    return problems


def _walk(node: Any) -> Iterator[Any]:
    yield node
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
    for child in children:
        yield from _walk(child)


def _targets(panel: Any) -> list[Any]:
    targets: list[Any] = panel.get("targets") or []
    return targets


def dashboard_problems(stack: Stack) -> list[str]:
    """Dashboard references to unknown datasources or variables, and missing key panels."""
    problems = []
    dashboard = stack.dashboard
    known = {ds["uid"]: ds["type"] for ds in stack.datasources["datasources"]}
    for node in _walk(dashboard):
        if isinstance(node, dict) and isinstance(node.get("datasource"), dict):
            ref = node["datasource"]
            if known.get(ref.get("uid")) != ref.get("type"):
                problems.append(f"unknown datasource {ref} (provisioned: {known})")
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    text = json.dumps(dashboard)
    for used in set(re.findall(r"\$\{?([A-Za-z_]\w*)", text)):
        if not used.startswith("__") and used not in variables:
            problems.append(f"dashboard uses ${used}, which is not a variable")
    panels = [p for p in _walk(dashboard["panels"]) if isinstance(p, dict) and "type" in p]
    latency = [
        p
        for p in panels
        if p["type"] == "timeseries"
        and any(
            "http_server_request_duration_seconds_bucket" in t.get("expr", "")
            and t.get("exemplar") is True
            for t in _targets(p)
        )
    ]
    if not latency:
        problems.append("no time series of the duration histogram with exemplars on")
    for panel in latency:
        exprs = " ".join(t.get("expr", "") for t in _targets(panel))
        for wanted in ("histogram_quantile(0.95", "histogram_quantile(0.99", "$slo"):
            if wanted not in exprs:
                problems.append(f"latency panel {panel['title']!r} lacks {wanted}")
    slo = variables.get("slo", {}).get("query")
    defaults = {
        environment(s).get("SPANPROF_SLO_SECONDS") for s in sample_services(stack.compose).values()
    }
    if defaults != {slo}:
        problems.append(f"the $slo variable ({slo}) differs from SPANPROF_SLO_SECONDS {defaults}")
    flames = [
        p
        for p in panels
        if p["type"] == "flamegraph"
        and any(
            "span_name=" in t.get("labelSelector", "") and t.get("profileTypeId") == CPU_PROFILE
            for t in _targets(p)
        )
    ]
    if not flames:
        problems.append("no flame graph panel filtered by span_name")
    selectors = " ".join(t.get("labelSelector", "") for p in flames for t in _targets(p))
    for side in ("breached", "ok"):
        if f'slo="{side}"' not in selectors:
            problems.append(f"no span_name flame graph of the slo={side} requests to compare")
    arriving = memory_profile_types(stack.compose)
    allocated = [
        p
        for p in panels
        if p["type"] == "timeseries"
        and any(
            t.get("queryType") == "metrics"
            and t.get("profileTypeId") in arriving
            and "span_name" in (t.get("groupBy") or [])
            for t in _targets(p)
        )
    ]
    if not allocated:
        problems.append(f"no time series of allocated bytes by span_name ({sorted(arriving)})")
    return problems


def wiring_problems(stack: Stack, root: Path) -> list[str]:
    """Containers that would load some file other than the one these tests check."""
    problems = []
    configs = {
        "grafana/tempo": ("-config.file", DEPLOY / "tempo.yaml"),
        "prom/prometheus": ("--config.file", DEPLOY / "prometheus.yml"),
        "otel/opentelemetry-collector-contrib": ("--config", DEPLOY / "otel-collector.yaml"),
    }
    for image, (flag, path) in configs.items():
        name, svc = service_by_image(stack.compose, image)
        inside = flag_value(command(svc), flag)
        if inside is None or host_path(svc, inside, root) != path:
            problems.append(f"{name}: {flag} {inside} is not {path.relative_to(REPO)}")
    name, grafana = service_by_image(stack.compose, "grafana/grafana")
    provisioning = DEPLOY / "grafana" / "provisioning"
    if host_path(grafana, "/etc/grafana/provisioning", root) != provisioning:
        problems.append(f"{name}: /etc/grafana/provisioning is not {provisioning}")
    for provider in stack.dashboards["providers"]:
        folder = host_path(grafana, provider["options"]["path"], root)
        if folder is None or not (folder / "spanprof.json").is_file():
            problems.append(f"{name}: dashboard provider path holds no spanprof.json")
    home = environment(grafana).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    home_file = None if home is None else host_path(grafana, home, root)
    if home is not None and (home_file is None or not home_file.is_file()):
        problems.append(f"{name}: home dashboard {home} is not mounted")
    return problems


def copied_sources(dockerfile: str) -> list[str]:
    """The build-context paths a Dockerfile's ``COPY`` lines read (not ``--from`` stages)."""
    sources = []
    for line in dockerfile.splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            sources += [w for w in words[1:-1] if not w.startswith("--")]
    return sources


def ignored(dockerignore: str, path: str) -> bool:
    """Whether a ``.dockerignore`` drops ``path``: the last matching pattern decides."""
    dropped = False
    for raw in dockerignore.splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes):
            dropped = not negated
    return dropped


def dockerfile_problems(stack: Stack, root: Path) -> list[str]:
    """A sample-service image that lacks the package, a server, or a module compose runs."""
    problems = []
    text = stack.dockerfile
    for package in (
        "fastapi",
        "uvicorn",
        "flask",
        "gunicorn",
        "opentelemetry-exporter-otlp-proto-http",
    ):
        if not re.search(rf"(^|\s){re.escape(package)}(\s|$|\\)", text, re.M):
            problems.append(f"deploy/Dockerfile does not install {package}")
    if not re.search(r"pip install \.(\s|$)", text):
        problems.append("deploy/Dockerfile does not pip install the repository (.)")
    if not re.search(r"^USER\s+(?!root\b|0\b)\S+", text, re.M):
        problems.append("deploy/Dockerfile runs the services as root")
    for source in copied_sources(text):
        for path in [root / source] if (root / source).is_file() else (root / source).rglob("*.py"):
            relative = path.relative_to(root).as_posix()
            if ignored(stack.dockerignore, relative):
                problems.append(f"deploy/Dockerfile copies {relative}, which the ignore file drops")
    for name, svc in services(stack.compose).items():
        if "build" not in svc:
            continue
        args = command(svc)
        modules = [
            a.split(":", 1)[0] for a in args if re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", a)
        ]
        modules += [args[i + 1] for i, a in enumerate(args[:-1]) if a == "-m"]
        if not modules:
            problems.append(f"{name}: command {args} runs no module of this repository")
        for module in modules:
            path = root / Path(*module.split("."))
            if not (path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()):
                problems.append(f"{name}: runs {module}, which is not in the repository")
    return problems


CHECKERS: dict[str, Callable[[Stack], list[str]]] = {
    "mounts": lambda s: mount_problems(s, REPO),
    "images": image_problems,
    "ports": port_problems,
    "healthchecks": healthcheck_problems,
    "depends_on": depends_on_problems,
    "prometheus": prometheus_problems,
    "sample_env": sample_env_problems,
    "collector": collector_problems,
    "datasources": datasource_problems,
    "dashboard": dashboard_problems,
    "wiring": lambda s: wiring_problems(s, REPO),
    "dockerfile": lambda s: dockerfile_problems(s, REPO),
}


# ---- tests ---------------------------------------------------------------------------------


def test_docker_compose_accepts_the_compose_file() -> None:
    """Debian's docker-compose validates docker-compose.yml (schema, references, build paths)."""
    binary = shutil.which("docker-compose")
    require(binary is not None, "docker-compose is not installed (apt-get install docker-compose)")
    assert binary is not None
    result = subprocess.run(
        [binary, "-f", str(COMPOSE), "config", "-q"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def _dangling_dependency(compose: Any) -> None:
    services(compose)["grafana"]["depends_on"]["no-such-service"] = {"condition": "service_started"}


def _misspelled_key(compose: Any) -> None:
    services(compose)["tempo"]["heathcheck"] = {"test": ["CMD", "true"]}


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        pytest.param(_dangling_dependency, "no-such-service", id="dangling-depends-on"),
        pytest.param(_misspelled_key, "heathcheck", id="unknown-key"),
    ],
)
def test_docker_compose_rejects_a_broken_file(
    tmp_path: Path, mutate: Callable[[Any], None], expected: str
) -> None:
    """The validator is live: it rejects a copy with a dangling depends_on or an unknown key."""
    binary = shutil.which("docker-compose")
    require(binary is not None, "docker-compose is not installed (apt-get install docker-compose)")
    assert binary is not None
    broken = _yaml(COMPOSE)
    mutate(broken)
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    result = subprocess.run(
        [binary, "-f", str(path), "config", "-q"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert expected in result.stderr, result.stderr


@pytest.mark.parametrize("area", sorted(CHECKERS))
def test_stack_has_no_problems(stack: Stack, area: str) -> None:
    """Each area of the stack (mounts, images, ports, probes, links, ...) checks out clean."""
    assert CHECKERS[area](stack) == []


def _set(path: str, value: Any) -> Callable[[Stack], None]:
    """A mutation assigning ``value`` at a dotted path (``attr.key.0.key``) of the stack."""

    def mutate(stack: Stack) -> None:
        attr, *keys = path.split(".")
        node: Any = getattr(stack, attr)
        for key in keys[:-1]:
            node = node[int(key)] if isinstance(node, list) else node[key]
        last = keys[-1]
        if value is _DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


_DELETE = object()
_GRAFANA = "compose.services.grafana"

_DS = "datasources.datasources"
_EXEMPLAR = f"{_DS}.0.jsonData.exemplarTraceIdDestinations.0"
_PIPELINES = "collector.service.pipelines"
_FASTAPI_ENV = "compose.services.fastapi-app.environment"


def _set_text(attr: str, text: str) -> Callable[[Stack], None]:
    """A mutation replacing one of the stack's raw text files."""

    def mutate(stack: Stack) -> None:
        setattr(stack, attr, text)

    return mutate


def _run_as_root(stack: Stack) -> None:
    stack.dockerfile = stack.dockerfile.replace("USER 10001", "")


@pytest.mark.parametrize(
    ("mutate", "area", "expected"),
    [
        pytest.param(
            _set("compose.services.tempo.image", "grafana/tempo:latest"),
            "images",
            "latest",
            id="latest-tag",
        ),
        pytest.param(
            _set("compose.services.prometheus.image", "prom/prometheus"),
            "images",
            "no tag",
            id="untagged",
        ),
        pytest.param(
            _set("compose.services.pyroscope.image", "grafana/pyroscope:2.0.2"),
            "images",
            "2.0.3",
            id="pyroscope-indexes-trace-ids",
        ),
        pytest.param(
            _set(f"{_GRAFANA}.ports", ["3000:3000"]), "ports", "127.0.0.1", id="all-interfaces"
        ),
        pytest.param(
            _set("compose.services.tempo.volumes", ["./deploy/nope.yaml:/etc/tempo.yaml"]),
            "mounts",
            "does not exist",
            id="missing-mount",
        ),
        pytest.param(
            _set(f"{_GRAFANA}.healthcheck", _DELETE),
            "healthchecks",
            "without a healthcheck",
            id="no-healthcheck",
        ),
        pytest.param(
            _set("compose.services.flask-app.healthcheck.test", ["CMD", "nc", "-z", "::1", "80"]),
            "healthchecks",
            "8002",
            id="probe-wrong-port",
        ),
        pytest.param(
            _set("compose.services.traffic.depends_on", ["fastapi-app"]),
            "depends_on",
            "condition",
            id="list-depends-on",
        ),
        pytest.param(
            _set(f"{_GRAFANA}.depends_on.prometheus.condition", "service_started"),
            "depends_on",
            "service_healthy",
            id="started-not-healthy",
        ),
        pytest.param(
            _set("compose.services.prometheus.command", ["--enable-feature=exemplar-storage"]),
            "prometheus",
            "otlp-receiver",
            id="no-otlp-receiver",
        ),
        pytest.param(
            _set("compose.services.prometheus.command", ["--web.enable-otlp-receiver"]),
            "prometheus",
            "exemplar-storage",
            id="no-exemplar-storage",
        ),
        pytest.param(
            _set(f"{_DS}.1.jsonData.tracesToProfiles.datasourceUid", "tempo"),
            "datasources",
            "tracesToProfiles",
            id="profiles-link-to-tempo",
        ),
        pytest.param(
            _set(f"{_DS}.2.jsonData.tracesToProfiles.profileTypeId", CPU_PROFILE),
            "datasources",
            "memory",
            id="no-memory-span-link",
        ),
        pytest.param(
            _set(f"{_EXEMPLAR}.name", "traceID"), "datasources", "trace_id", id="exemplar-label"
        ),
        pytest.param(
            _set(f"{_EXEMPLAR}.datasourceUid", "jaeger"),
            "datasources",
            "Tempo uid",
            id="exemplar-link-to-nowhere",
        ),
        pytest.param(
            _set("dashboard.panels.1.datasource", {"type": "prometheus", "uid": "nope"}),
            "dashboard",
            "unknown datasource",
            id="dashboard-unknown-uid",
        ),
        pytest.param(
            _set("dashboard.panels.10.targets.0.labelSelector", '{span_name="$span_name"}'),
            "dashboard",
            "slo=ok",
            id="no-breach-comparison",
        ),
        pytest.param(
            _set("dashboard.panels.1.targets.0.exemplar", False),
            "dashboard",
            "exemplars",
            id="exemplars-off",
        ),
        pytest.param(
            _set("dashboard.templating.list.1.query", "0.3"),
            "dashboard",
            "SPANPROF_SLO_SECONDS",
            id="slo-line-drifts",
        ),
        pytest.param(
            _set(f"{_PIPELINES}.traces.exporters", ["otlp_http/prometheus"]),
            "collector",
            "Tempo",
            id="traces-not-to-tempo",
        ),
        pytest.param(
            _set(f"{_PIPELINES}.profiles.exporters", ["otlp_http/tempo"]),
            "collector",
            "Pyroscope's OTLP",
            id="profiles-not-to-pyroscope",
        ),
        pytest.param(
            _set(
                "compose.services.otel-collector.command",
                ["--config=/etc/otelcol-contrib/config.yaml"],
            ),
            "collector",
            "profilesSupport",
            id="profiles-gate-off",
        ),
        pytest.param(
            _set(f"{_PIPELINES}.metrics.exporters", ["otlp_http/missing"]),
            "collector",
            "not defined",
            id="undefined-exporter",
        ),
        pytest.param(
            _set("collector.receivers.otlp.protocols.http.endpoint", "localhost:4318"),
            "collector",
            "0.0.0.0",
            id="receiver-on-localhost",
        ),
        pytest.param(
            _set(f"{_FASTAPI_ENV}.OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318"),
            "sample_env",
            "collector",
            id="otlp-to-nowhere",
        ),
        pytest.param(
            _set(f"{_FASTAPI_ENV}.SPANPROF_PROFILES_EXPORTER", "pyroscope"),
            "datasources",
            "arrives as",
            id="memory-link-to-another-type",
        ),
        pytest.param(
            _set(f"{_FASTAPI_ENV}.SPANPROF_PROFILES_EXPORTER", "pyroscope"),
            "dashboard",
            "allocated bytes",
            id="memory-panel-of-another-type",
        ),
        pytest.param(
            _set(f"{_FASTAPI_ENV}.SPANPROF_ROUTE_SLO", "checkout"),
            "sample_env",
            "SPANPROF_ROUTE_SLO",
            id="bad-route-slo",
        ),
        pytest.param(
            _set("compose.services.tempo.command", ["-config.file=/etc/other.yaml"]),
            "wiring",
            "tempo.yaml",
            id="loads-another-config",
        ),
        pytest.param(
            _set("compose.services.fastapi-app.command", ["uvicorn", "sample_app.nope:app"]),
            "dockerfile",
            "not in the repository",
            id="runs-missing-module",
        ),
        pytest.param(_run_as_root, "dockerfile", "root", id="runs-as-root"),
        pytest.param(
            _set_text("dockerignore", "**\n!README.md\n!pyproject.toml\n!sample_app/**\n"),
            "dockerfile",
            "ignore file drops",
            id="context-lacks-the-package",
        ),
    ],
)
def test_checkers_catch_a_broken_copy(
    stack: Stack, mutate: Callable[[Stack], None], area: str, expected: str
) -> None:
    """Each checker reports the fault planted in a deep copy of the stack."""
    broken = copy.deepcopy(stack)
    mutate(broken)
    problems = CHECKERS[area](broken)
    assert any(expected in problem for problem in problems), problems
