// MathJax 3 typesets the formulas that pymdownx.arithmatex (generic mode) marks with class "arithmatex", and nothing
// else (code blocks keep their backslashes). The script itself is the site's own copy (docs/hooks/mathjax.py).
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
  svg: {
    fontCache: "global",
  },
};
