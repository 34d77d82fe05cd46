"""mkdocs hook: the site carries its own MathJax, so the math renders offline (no CDN, no download at build time).

`pymdownx.arithmatex` (generic mode) leaves each formula in the page as ``\\(...\\)`` / ``\\[...\\]`` inside an element
of class ``arithmatex``; ``docs/javascripts/mathjax-config.js`` tells MathJax 3 to typeset those elements only, and
this hook adds MathJax's single-file TeX-to-SVG build (``es5/tex-svg-full.js``: every TeX extension built in, SVG
output, so no font files and nothing loaded on demand) from the installed ``django-static-mathjax`` package (the
official MathJax 3.2.2 release files; the package has no Python dependencies and ``import mathjax`` is an empty
module) to the site's files as ``javascripts/mathjax/tex-svg-full.js``, the path ``extra_javascript`` names.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

MATHJAX_SITE_PATH = "javascripts/mathjax/tex-svg-full.js"
MATHJAX_PACKAGE_FILE = Path("static/mathjax/es5/tex-svg-full.js")


def mathjax_script() -> Path:
    """The path of MathJax's ``tex-svg-full.js`` inside the installed ``django-static-mathjax`` package."""
    spec = importlib.util.find_spec("mathjax")
    script = None if spec is None or not spec.submodule_search_locations else (
        Path(next(iter(spec.submodule_search_locations))) / MATHJAX_PACKAGE_FILE)
    if script is None or not script.is_file():
        raise PluginError("the docs render their math with the MathJax files of the `django-static-mathjax` package, "
                          "which is not installed: pip install -e '.[docs]'")
    return script


def on_files(files, config):
    files.append(File.generated(config, MATHJAX_SITE_PATH, abs_src_path=str(mathjax_script())))
    return files
