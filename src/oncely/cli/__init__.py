"""The ``oncely`` command: inspect and maintain stores, and run the demo.

A thin shell over the public library API; it needs the ``cli`` extra (click).
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main() -> None:
    """Console entry point for ``oncely``."""
    try:
        from oncely.cli._app import cli
    except ImportError:
        sys.exit("The oncely command line needs its extra: pip install 'oncely[cli]'")
    cli(prog_name="oncely")
