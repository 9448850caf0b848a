"""Talk to a Ravnest coordinator: jobs (submit, status, watch, cancel, resume, download), nodes, join
tokens and API keys.

URL and API key: --coordinator and --key, else $RAVNEST_COORDINATOR and $RAVNEST_KEY, else the file
$RAVNEST_CONFIG (default ~/.config/ravnest/client.toml) with `coordinator = "..."` and `key = "..."`.

Exit codes: 0 done, 1 refused (the reason is printed), 2 wrong usage, 3 coordinator unreachable.
"""
from __future__ import annotations

from ravnest.client import admin, data, generate, job_commands, models  # noqa: F401 -- their commands register on `app`
from ravnest.client.typer_app import app

app.info.help = __doc__


def main() -> None:
    app(prog_name="ravnest")


if __name__ == "__main__":
    main()
