"""The compose stack agrees with the binary and the metrics: docker/docker-compose.yml parses;
every Swarmgate service runs a real subcommand with flags and SWARMGATE_* variables that
subcommand takes, and publishes the port it listens on; Prometheus scrapes that port; the
Grafana dashboard queries only metric families the gateway defines and covers latency,
throughput, the queue, the KV tiers, routing and the verifier."""

import json
import os
import pathlib
import re
import subprocess

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
# Read by the logger, not by the command line.
LOG_VARIABLE = "SWARMGATE_LOG"


def swarmgate_help(subcommand: str) -> str:
    run = subprocess.run(
        [os.environ["SWARMGATE_BIN"], subcommand, "--help"],
        capture_output=True, text=True, check=True,
    )
    return run.stdout


def compose_services() -> dict:
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())["services"]


def swarmgate_services() -> dict:
    return {
        name: service for name, service in compose_services().items()
        if service.get("build", {}).get("dockerfile") == "docker/Dockerfile"
    }


def test_the_stack_has_the_scale_out_roles_and_their_services():
    services = compose_services()
    for name in ["nats", "redis", "postgres", "gateway", "worker", "prometheus", "grafana"]:
        assert name in services, f"no {name} service"
    assert "-js" in services["nats"]["command"], "JetStream is off"
    assert services["gateway"]["command"][0] == "gateway"
    assert services["worker"]["command"][0] == "worker"
    for name in ["gateway", "worker"]:
        environment = dict(e.split("=", 1) for e in services[name]["environment"] if "=" in e)
        assert environment["SWARMGATE_NATS"] == "nats://nats:4222", name
    assert "SWARMGATE_REDIS" in " ".join(services["gateway"]["environment"])
    # Every gateway and worker sees the same agents.
    for name in ["gateway", "worker", "swarmgate"]:
        environment = dict(e.split("=", 1) for e in services[name]["environment"] if "=" in e)
        assert environment["SWARMGATE_DATABASE_URL"].endswith("@postgres:5432/swarmgate"), name
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy", name


def test_every_swarmgate_service_uses_real_flags_variables_and_ports():
    services = swarmgate_services()
    assert services, "the compose file runs Swarmgate"
    for name, service in services.items():
        subcommand, *args = service["command"]
        usage = swarmgate_help(subcommand)
        for flag in (a for a in args if a.startswith("--")):
            assert re.search(rf"\s{re.escape(flag)}\s", usage), f"{name}: {subcommand} has no {flag}"
        for entry in service.get("environment", []):
            variable = entry.split("=", 1)[0]
            if variable != LOG_VARIABLE:
                assert f"[env: {variable}" in usage, f"{name}: {subcommand} reads no {variable}"
        port = args[args.index("--port") + 1]
        published = [mapping.rsplit(":", 1)[-1] for mapping in service["ports"]]
        assert port in published, f"{name} listens on {port} but publishes {published}"


def test_prometheus_scrapes_every_replica_on_its_port():
    prometheus = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = {
        (name, str(sd["port"]))
        for job in prometheus["scrape_configs"]
        for sd in job.get("dns_sd_configs", [])
        for name in sd["names"]
    }
    for name, service in swarmgate_services().items():
        args = service["command"]
        assert (name, args[args.index("--port") + 1]) in targets, f"{name} is not scraped"
    # /metrics takes a key when keys are configured: every scrape sends the one compose writes.
    entrypoint = " ".join(compose_services()["prometheus"]["entrypoint"])
    for job in prometheus["scrape_configs"]:
        key_file = job["authorization"]["credentials_file"]
        assert key_file in entrypoint, f"{job['job_name']} reads a key file nobody writes"


def test_the_dashboard_queries_metrics_the_gateway_exports():
    defined = set(re.findall(r'"(swarmgate_[a-z_]+)"', (ROOT / "gateway/src/metrics.rs").read_text()))
    dashboard = json.loads((DOCKER / "grafana/dashboards/swarmgate.json").read_text())
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            queried.update(re.findall(r"swarmgate_[a-z_]+", target["expr"]))
    families = {re.sub(r"_bucket$", "", name) for name in queried}
    assert families <= defined, f"not exported: {sorted(families - defined)}"
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in ["first token", "inter-token", "throughput", "queue", "kv", "agent", "verifier"]:
        assert topic in titles, f"no {topic} panel"


def test_nats_admits_only_the_role_users_and_health_checks_call_ready():
    services = compose_services()
    nats = services["nats"]
    assert nats["command"][:2] == ["-c", "/etc/nats/nats.conf"]
    assert "./nats.conf:/etc/nats/nats.conf:ro" in nats["volumes"]
    config = (DOCKER / "nats.conf").read_text()
    for user in ["gateway", "worker"]:
        assert f"user: {user}" in config, f"no NATS user {user}"
    assert "no_auth_user" not in config, "anonymous clients would get in"
    for name in ["gateway", "worker"]:
        environment = dict(e.split("=", 1) for e in services[name]["environment"] if "=" in e)
        assert environment["SWARMGATE_NATS_USER"] == name
        assert environment["SWARMGATE_NATS_PASSWORD"].startswith("${"), "a password in the file"
    for name, service in swarmgate_services().items():
        args = service["command"]
        port = args[args.index("--port") + 1]
        probe = " ".join(service["healthcheck"]["test"])
        assert f"127.0.0.1:{port}/ready" in probe, f"{name}'s health check does not call /ready"
