"""Griffe extension for the API pages: render the reST bits of Miles' Sphinx-style docstrings.

Miles' docstrings use ``:class:`x```-style roles and end with ``.. versionadded:: 0.1`` (as pytest's and
tox's do). Griffe's Sphinx parser keeps the roles verbatim and reads the directive as the tail of the
last ``:param:``. This extension turns roles into inline code (``~a.b.C`` shows ``C``) and moves version
directives into a sentence after the summary, before the parameters.
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
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class RestDocstrings(Extension):
    """Rewrite reST roles as inline code and ``.. versionadded:: X`` as *Added in version X.*"""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        docstring = getattr(obj, "docstring", None)
        if docstring is None:
            return
        text = _ROLE.sub(_role, docstring.value)
        notes = [f"*{_WORDS[kind]} {version}.*" for kind, version in _DIRECTIVE.findall(text)]
        if notes:
            text = _DIRECTIVE.sub("", text).rstrip()
            head, sep, tail = text.partition("\n\n")
            text = head + "\n\n" + "\n".join(notes) + (sep + tail if sep else "")
        docstring.value = text
