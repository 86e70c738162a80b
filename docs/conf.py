"""Sphinx configuration: the Markdown guides in this folder, read by MyST, themed by Furo.

Build: sphinx-build -W --keep-going -n -b html docs docs/_build/html (scripts/test runs it).
The build reads nothing from the network: no intersphinx, no CDN assets.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.transforms import SphinxTransform

from oncely import __version__

project = "oncely"
author = "The oncely developers"
copyright = "the oncely developers"
version = release = __version__

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["colon_fence"]
# Headings become link targets (#rules-every-key-follows), as GitHub renders them.
myst_heading_anchors = 4

nitpicky = True
suppress_warnings: list[str] = []

html_theme = "furo"
html_title = f"oncely {release}"
html_static_path: list[str] = []
html_show_sourcelink = False


class RepositoryFileLinks(SphinxTransform):
    """A guide's link to a Markdown file of the repository outside docs/ (a benchmark's full
    results) becomes a download of that file, as it is a link to the file on GitHub. A link to
    a file that does not exist stays unresolved, and fails the build."""

    default_priority = 100

    def apply(self, **kwargs: object) -> None:
        source_dir = Path(self.env.srcdir)
        for node in list(self.document.findall(addnodes.pending_xref)):
            if node.get("reftype") != "myst" or node.get("refdomain") != "doc":
                continue
            if node["reftarget"] in self.env.found_docs:
                continue
            target = (source_dir / f"{node['reftarget']}.md").resolve()
            if not target.is_file() or source_dir in target.parents:
                continue
            page = Path(self.env.doc2path(self.env.docname)).parent
            download = addnodes.download_reference(
                refdomain=None,
                reftype="myst",
                reftarget=os.path.relpath(target, page),
                refdoc=self.env.docname,
                refexplicit=True,
            )
            download += node.children or [nodes.literal(text=target.name)]
            node.replace_self(download)


def setup(app: Sphinx) -> None:
    app.add_transform(RepositoryFileLinks)
