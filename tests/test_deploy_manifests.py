"""The deployments as files: deploy/k8s (and its consumer-lag overlay) and docker-compose.yml carry what
running ragstream needs (probes, resources, secrets, autoscaling, disruption budgets, migrations first),
and the pieces they call (the image entrypoint, ``ragstream migrate``) do what the manifests expect."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ragstream.distributed import SERVICE_APPS
from tests.support.connections import private_database

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
LAG_OVERLAY = REPO / "deploy" / "k8s-consumer-lag"
SERVICES = set(SERVICE_APPS)
AUTOSCALED = {"chunker", "embedder", "indexer", "retriever"}
KAFKA_CONSUMERS = {"chunker", "embedder", "indexer"}
PARTITIONS = 3  # ragstream.kafka.ensure_topics
SECRET = "ragstream-secrets"
SECRET_KEYS = {"DATABASE_URL", "RAGSTREAM_API_KEYS", "RAGSTREAM_CREDENTIAL_KEYS", "RAGSTREAM_EMBEDDER_API_KEY"}


def documents(path: Path) -> list[dict[str, Any]]:
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def kustomization(folder: Path) -> dict[str, Any]:
    return documents(folder / "kustomization.yaml")[0]


def k8s_objects() -> list[dict[str, Any]]:
    return [document for resource in kustomization(K8S)["resources"] for document in documents(K8S / resource)]


def of_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {item["metadata"]["name"]: item for item in k8s_objects() if item["kind"] == kind}


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def test_every_resource_of_the_kustomization_exists_and_the_secret_template_stays_out() -> None:
    resources = kustomization(K8S)["resources"]
    assert all((K8S / resource).is_file() for resource in resources)
    assert "secret.template.yaml" not in resources
    assert {image["name"] for image in kustomization(K8S)["images"]} == {f"ragstream/{name}" for name in SERVICES}


def test_one_deployment_per_service_with_probes_resources_and_the_secret() -> None:
    deployments = of_kind("Deployment")
    assert set(deployments) == SERVICES
    for name, deployment in deployments.items():
        (container,) = pod_spec(deployment)["containers"]
        assert container["image"].startswith(f"ragstream/{name}:")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert probe in container, (name, probe)
        for bound in ("requests", "limits"):
            assert set(container["resources"][bound]) >= {"cpu", "memory"}, (name, bound)
        secret_refs = [source["secretRef"]["name"] for source in container["envFrom"] if "secretRef" in source]
        assert secret_refs == [SECRET], name
        assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_readiness_probes_ask_readiness_not_liveness() -> None:
    for name, deployment in of_kind("Deployment").items():
        (container,) = pod_spec(deployment)["containers"]
        readiness = container["readinessProbe"]
        assert readiness.get("httpGet", {}).get("path") == "/readyz" or "grpc" in readiness, name
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz", name


def test_a_migration_job_runs_first_and_every_service_waits_for_it() -> None:
    (job,) = of_kind("Job").values()
    (container,) = pod_spec(job)["containers"]
    assert container["command"] == ["ragstream", "migrate"]
    assert [source["secretRef"]["name"] for source in container["envFrom"]] == [SECRET]
    for name, deployment in of_kind("Deployment").items():
        (wait,) = pod_spec(deployment)["initContainers"]
        assert wait["command"][:3] == ["ragstream", "migrate", "--wait"], name
        assert wait["image"].startswith(f"ragstream/{name}:")
        assert set(wait["resources"]["limits"]) >= {"cpu", "memory"}


def test_a_pod_disruption_budget_per_service_that_never_blocks_a_drain_forever() -> None:
    deployments, budgets = of_kind("Deployment"), of_kind("PodDisruptionBudget")
    covered = set()
    for budget in budgets.values():
        selector = budget["spec"]["selector"]["matchLabels"]
        matched = [name for name, item in deployments.items() if item["spec"]["selector"]["matchLabels"] == selector]
        assert len(matched) == 1, budget["metadata"]["name"]
        covered.add(matched[0])
        floor = budget["spec"].get("minAvailable")
        if floor is not None:  # a minimum needs more replicas than it keeps, or the node never drains
            scaler = of_kind("HorizontalPodAutoscaler").get(matched[0])
            replicas = scaler["spec"]["minReplicas"] if scaler else deployments[matched[0]]["spec"].get("replicas", 1)
            assert replicas > floor, matched[0]
    assert covered == SERVICES


def test_cpu_autoscaling_for_the_stateless_services_within_the_partitions() -> None:
    scalers, deployments = of_kind("HorizontalPodAutoscaler"), of_kind("Deployment")
    assert {scaler["spec"]["scaleTargetRef"]["name"] for scaler in scalers.values()} == AUTOSCALED
    for scaler in scalers.values():
        target = scaler["spec"]["scaleTargetRef"]
        assert (target["kind"], target["apiVersion"]) == ("Deployment", "apps/v1")
        metrics = {metric["resource"]["name"] for metric in scaler["spec"]["metrics"] if metric["type"] == "Resource"}
        assert "cpu" in metrics
        # The autoscaler owns the replica count: a fixed one would be reset at every apply.
        assert "replicas" not in deployments[target["name"]]["spec"]
        if target["name"] in KAFKA_CONSUMERS:
            assert scaler["spec"]["maxReplicas"] <= PARTITIONS


def test_the_consumer_lag_overlay_adds_an_external_lag_metric_to_each_consumer() -> None:
    overlay = kustomization(LAG_OVERLAY)
    assert (LAG_OVERLAY / overlay["resources"][0]).resolve() == K8S
    patched = {
        item["metadata"]["name"]: item
        for patch in overlay["patches"]
        for item in documents(LAG_OVERLAY / patch["path"])
    }
    assert set(patched) == KAFKA_CONSUMERS
    for name, scaler in patched.items():
        assert scaler["kind"] == "HorizontalPodAutoscaler"
        kinds = [metric["type"] for metric in scaler["spec"]["metrics"]]
        assert kinds == ["Resource", "External"], name  # the patch replaces the list: CPU stays
        external = scaler["spec"]["metrics"][1]["external"]
        assert external["metric"]["name"] == "ragstream_consumer_lag"
        assert external["metric"]["selector"]["matchLabels"] == {"group": f"ragstream-{name}"}


def test_the_secret_template_carries_every_secret_the_services_read() -> None:
    (secret,) = documents(K8S / "secret.template.yaml")
    assert secret["metadata"]["name"] == SECRET
    assert set(secret["stringData"]) == SECRET_KEYS


def test_compose_passes_the_keys_as_secrets_and_migrates_before_the_services() -> None:
    (compose,) = documents(REPO / "docker-compose.yml")
    services = compose["services"]
    assert set(services) >= SERVICES
    assert {"RAGSTREAM_API_KEYS", "RAGSTREAM_CREDENTIAL_KEYS"} <= set(compose["secrets"])
    assert services["migrate"]["command"] == ["ragstream", "migrate"]
    for name in SERVICES:
        service = services[name]
        assert {"RAGSTREAM_API_KEYS", "RAGSTREAM_CREDENTIAL_KEYS"} <= set(service["secrets"]), name
        assert not {"RAGSTREAM_API_KEYS", "RAGSTREAM_CREDENTIAL_KEYS"} & set(service.get("environment", {})), name
        assert "/readyz" in " ".join(service["healthcheck"]["test"]), name
        assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name
        for published in service.get("ports", []):
            assert published.startswith("127.0.0.1:"), (name, published)


def test_the_image_entrypoint_exports_secret_files_as_variables(tmp_path: Path) -> None:
    (tmp_path / "RAGSTREAM_API_KEYS").write_text("admin:0123456789abcdef0123")
    (tmp_path / "kubernetes.io").mkdir()  # a service account's folder: not a variable
    (tmp_path / "not-a-name").write_text("ignored")
    shown = subprocess.run(
        ["sh", str(REPO / "services" / "entrypoint.sh"), "env"],
        env={"PATH": os.environ["PATH"], "RAGSTREAM_SECRETS_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert "RAGSTREAM_API_KEYS=admin:0123456789abcdef0123" in shown
    assert not [line for line in shown if "ignored" in line]


def test_the_image_installs_with_the_pinned_constraints() -> None:
    dockerfile = (REPO / "services" / "Dockerfile").read_text()
    installs = [line for line in dockerfile.splitlines() if "pip install" in line]
    assert installs and all("-c constraints.txt" in line for line in installs)


def migrate(*args: str) -> subprocess.CompletedProcess[str]:
    command = [str(Path(sys.executable).with_name("ragstream")), "migrate", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.integration
async def test_the_job_command_migrates_and_the_init_containers_wait_for_it(database_url: str) -> None:
    async with private_database(database_url) as dsn:
        waiting = migrate("--database-url", dsn, "--wait", "0")
        assert waiting.returncode == 1 and "pending" in waiting.stderr
        applied = migrate("--database-url", dsn)
        assert applied.returncode == 0, applied.stderr
        assert "migration(s) applied: 0001" in applied.stdout
        waited = migrate("--database-url", dsn, "--wait", "0")
        assert waited.returncode == 0, waited.stderr
        again = migrate("--database-url", dsn)
        assert again.stdout.startswith("0 migration(s) applied")
