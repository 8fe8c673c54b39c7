"""The one place the CLI relies on a private part of Ray (pinned: cli/pins.py RAY_VERSION).

Ray's `JobSubmissionClient` sends its HTTP requests without a timeout, so a tunnel whose far end hangs
would hang `cloudrl` too. The client below gives every request a connect and a read timeout by
overriding the private `SubmissionClient._do_request(method, endpoint, **kwargs)` that all of Ray's
Jobs calls go through, and it sets the client's private `_headers` (the headers every call sends), so
that the client sends the token the CLI chose and no other. tests/cli/test_cli_unit.py fails loudly if a Ray
upgrade renames or reshapes the method.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

PRIVATE_HOOK = ("ray.dashboard.modules.dashboard_sdk", "SubmissionClient", "_do_request")
"""Module, class and method overridden below."""


def bounded_job_client(url: str, headers: dict[str, str], connect_s: float, read_s: float, write_s: float) -> Any:
    """Ray's JobSubmissionClient for `url` whose requests time out (`write_s` for POST/PUT uploads)."""
    from ray.job_submission import JobSubmissionClient

    if not os.environ.get("CLOUDRL_DEBUG"):  # Ray's client logs every upload and closed stream at INFO
        for name in (
            "ray.dashboard.modules.dashboard_sdk",
            "ray.dashboard.modules.job.sdk",
            "ray._private.runtime_env.packaging",
        ):
            logging.getLogger(name).setLevel(logging.WARNING)

    class BoundedJobClient(JobSubmissionClient):
        def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", (connect_s, write_s if method in ("POST", "PUT") else read_s))
            return super()._do_request(method, endpoint, **kwargs)

    # Ray lets RAY_ADDRESS (and RAY_API_SERVER_ADDRESS) override the address it is given; the CLI has
    # already resolved --address against RAY_ADDRESS, so both are hidden while the client is built.
    with _env_unset("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        client = BoundedJobClient(url, headers=dict(headers) or None)
    # Where this shell has RAY_AUTH_MODE=token, Ray's client adds RAY_AUTH_TOKEN (or ~/.ray/auth_token) to
    # every request, whatever the host. The CLI has already decided which token this cluster may get:
    # exactly the headers given, nothing Ray found on its own.
    client._headers = {k: v for k, v in client._headers.items() if k.lower() != "authorization"}
    client._headers.update(headers)
    return client


@contextlib.contextmanager
def _env_unset(*names: str) -> Iterator[None]:
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
