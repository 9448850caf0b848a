"""The operator's commands: join tokens, API keys and nodes, and `whoami`."""
from __future__ import annotations

import webbrowser
from collections import Counter
from typing import Optional

import typer

from ravnest.client.typer_app import (app, call, duration, err, keys, listed_page, nodes, out, say, show, table, tokens,
                                      when)

def show_credentials(rows: list[dict], with_role: bool) -> None:
    table_ = table("id", "name", *(["role"] if with_role else ["uses left", "used"]), "created", "expires", "revoked")
    for row in rows:
        usage = [row["role"] or ""] if with_role else [
            "unlimited" if row["uses_left"] is None else str(row["uses_left"]), str(row["used"])]
        table_.add_row(row["id"], row["name"], *usage, when(row["created_at"]), when(row["expires_at"]) or "never",
                       when(row["revoked_at"]))
    show(table_, spare=("created", "role", "used"))


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
    say(f"{me['role']} key {me['name'] or me['id']} at {ctx.obj.url}" + ("" if me["may_submit"] else " (reads only)"))


@app.command()
def dashboard(ctx: typer.Context, open_it: bool = typer.Option(False, "--open", metavar="",
                                                               help="open it in your browser too")) -> None:
    """A link that opens the dashboard once, logged in with your key, for a minute. The key is never in
    it, so it is safe in a terminal's scrollback or a browser's history."""
    link = call(ctx, "POST", "/v1/dashboard-link")
    url = f"{ctx.obj.url}{link['path']}"
    out.print(url, highlight=False, soft_wrap=True)
    err.print(f"(one use, within {link['expires_in_s']:.0f} s)", highlight=False)
    if open_it:
        webbrowser.open(url)


# an offer's state (coordinator/service/offers.py) in words
OFFER_STATES = {"first": "the first to offer this file: the one others are checked against",
                "challenged": "being checked against the first holder's copy"}


@nodes.command("list")
def node_list(ctx: typer.Context,
              limit: int = typer.Option(100, min=1, max=1000, help="show at most this many, oldest first"),
              state: Optional[str] = typer.Option(None, help="only nodes that are idle, busy or gone"),
              name: Optional[str] = typer.Option(None, help="only nodes whose name holds this text")) -> None:
    """Nodes that joined, their state and what they offer."""
    if state not in (None, "idle", "busy", "gone"):
        raise typer.BadParameter(f"{state!r}: a node is idle, busy or gone", param_hint="--state")
    nodes_ = table("id", "name", "address", "state", "GFLOP/s", "GiB+idle", "job")
    notes = []
    listed, cut = listed_page(ctx, "/v1/nodes", "--limit, --state, --name", limit=limit, state=state, name=name)
    names = {node["id"]: node["name"] or node["id"] for node in listed}
    named = Counter(node["name"] for node in listed if node["name"])
    for node in listed:
        state = "quarantined" if node.get("quarantined_until") else node["state"]
        claimed = node.get("measured_flops") or node["profile"]["flops"]
        flops = claimed / (node.get("slowdown") or 1.0)  # what the planner counts
        idle = node["profile"].get("idle_bytes", 0) / 2**30
        nodes_.add_row(node["id"], node["name"], node["address"], state, f"{flops / 1e9:,.1f}",
                       f"{node['profile']['memory_bytes'] / 2**30:.1f}" + (f"+{idle:.1f}" if idle else ""),
                       node["job_id"] or "")
        # (two rows of one name, a node that restarted as a new one: each line says which row it is)
        who = node["name"] if node["name"] and named[node["name"]] == 1 else \
            f"{node['name']} ({node['id']})" if node["name"] else node["id"]
        if node.get("accused_by"):
            accusers = node["accused_by"]
            notes.append(f"{who} sent values that {', '.join(names.get(i, i) for i in accusers)} refused"
                         + (" (one node's word: a second accuser would convict it)" if len(accusers) == 1 else ""))
        if node.get("measured_flops"):
            notes.append(f"{who} was too slow for its profile's {node['profile']['flops'] / 1e9:,.1f} GFLOP/s: "
                         f"its stages computed like {node['measured_flops'] / 1e9:,.1f}")
        if node.get("measured_bandwidth"):
            notes.append(f"{who}'s links measured at most {node['measured_bandwidth'] / 1e6:,.1f} MB/s, far below "
                         f"the {node['profile']['bandwidth_bytes_per_s'] / 1e6:,.1f} it claims: planned at that")
        if (node.get("slowdown") or 1.0) >= 1.5:
            notes.append(f"{who} computes like {flops / 1e9:,.1f} GFLOP/s in its recent jobs' stages "
                         f"(its profile: {node['profile']['flops'] / 1e9:,.1f})")
        if node.get("reachable") is False:
            notes.append(f"{who} cannot be dialled by its peers: {node['reachability']}")
        elif node.get("relayed_by"):
            relay = "the coordinator's" if node["relayed_by"] == "coordinator" else \
                f"{names.get(node['relayed_by'], node['relayed_by'])}'s"
            notes.append(f"{who} is reached through {relay} relay (peers cannot dial it directly)")
        if node.get("relay_port"):
            notes.append(f"{who} relays for nodes that peers cannot dial, on port {node['relay_port']}")
        offers = ", ".join(f"{name} ({OFFER_STATES.get(state, state)})"
                           for name, state in sorted(node.get("offers", {}).items()))
        if offers:
            notes.append(f"{who} offers {offers}")
        if node.get("note"):
            notes.append(f"{who}: {node['note']}")
    show(nodes_, spare=("address", "job", "GiB+idle"))
    for note in filter(None, [cut, *notes]):  # below the table: a reason is a sentence, too wide for a column
        say(note)


@nodes.command("revoke")
def node_revoke(ctx: typer.Context, node_id: str) -> None:
    """The node's credential stops working at once; a job it held is re-planned without it."""
    call(ctx, "POST", f"/v1/nodes/{node_id}/revoke")
    err.print(f"node {node_id} revoked", highlight=False)
