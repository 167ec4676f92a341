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
    # SIGTERM drains within the pod's grace period.
    grace = next(e["value"] for e in container["env"] if e["name"] == "SPECDEC_GRACE")
    assert float(grace) < pod["spec"]["terminationGracePeriodSeconds"]
