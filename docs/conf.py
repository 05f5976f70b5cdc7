"""Sphinx configuration: MyST Markdown pages, the API reference from the docstrings (autodoc).

Build with warnings as errors, as CI does::

    python -m sphinx -W -b html docs docs/_build/html
"""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # the package from this checkout
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

import pyro_gradroute  # noqa: E402

project = "pyro_gradroute"
author = "pyro_gradroute developers"
copyright = "pyro_gradroute developers"
release = version = pyro_gradroute.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "results",  # docs/_ext/results.py: include a generated results file, or say how to make it
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "results/*.md", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# The API reference documents each subpackage's ``__all__``; names that are on their way out of
# the public API are excluded by name (see docs/api/*.rst).
autodoc_default_options = {"members": True, "member-order": "bysource", "show-inheritance": True}
autodoc_typehints = "description"
autodoc_class_signature = "separated"
add_module_names = False

html_theme = "alabaster"
html_title = f"pyro_gradroute {release}"
html_static_path = []
