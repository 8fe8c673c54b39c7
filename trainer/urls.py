"""What cloudrl asks of a URL before it sends a secret there, for the CLI and the trainer alike."""

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
