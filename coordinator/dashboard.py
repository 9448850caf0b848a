"""A one-page HTML view of nodes and jobs (read-only, no scripts), served at /."""
from __future__ import annotations

from html import escape

from .schemas import JobSummary, NodeView


def _table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_dashboard(nodes: list[NodeView], jobs: list[JobSummary]) -> str:
    node_rows = [[n.id, n.name, n.address, n.state, f"{n.profile.flops / 1e9:.1f}",
                  f"{n.profile.memory_bytes / 2**30:.1f}", f"{n.profile.bandwidth_bytes_per_s / 1e6:.1f}",
                  n.job_id or "", "" if n.cluster is None else f"{n.cluster}/{n.stage}"] for n in nodes]
    job_rows = [[j.id, j.name, j.model, j.state, j.reason] for j in jobs]
    return ("<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='5'>"
            "<title>Ravnest coordinator</title><style>body{font-family:sans-serif}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:2px 6px}</style></head><body><h1>Ravnest coordinator</h1>"
            f"<h2>Jobs ({len(jobs)})</h2>"
            + _table(["id", "name", "model", "state", "reason"], job_rows)
            + f"<h2>Nodes ({len(nodes)})</h2>"
            + _table(["id", "name", "address", "state", "GFLOP/s", "GiB", "MB/s", "job", "cluster/stage"], node_rows)
            + "<p>API: <a href='/docs'>/docs</a></p></body></html>")


def render_login(error: str = "") -> str:
    message = f"<p style='color:#b00'>{escape(error)}</p>" if error else ""
    return ("<!doctype html><html><head><meta charset='utf-8'><title>Ravnest coordinator: log in</title></head>"
            "<body style='font-family:sans-serif'><h1>Ravnest coordinator</h1>" + message +
            "<form method='post' action='/login'><label>API key "
            "<input type='password' name='token' autocomplete='current-password' autofocus></label> "
            "<button>Log in</button></form><p>Any API key works (an operator's, a submitter's, a reader's). The "
            "operator's is in the coordinator's data directory (<code>operator_token</code>); the coordinator's "
            "log says where.</p></body></html>")
