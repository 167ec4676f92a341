"""The deployment files: valid Kubernetes objects (checked offline against the schemas), wired
to what the server serves."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).parent.parent / "deploy"
K8S_VERSION = "1.30.0"


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("*.yaml")), ids=lambda p: p.name)
def test_manifests_are_valid(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_deployment_probes_health_and_is_scraped() -> None:
    deployment = yaml.safe_load((DEPLOY / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
    assert container["resources"]["requests"]["cpu"]
    # The pause before SIGTERM and the drain after it fit the pod's grace period.
    grace = next(e["value"] for e in container["env"] if e["name"] == "SPECDEC_GRACE")
    pause = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"
    assert float(pause[1]) + float(grace) < pod["spec"]["terminationGracePeriodSeconds"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"]


def test_the_image_runs_as_a_numeric_user_and_checks_its_own_port() -> None:
    dockerfile = (DEPLOY.parent / "Dockerfile").read_text()
    user = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    assert user and user[-1].isdigit()  # runAsNonRoot can verify only a numeric user
    assert "SPECDEC_PORT" in dockerfile.split("HEALTHCHECK", 1)[1]
    ignored = (DEPLOY.parent / ".dockerignore").read_text().split()
    assert {".venv", "build", ".git"} <= set(ignored)
