"""Text another user controls, made safe to print: control characters shown, never obeyed.

A command line, a user name or a GPU name from a simulate file can hold terminal escape
sequences (``\\x1b]0;title\\x07`` sets the window title, ``\\x1b[2J`` clears the screen) or
newlines that forge extra lines of output. :func:`printable` replaces every control character
(C0, DEL, C1, and Unicode line/paragraph separators and bidirectional overrides) with a visible
escape such as ``\\x1b`` or ``\\u202e``, so whatever devicekit prints of it is inert, on a pipe
and on a terminal alike. Ordinary text, including non-ASCII letters, is left as it is.

Usage::

    from devicekit.hardware.printable import printable

    printable("python train.py\\x1b[2J")      # 'python train.py\\\\x1b[2J'
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["printable"]

# C0 controls, DEL, C1 controls: matched fast; other categories are checked per character
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_UNSAFE_CATEGORIES = ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn")


def _escape(char: str) -> str:
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: object) -> str:
    """``text`` (made a ``str``) with every control or invisible formatting character escaped."""
    value = text if isinstance(text, str) else str(text)
    if value.isascii():
        return _CONTROL.sub(lambda m: _escape(m.group()), value) if _CONTROL.search(value) else value
    return "".join(_escape(c) if unicodedata.category(c) in _UNSAFE_CATEGORIES else c
                   for c in value)
