"""Text other users control (command lines, user names, GPU names) made inert for a web page.

Anyone on a shared machine can start a process whose command line holds HTML, a script, a
terminal escape or a right-to-left override. :func:`inert_html` shows such text as it is,
character for character, and lets none of it act: control characters (C0, DEL, C1) and bidi
controls become visible ``\\x1b``/``\\u202e`` escapes, over-long text is cut, and the rest is
HTML-escaped (quotes included, so it is safe in attributes too).

Usage::

    from devicekit.serve.inert import inert_html

    inert_html('<script>alert(1)</script>\\x1b[31m')
    # '&lt;script&gt;alert(1)&lt;/script&gt;\\\\x1b[31m'
"""

from __future__ import annotations

import html
import re
from typing import Any

__all__ = ["inert_text", "inert_html", "MAX_CHARS"]

#: longest text shown; a command line past this is cut with an ellipsis
MAX_CHARS = 300
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def inert_text(value: Any, limit: int = MAX_CHARS) -> str:
    """``value`` as plain text with every control character shown as an escape, at most
    ``limit`` characters (plus an ellipsis)."""
    text = "" if value is None else str(value)
    if len(text) > limit:
        text = text[:limit] + "\u2026"
    return _CONTROL.sub(_visible, text)


def inert_html(value: Any, limit: int = MAX_CHARS) -> str:
    """:func:`inert_text`, HTML-escaped for element text and attribute values."""
    return html.escape(inert_text(value, limit), quote=True)
