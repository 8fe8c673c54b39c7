"""What cloudrl asks of a URL before it sends a secret there, for the CLI and the trainer alike: a loopback
host, a token that is the user's own (never one of the infrastructure's), a URL shown without its password."""

from __future__ import annotations

import ipaddress
import urllib.parse


def is_loopback(url: str) -> bool:
    """Whether the URL's host is this machine (localhost, 127.0.0.0/8, ::1): the only hosts plain http may
    carry a token to, since nothing between here and there can read it."""
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


INFRASTRUCTURE_SECRETS = frozenset({"RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "GOOGLE_APPLICATION_CREDENTIALS"})
INFRASTRUCTURE_PREFIXES = ("RAY_", "AWS_", "GOOGLE_", "GCLOUD_", "AZURE_", "DSTACK_", "HF_", "HUGGING_FACE_", "WANDB_")
"""Environment variables the cluster, the storage and the hub credentials live in: never a scorer's token."""


def infrastructure_secret(name: str) -> bool:
    """Whether the environment variable `name` holds one of the infrastructure's own credentials (the Ray
    cluster's token, cloud and storage keys, the hub's and the metrics service's tokens)."""
    upper = name.upper()
    return upper in INFRASTRUCTURE_SECRETS or upper.startswith(INFRASTRUCTURE_PREFIXES)


def token_problem(url: str, token_env: str, insecure_http: bool = False) -> str:
    """Why the token named by `token_env` may not go to `url` ("" when it may): one line with the fix."""
    if not token_env:
        return ""
    if infrastructure_secret(token_env):
        return (
            f"reward.url_token_env={token_env} names one of the infrastructure's own secrets, which would go to "
            f"the scorer: export the scorer's token under a name of its own (e.g. RM_TOKEN) and give that name"
        )
    if url.lower().startswith("http://") and not is_loopback(url) and not insecure_http:
        return (
            f"reward.url={shown_url(url)} is plain http:// to another host, which would carry the "
            f"reward.url_token_env={token_env} token readable by anyone on the way: use an https:// address, "
            f"a loopback one (e.g. an SSH tunnel to 127.0.0.1), or set reward.url_insecure_http=true"
        )
    return ""


def shown_url(url: str) -> str:
    """The URL for messages, without any user:password@ part."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
