"""Every environment variable pdcluster reads, in one typed place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models live: $PDCLUSTER_CACHE_DIR, else $XDG_CACHE_HOME/pdcluster."""
    explicit = os.environ.get("PDCLUSTER_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "pdcluster"
