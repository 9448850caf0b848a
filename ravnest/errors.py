"""The root of every error Ravnest raises on purpose: `except RavnestError` catches what this project
refuses or reports (a bad spec, a refused message, a failed peer, a coordinator's refusal) and lets
a bug's exception through. Each subclass also keeps the built-in base it has always had (ValueError
for bad input, RuntimeError for failures at run time), so existing `except` clauses still hold."""
from __future__ import annotations


class RavnestError(Exception):
    """Raised on purpose by Ravnest, with a reason a user can read."""


def did_you_mean(word: str, choices: list[str]) -> str:
    """" (did you mean 'x'?)" for the closest of `choices` to a mistyped `word`, else "". Case does not
    count against a choice ('adamw' is close to 'AdamW')."""
    import difflib

    by_lower = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""
