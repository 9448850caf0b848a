"""Text that others supply and operators read: names with control characters are refused at the API;
prose has them escaped; and everything is shown escaped wherever it is printed.

A volunteer's name is printed in `ravnest nodes`, the coordinator's log and the dashboard. Named
`"\x1b[2J\x1b]0;owned\x07"` it cleared the operator's screen and retitled the window; `"a\nb"`
forged a table row. Control characters (C0, DEL, C1) and the bidirectional overrides, which reorder
what a terminal shows, have no place in a name. Prose (a failure's reason, an exception's words) may
break lines, and is escaped rather than refused: a failure report is never lost to a stray byte.
"""
from __future__ import annotations

import logging
import re
from typing import Annotated

from pydantic import AfterValidator

_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_UNPRINTABLE_IN_PROSE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")  # \t and \n may be


def _escaped(found: re.Match[str]) -> str:
    return found.group().encode("unicode_escape").decode()


def _one_line(text: str) -> str:
    found = _UNPRINTABLE.search(text)
    if found:
        raise ValueError(f"holds a control character (U+{ord(found.group()):04X} at {found.start()}); names are "
                         "printed in terminals and tables: printable text only")
    return text


def _escape_in_prose(text: str) -> str:
    return _UNPRINTABLE_IN_PROSE.sub(_escaped, text)


Name = Annotated[str, AfterValidator(_one_line)]
Prose = Annotated[str, AfterValidator(_escape_in_prose)]


def shown(text: str) -> str:
    """`text` for one table cell or log line: each control character as its escape (`\x1b`), line
    breaks and tabs as spaces. For text from before the API refused it, and from peers that bypass it."""
    return _UNPRINTABLE.sub(lambda found: " " if found.group() in "\t\n\r" else _escaped(found), text)


class PrintableRecords(logging.Filter):
    """Log records with their message and arguments `shown`: a volunteer's words (a failure's reason, a
    path it asked for) can neither forge a line of the log nor move a terminal's cursor. Installed on
    handlers (and on uvicorn's access logger, which formats its arguments itself); tracebacks, ours,
    keep their lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = shown(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(shown(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: shown(v) if isinstance(v, str) else v for k, v in record.args.items()}
        return True
