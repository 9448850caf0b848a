"""The dashboard at /: a page that works without scripts (tables of jobs and nodes, rendered here)
and, with the script that ships beside it (coordinator/static/, nothing from the internet), comes
alive: lists refresh, and the selected job's pipelines are drawn and its curves grow from its
server-sent events (GET /v1/jobs/{id}/events)."""
from __future__ import annotations

from html import escape

from .schemas import JobSummary, NodeView

ASSETS = "/static/dashboard"


def _table(table_id: str, headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table id='{table_id}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def shown_of(count: int, total: int) -> str:
    """The count beside a list's title: "(12)", or "(200 of 219 shown)" where the page is cut (as
    dashboard.js writes it on each refresh)."""
    return f"({count})" if count >= total else f"({count:,} of {total:,} shown)"


def render_dashboard(node_page: tuple[list[NodeView], int], job_page: tuple[list[JobSummary], int]) -> str:
    """The page as its first paint; each list a page (rows, how many in all)."""
    (nodes, node_total), (jobs, job_total) = node_page, job_page
    node_rows = [[n.name or n.id, n.address + (" (unreachable)" if n.reachable is False else
                                               " (relayed)" if n.relayed_by else ""), n.state,
                  f"{(n.measured_flops or n.profile.flops) / (n.slowdown or 1) / 1e9:.1f}",
                  f"{n.profile.memory_bytes / 2**30:.1f}",
                  f"{(n.measured_bandwidth or n.profile.bandwidth_bytes_per_s) / 1e6:.1f}",
                  f"{n.profile.latency_s * 1e3:.0f}",
                  n.job_id or "", "" if n.cluster is None else f"cluster {n.cluster} stage {n.stage}"] for n in nodes]
    job_rows = [[j.id, j.name, j.model, j.state, j.reason, ""] for j in reversed(jobs)]
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>Ravnest coordinator</title>
<link rel="stylesheet" href="{ASSETS}/dashboard.css"></head><body>
<header><h1>Ravnest coordinator</h1><span id="status" role="status"></span>
<nav><span id="updated"></span> <span id="who"></span>
<a href="/docs">API</a> <a href="/metrics">metrics</a> <a href="/logout">log out</a></nav>
</header>
<main>
<section id="job" hidden><h2 id="job-title"></h2><p id="job-state"></p>
<div class="bar"><div id="job-progress"></div></div><p id="job-figures"></p><ul id="job-recoveries"></ul>
<h3>Pipelines</h3><p class="hint">Each row is a cluster: a pipeline whose stages (boxes: the node, the blocks
[first, end) it holds, the share of time it computes (utilization, also the bar) and waits for a neighbour
(bubble), and how many optimizer steps old the weights of its forwards are, on average (staleness)) pass
activations to the right and gradients back. Dashed lines join the stages that average the same blocks
across clusters.</p>
<svg id="pipelines" role="img" preserveAspectRatio="xMinYMin meet"></svg>
<div class="charts"><figure><figcaption>training loss by step</figcaption><svg id="loss-chart"></svg></figure>
<figure><figcaption>test accuracy by step</figcaption><svg id="accuracy-chart"></svg></figure>
<figure id="perplexity" hidden><figcaption>held-out perplexity by step</figcaption><svg id="perplexity-chart"></svg>
</figure></div>
</section>
<section><h2>Jobs <span id="job-count">{shown_of(len(jobs), job_total)}</span></h2>
{_table("jobs", ["id", "name", "model", "state", "reason", ""], job_rows)}
<details id="submit"><summary>Submit a job</summary><p class="hint">A job spec (see docs/jobs.md); a submitter or
operator key may submit.</p><textarea id="spec" rows="14" spellcheck="false"></textarea><br>
<button id="submit-button" type="button">Submit</button></details></section>
<section><h2>Nodes <span id="node-count">{shown_of(len(nodes), node_total)}</span>
<input id="node-search" type="search" placeholder="name holds" aria-label="only nodes whose name holds"></h2>
{_table("nodes", ["name", "address", "state", "GFLOP/s", "memory GiB", "MB/s", "ms", "job", "place"], node_rows)}
</section></main><script src="{ASSETS}/dashboard.js"></script></body></html>"""


def render_login(error: str = "") -> str:
    message = f"<p style='color:#b00'>{escape(error)}</p>" if error else ""
    return ("<!doctype html><html><head><meta charset='utf-8'><title>Ravnest coordinator: log in</title></head>"
            "<body style='font-family:sans-serif'><h1>Ravnest coordinator</h1>" + message +
            "<form method='post' action='/login'><label>API key "
            "<input type='password' name='token' autocomplete='current-password' autofocus></label> "
            "<button>Log in</button></form><p>Any API key works (an operator's, a submitter's, a reader's). The "
            "operator's is in the coordinator's data directory (<code>operator_token</code>); the coordinator's "
            "log says where.</p></body></html>")
