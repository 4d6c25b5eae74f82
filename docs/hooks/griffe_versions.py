"""Griffe extension for the API pages: render reST version directives in Sphinx-style docstrings.

Miles' docstrings end with ``.. versionadded:: 0.1`` (as pytest's and tox's do). Griffe's Sphinx
parser would read that line as the tail of the last ``:param:``; this extension moves it into a sentence
after the summary, before the parameters.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension

_DIRECTIVE = re.compile(r"^\s*\.\. (versionadded|versionchanged|deprecated):: *(\S+)[ \t]*\n?", re.MULTILINE)
_WORDS = {
    "versionadded": "Added in version",
    "versionchanged": "Changed in version",
    "deprecated": "Deprecated since version",
}


class VersionDirectives(Extension):
    """Rewrite ``.. versionadded:: X`` as *Added in version X.* after the docstring's first paragraph."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        docstring = getattr(obj, "docstring", None)
        if docstring is None or (".. version" not in docstring.value and ".. deprecated" not in docstring.value):
            return
        notes = [f"*{_WORDS[kind]} {version}.*" for kind, version in _DIRECTIVE.findall(docstring.value)]
        text = _DIRECTIVE.sub("", docstring.value).rstrip()
        head, sep, tail = text.partition("\n\n")
        docstring.value = head + "\n\n" + "\n".join(notes) + (sep + tail if sep else "")
