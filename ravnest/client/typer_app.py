"""What every `ravnest` command shares: the typer app and its options (the coordinator's URL and the
API key), the client, and how results and refusals are printed. The commands register on `app`:
ravnest/client/admin.py (tokens, keys, nodes) and ravnest/client/job_commands.py (jobs); cli.py runs it."""
from __future__ import annotations

import os
import re
import sys
import tomllib
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from ravnest import __version__
from ravnest.client.api import Api, ApiError
from ravnest.printable import shown

app = typer.Typer(no_args_is_help=True, add_completion=False)  # its help: cli.py's docstring
tokens = typer.Typer(help="Join tokens: what volunteers join with (ravnest-node join --token ...).",
                     no_args_is_help=True)
keys = typer.Typer(help="API keys with a role: operator, submitter (its own jobs), reader (sees everything).",
                   no_args_is_help=True)
nodes = typer.Typer(help="Joined nodes.", no_args_is_help=True)
app.add_typer(tokens, name="token")
app.add_typer(keys, name="key")
app.add_typer(nodes, name="node")


def _width(stream) -> int | None:
    """A terminal's own width (None), else $COLUMNS, else 80: what people read fits (the whole of every
    field is in `--json` and the API). Volunteers' text is never read as markup."""
    return None if stream.isatty() else int(os.environ.get("COLUMNS") or 80)


out = Console(width=_width(sys.stdout), markup=False, highlight=False)
err = Console(stderr=True, width=_width(sys.stderr), markup=False, highlight=False)
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


DEFAULT_URL = "http://127.0.0.1:8470"


def config_file() -> Path:
    return Path(os.environ.get("RAVNEST_CONFIG") or Path.home() / ".config" / "ravnest" / "client.toml")


def configured() -> dict:
    """The config file's settings ({} without one); a broken file is an error, not silently ignored."""
    path = config_file()
    try:
        settings = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        err.print(f"ravnest: cannot read {path}: {e}", highlight=False)
        raise typer.Exit(2) from None
    unknown = set(settings) - {"coordinator", "key"}
    if unknown:
        err.print(f"ravnest: {path}: unknown setting(s) {', '.join(sorted(unknown))} (known: coordinator, key)",
                  highlight=False)
        raise typer.Exit(2)
    return settings


def show_version(value: bool) -> None:
    if value:
        print(f"ravnest {__version__}")
        raise typer.Exit()


@app.callback()
def connect(ctx: typer.Context,
            coordinator: Optional[str] = typer.Option(None, envvar="RAVNEST_COORDINATOR", show_default=False,
                                                      help=f"the coordinator's URL, or several separated by "
                                                           f"commas (the next is used when one does not answer; "
                                                           f"default: the config file's, else {DEFAULT_URL})"),
            key: Optional[str] = typer.Option(None, envvar="RAVNEST_KEY", show_default=False,
                                              help="your API key (an operator's for tokens, keys and nodes; "
                                                   "default: the config file's)"),
            version: bool = typer.Option(False, "--version", callback=show_version, is_eager=True,
                                         metavar="", help="print the version and exit")) -> None:  # (a flag)
    if ctx.invoked_subcommand == "demo":
        return  # the demo starts its own coordinator
    settings = configured() if coordinator is None or key is None else {}
    ctx.obj = Api(coordinator or settings.get("coordinator") or DEFAULT_URL, key or settings.get("key"))
    ctx.call_on_close(ctx.obj.close)


def duration(text: Optional[str]) -> Optional[float]:
    """'90', '30m', '12h', '7d' -> seconds."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not match:
        raise typer.BadParameter(f"{text!r}: expected a duration like 90, 30m, 12h or 7d")
    return float(match[1]) * UNITS[match[2] or "s"]


def _answered(asking: Callable[..., Any], *args, **kwargs) -> Any:
    """What `asking` the coordinator returns; its refusal, or that none answered, ends the command."""
    try:
        return asking(*args, **kwargs)
    except ApiError as e:
        err.print(f"ravnest: {e}", highlight=False)
        raise typer.Exit(1 if e.status else 3) from None


def call(ctx: typer.Context, method: str, path: str, **kwargs):
    return _answered(ctx.obj.call, method, path, **kwargs)


def listed_page(ctx: typer.Context, path: str, flags: str, **params) -> tuple[list, str]:
    """A page of a list, and a line for below its table where the list is longer: how many of how many
    are shown, and the command's `flags` that choose others ("" where it is whole)."""
    items, total = _answered(ctx.obj.page, path, **params)
    return items, f"{len(items)} of {total} shown; {flags}" if total > len(items) else ""


def when(seconds: Optional[float]) -> str:
    return "" if seconds is None else datetime.fromtimestamp(seconds).strftime("%m-%d %H:%M")


class PlainTable(Table):
    """Cells shown as text (ravnest/printable.py): a name cannot move the cursor, retitle the window or
    forge a row (the console reads no markup either)."""

    def add_row(self, *cells, **options) -> None:
        super().add_row(*(shown(cell) if isinstance(cell, str) else cell for cell in cells), **options)


def table(*columns: str) -> Table:
    """Plain columns, as `kubectl get` prints them. Ids and times are never wrapped or cut (people copy
    ids into the next command); names, addresses and reasons may wrap."""
    grid = PlainTable(box=None, pad_edge=False, header_style="bold")
    for column in columns:
        grid.add_column(column, no_wrap=column not in ("name", "address", "reason"),
                        min_width={"id": 16, "name": 6, "reason": 20}.get(column))
    return grid


def show(grid: Table, spare: tuple[str, ...] = ()) -> None:
    """Print a table within the output's width (a terminal's, or $COLUMNS): while it would not fit, the
    `spare` columns are left out, least needed first, and a line below says which."""
    left_out = []
    for name in spare:
        if Measurement.get(out, out.options.update_width(10_000), grid).minimum <= out.width:
            break
        grid.columns = [column for column in grid.columns if column.header != name]
        left_out.append(name)
    out.print(grid)
    if left_out:
        out.print(f"(left out at {out.width} columns: {', '.join(left_out)})", style="dim", highlight=False)


def say(line: str) -> None:
    """A line of output, wrapped between words at the output's width, shown as text (as a table's cells)."""
    out.print(shown(line))
