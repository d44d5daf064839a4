"""`helm install` through Helm's own install action (the README's command), offline."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from ..promised import require
from .conftest import CHART, NAMESPACE, RELEASE, helm, kubeconfig_for, render_objects


def install(values=None, dry_run: str | None = "client", **kwargs):
    config = helm.Config(storage_driver="memory", namespace=NAMESPACE, **kwargs)
    try:
        return config.install(str(CHART), RELEASE, values, namespace=NAMESPACE, create_namespace=True,
                              dry_run=dry_run, timeout=30)
    finally:
        config.close()


def test_readme_install_command(chart):
    """helm install moe-proxy charts/moe-proxy -n moe-proxy --create-namespace (client dry run)."""
    release = install()
    assert (release["name"], release["namespace"], release["chart_name"]) == (RELEASE, NAMESPACE, "moe-proxy")
    installed = sorted((o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(release["manifest"]) if o)
    rendered = sorted((o["kind"], o["metadata"]["name"]) for o in render_objects(chart))
    assert installed == rendered
    assert "kubectl get pxm" in release["notes"]


def test_install_rejects_bad_values():
    with pytest.raises(helm.HelmReleaseError, match=r"at '/jobs/accelerator/devicesPerNode': minimum"):
        install({"jobs": {"accelerator": {"devicesPerNode": 0}}})


def test_install_refuses_a_cluster_older_than_the_chart_supports(tmp_path):
    """Against an API server that reports Kubernetes 1.30, Helm refuses the chart's
    kubeVersion (>=1.31, for the Jobs' podFailurePolicy) before creating anything."""
    kmock = require("kmock", "kmock")

    async def scenario():
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator):
            emulator.resources.load_bundled()
            emulator["get /version"] << {"major": "1", "minor": "30", "gitVersion": "v1.30.9", "platform": "linux/amd64"}
            kubeconfig = kubeconfig_for(str(emulator.url))
            with pytest.raises(helm.HelmReleaseError, match=r"requires kubeVersion: >=1\.31") as caught:
                await asyncio.wait_for(asyncio.to_thread(install, dry_run=None, kubeconfig_content=kubeconfig), 60)
            return caught, list(emulator.objects.keys())

    caught, created = asyncio.run(scenario())
    assert "v1.30.9" in str(caught.value)
    assert created == []


def test_notes_say_the_default_images_are_not_published(chart):
    """Until every image points elsewhere, the release notes say the defaults must be built
    and pushed (they are not published)."""
    def notes(values=None) -> str:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)["moe-proxy/templates/NOTES.txt"]

    assert "the default images (ghcr.io/moe-proxy/...) are not published" in notes()
    assert "--for=condition=Ready" in notes()
    own = {"image": {"repository": "registry.example.com/mp/operator"},
           "jobs": {"transformerImage": "registry.example.com/mp/moe-proxy:0.1.0",
                    "reproductionImage": "registry.example.com/mp/moe-proxy-ascend:0.1.0"}}
    assert "not published" not in notes(own)
    assert "not published" in notes({**own, "jobs": {**own["jobs"], "reproductionImage": ""}})
