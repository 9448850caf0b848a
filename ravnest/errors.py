"""The root of every error Ravnest raises on purpose: `except RavnestError` catches what this project
refuses or reports (a bad spec, a refused message, a failed peer, a coordinator's refusal) and lets
a bug's exception through. Each subclass also keeps the built-in base it has always had (ValueError
for bad input, RuntimeError for failures at run time), so existing `except` clauses still hold."""
from __future__ import annotations


class RavnestError(Exception):
    """Raised on purpose by Ravnest, with a reason a user can read."""
