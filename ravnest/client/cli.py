"""Talk to a Ravnest coordinator: jobs (submit, status, watch, cancel, resume, download), nodes, join
tokens and API keys.

URL and API key: --coordinator and --key, else $RAVNEST_COORDINATOR and $RAVNEST_KEY, else the file
$RAVNEST_CONFIG (default ~/.config/ravnest/client.toml) with `coordinator = "..."` and `key = "..."`.

Exit codes: 0 done, 1 refused (the reason is printed), 2 wrong usage, 3 coordinator unreachable.
"""
from __future__ import annotations

import importlib
import os
import re
import sys
import tomllib
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from ravnest import __version__
from ravnest.client.api import Api, ApiError

app = typer.Typer(help=__doc__, no_args_is_help=True, add_completion=False)
tokens = typer.Typer(help="Join tokens: what volunteers join with (ravnest-node join --token ...).",
                     no_args_is_help=True)
keys = typer.Typer(help="API keys with a role: operator, submitter (its own jobs), reader (sees everything).",
                   no_args_is_help=True)
nodes = typer.Typer(help="Joined nodes.", no_args_is_help=True)
app.add_typer(tokens, name="token")
app.add_typer(keys, name="key")
app.add_typer(nodes, name="node")
# piped into a file or another program: wide enough that no row is cut (a terminal's width otherwise)
out = Console() if sys.stdout.isatty() else Console(width=int(os.environ.get("COLUMNS", 160)))
err = Console(stderr=True, soft_wrap=True)  # a message is one line, whatever the width: scripts grep it
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
                                                      help=f"the coordinator's URL (default: the config file's, "
                                                           f"else {DEFAULT_URL})"),
            key: Optional[str] = typer.Option(None, envvar="RAVNEST_KEY", show_default=False,
                                              help="your API key (an operator's for tokens, keys and nodes; "
                                                   "default: the config file's)"),
            version: bool = typer.Option(False, "--version", callback=show_version, is_eager=True,
                                         help="print the version and exit")) -> None:
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


def call(ctx: typer.Context, method: str, path: str, **kwargs):
    try:
        return ctx.obj.call(method, path, **kwargs)
    except ApiError as e:
        err.print(f"ravnest: {e}", highlight=False)
        raise typer.Exit(1 if e.status else 3) from None


def when(seconds: Optional[float]) -> str:
    return "" if seconds is None else datetime.fromtimestamp(seconds).strftime("%m-%d %H:%M")


def table(*columns: str) -> Table:
    """Ids and times are never wrapped or cut (people copy ids into the next command); names and
    reasons may wrap."""
    grid = Table()
    for column in columns:
        grid.add_column(column, no_wrap=column not in ("name", "reason"),
                        min_width={"id": 16, "name": 10, "reason": 30}.get(column))
    return grid


def show_credentials(rows: list[dict], with_role: bool) -> None:
    table_ = table("id", "name", *(["role"] if with_role else ["uses left", "used"]), "created", "expires", "revoked")
    for row in rows:
        usage = [row["role"] or ""] if with_role else [
            "unlimited" if row["uses_left"] is None else str(row["uses_left"]), str(row["used"])]
        table_.add_row(row["id"], row["name"], *usage, when(row["created_at"]), when(row["expires_at"]) or "never",
                       when(row["revoked_at"]))
    out.print(table_)


def show_created(created: dict) -> None:
    kind = {"join": "join token", "key": "API key"}.get(created["kind"], created["kind"])
    err.print(f"created {kind} {created['id']}; it is shown only now:", highlight=False)
    print(created["token"])  # alone on stdout, so scripts can capture it


@tokens.command("create")
def token_create(ctx: typer.Context, name: str = typer.Option("", help="what it is for"),
                 expires: Optional[str] = typer.Option(None, help="valid for, e.g. 12h or 7d (default: until revoked)"),
                 uses: Optional[int] = typer.Option(None, min=1, help="joins it admits (default: unlimited)")) -> None:
    """Create a join token; prints it once."""
    show_created(call(ctx, "POST", "/v1/join-tokens",
                      json={"name": name, "expires_in_s": duration(expires), "uses": uses}))


@tokens.command("list")
def token_list(ctx: typer.Context) -> None:
    """Join tokens (never the tokens themselves: only their hashes are kept)."""
    show_credentials(call(ctx, "GET", "/v1/join-tokens"), with_role=False)


@tokens.command("revoke")
def token_revoke(ctx: typer.Context, token_id: str) -> None:
    """Nobody joins with it any more (nodes that joined with it stay: revoke them with `node revoke`)."""
    call(ctx, "DELETE", f"/v1/join-tokens/{token_id}")
    err.print(f"join token {token_id} revoked", highlight=False)


@keys.command("create")
def key_create(ctx: typer.Context, role: str = typer.Option(..., help="operator, submitter or reader"),
               name: str = typer.Option("", help="whose key"),
               expires: Optional[str] = typer.Option(None, help="valid for, e.g. 30d (default: until revoked)"),
               ) -> None:
    """Create an API key; prints it once."""
    show_created(call(ctx, "POST", "/v1/keys", json={"name": name, "role": role, "expires_in_s": duration(expires)}))


@keys.command("list")
def key_list(ctx: typer.Context) -> None:
    """API keys and their roles."""
    show_credentials(call(ctx, "GET", "/v1/keys"), with_role=True)


@keys.command("revoke")
def key_revoke(ctx: typer.Context, key_id: str) -> None:
    """The key stops working at once."""
    call(ctx, "DELETE", f"/v1/keys/{key_id}")
    err.print(f"key {key_id} revoked", highlight=False)


@app.command()
def whoami(ctx: typer.Context) -> None:
    """The key you are using: its role and name (checks the URL and key work)."""
    me = call(ctx, "GET", "/v1/whoami")
    out.print(f"{me['role']} key {me['name'] or me['id']} at {ctx.obj.url}"
              + ("" if me["may_submit"] else " (reads only)"), highlight=False)


@nodes.command("list")
def node_list(ctx: typer.Context) -> None:
    """Nodes that joined, their state and what they offer."""
    nodes_ = table("id", "name", "address", "state", "GFLOP/s", "GiB", "job")
    for node in call(ctx, "GET", "/v1/nodes"):
        nodes_.add_row(node["id"], node["name"], node["address"], node["state"],
                       f"{node['profile']['flops'] / 1e9:.1f}", f"{node['profile']['memory_bytes'] / 2**30:.1f}",
                       node["job_id"] or "")
    out.print(nodes_)


@nodes.command("revoke")
def node_revoke(ctx: typer.Context, node_id: str) -> None:
    """The node's credential stops working at once; a job it held is re-planned without it."""
    call(ctx, "POST", f"/v1/nodes/{node_id}/revoke")
    err.print(f"node {node_id} revoked", highlight=False)


importlib.import_module("ravnest.client.jobs")  # the job commands, in their own module, register on `app`


def main() -> None:
    app(prog_name="ravnest")


if __name__ == "__main__":  # `python -m ravnest.client.cli`: the module the job commands registered on
    importlib.import_module("ravnest.client.cli").main()
