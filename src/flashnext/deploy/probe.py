"""Deploy's record functions as validate's :class:`~flashnext.validate.deployment.DeploymentProbe`.

Validate talks only HTTP and never imports deploy; the commands that run it hand it this probe,
so ``validate`` and ``validate ab`` results carry the deployment records captured here.
"""

from __future__ import annotations

from dataclasses import asdict

from flashnext.deploy.record import capture, describe
from flashnext.deploy.record_diff import record_diff
from flashnext.validate.deployment import DeploymentProbe


def deployment_probe(api_key: str | None = None, container: str | None = None) -> DeploymentProbe:
    """Capture (by the URL's port, or ``container``), describe and diff deployment records;
    ``api_key`` is sent to the server and kept out of the records."""
    return DeploymentProbe(
        capture=lambda url: capture(url, api_key=api_key, container=container),
        describe=describe,
        diff=lambda a, b: [asdict(c) for c in record_diff(a, b)],
    )
