"""Where cloudrl keeps its files on a machine: one cache directory for the CLI and the trainer alike."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$CLOUDRL_CACHE, else ~/.cache/cloudrl: built-in models, staged models, the local cluster's state."""
    return Path(os.environ.get("CLOUDRL_CACHE") or Path.home() / ".cache" / "cloudrl")
