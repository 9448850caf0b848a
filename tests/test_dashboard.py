"""The users' view of a running job, from outside: Prometheus scrapes of the coordinator and of a node,
and the dashboard in a real browser (Debian's Chromium driven by Playwright; nothing downloaded)."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from scripts.local_cluster import LocalCluster
from tests.test_faults import cnn_job, wait_progress

pytestmark = pytest.mark.slow
# the README's picture, taken again only when asked (RAVNEST_SCREENSHOT=1): a test run leaves the checkout as it was
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "dashboard.png"


def samples(text: str) -> dict[str, list]:
    """name -> [(labels, value)] of a Prometheus text exposition (which must parse)."""
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def node_metrics_url(cluster: LocalCluster, index: int) -> str:
    log = cluster.data_dir / "logs" / f"node-{index}.log"
    found = cluster.wait_for(lambda: re.search(r"metrics at (http://\S+)", log.read_text()), 30,
                             f"node {index} to say where its metrics are")
    return found.group(1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One coordinator and four nodes (serving metrics) for both tests; each starts on idle nodes."""
    import argparse
    offers = ["--metrics-port", "0", "--dataset", f"argparse={argparse.__file__}"]  # (a text for a language model)
    with LocalCluster(tmp_path_factory.mktemp("dashboard"), nodes=4, node_args=offers) as cluster:
        yield cluster


def idle(cluster: LocalCluster) -> None:
    cluster.wait_for(lambda: sum(n["state"] == "idle" for n in cluster.alive_nodes()) == 4, 60, "4 idle nodes")


def test_prometheus_scrapes_of_the_coordinator_and_a_node_during_a_job(cluster):
    idle(cluster)
    assert httpx.get(f"{cluster.url}/metrics").status_code == 401  # an API key, like every view
    job_id = cluster.submit(cnn_job(steps=3000, clusters=2, stages_per_cluster=2, min_nodes=4))
    wait_progress(cluster, job_id, 0.05)

    def averaged():  # every stage reported at least one averaging round
        found = samples(cluster.http.get("/metrics").text)
        rounds = [v for labels, v in found.get("ravnest_stage_avg_rounds", []) if labels["job"] == job_id]
        return found if len(rounds) == 4 and min(rounds) > 0 else None
    coordinator = cluster.wait_for(averaged, 120, "every stage to report an averaging round")
    assert dict(((labels["state"], v) for labels, v in coordinator["ravnest_nodes"]))["busy"] == 4
    assert dict(((labels["state"], v) for labels, v in coordinator["ravnest_jobs"]))["running"] == 1
    for name in ("ravnest_job_samples_per_s", "ravnest_job_loss", "ravnest_job_progress_ratio",
                 "ravnest_job_step_s", "ravnest_job_utilization", "ravnest_job_averaging_round_s"):
        [(labels, value)] = coordinator[name]
        assert labels == {"job": job_id} and value > 0, name
    for name in ("ravnest_stage_utilization", "ravnest_stage_samples_per_s", "ravnest_stage_step_s",
                 "ravnest_stage_avg_round_s", "ravnest_stage_memory_peak_bytes"):
        assert len(coordinator[name]) == 4 and all(v > 0 for _, v in coordinator[name]), name
    assert coordinator["process_resident_memory_bytes"][0][1] > 0

    node = samples(httpx.get(node_metrics_url(cluster, 0)).text)
    assert [labels["job"] for labels, _ in node["ravnest_stage_step"]] == [job_id]
    for name in ("ravnest_stage_step", "ravnest_stage_samples_per_s", "ravnest_stage_utilization",
                 "ravnest_stage_avg_round_s", "ravnest_peer_sent_bytes_total",
                 "ravnest_peer_received_bytes_total", "process_resident_memory_bytes"):
        assert sum(v for _, v in node[name]) > 0, name
    assert "ravnest_stage_in_flight" in node and "ravnest_stage_staleness" in node
    cluster.http.post(f"/v1/jobs/{job_id}/cancel")
    cluster.wait_job(job_id, timeout=120)

    def forgotten():  # a stage's series go away with its job
        return "ravnest_stage_step" not in samples(httpx.get(node_metrics_url(cluster, 0)).text)
    cluster.wait_for(forgotten, 60, "the node to drop the ended job's series")


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium)")
    return found


def test_the_dashboard_in_a_browser_shows_nodes_pipelines_and_a_growing_loss_curve(cluster, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    executable = chromium()
    idle(cluster)
    spec = cnn_job(steps=3000, clusters=2, stages_per_cluster=2, min_nodes=4)
    spec["training"]["eval_every"] = 100
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(f"{cluster.url}/")
            assert page.url.endswith("/login")  # nobody sees anything without a key
            page.fill("input[name=token]", cluster.operator_token)
            page.click("button")
            page.wait_for_url(f"{cluster.url}/")
            page.wait_for_function("document.querySelectorAll('#nodes tbody tr').length === 4")
            assert page.locator("#nodes tbody").inner_text().count("idle") == 4
            page.fill("#node-search", "NODE-1")  # a search asks the coordinator: found beyond the page too
            page.wait_for_function("document.querySelectorAll('#nodes tbody tr').length === 1")
            assert "node-1" in page.locator("#nodes tbody").inner_text()
            page.fill("#node-search", "")
            page.wait_for_function("document.querySelectorAll('#nodes tbody tr').length === 4")

            page.click("#submit summary")  # submit the job through the page's form
            page.fill("#spec", "{not json")
            page.click("#submit-button")
            page.wait_for_function("document.querySelector('#status').textContent.includes('not JSON')")
            shown = page.locator("#updated").inner_text()  # the error outlives the page's next refresh
            page.wait_for_function(f"document.querySelector('#updated').textContent !== {json.dumps(shown)}")
            assert "not JSON" in page.locator("#status").inner_text()
            page.fill("#spec", json.dumps(spec))
            page.click("#submit-button")
            page.wait_for_function("document.querySelector('#status').textContent.startsWith('submitted job')")
            job_id = page.locator("#status").inner_text().split()[2].rstrip(":")
            wait_progress(cluster, job_id, 0.02)
            page.click("#submit summary")  # fold the form away again
            page.wait_for_function("document.querySelector('#nodes tbody').innerText.split('busy').length === 5")
            page.wait_for_function("document.querySelectorAll('#pipelines g.stage').length === 4")
            rings = cluster.job(job_id)["plan"]["rings"]  # a ring per segment (clusters may cut differently)
            assert page.locator("#pipelines line.ring").count() == len(rings) >= 2  # each joins 2 clusters
            assert "blocks [0," in page.locator("#pipelines").inner_html()
            page.wait_for_function(  # every stage's box: the share of time computing and waiting, its staleness
                "[...document.querySelectorAll('#pipelines text.staleness')]"
                ".filter((t) => /^staleness \\d+\\.\\d\\d steps$/.test(t.textContent)).length === 4")
            shares = page.locator("#pipelines text.utilization").all_text_contents()
            assert len(shares) == 4
            assert all(re.fullmatch(r"utilization \d\.\d\d · bubble \d\.\d\d", t) for t in shares), shares
            page.wait_for_function(  # each cluster's one link: its codec, and how busy stage 0 keeps it
                "[...document.querySelectorAll('#pipelines g.link text.busy')]"
                ".filter((t) => /^\\d+% busy$/.test(t.textContent)).length === 2")
            assert page.locator("#pipelines g.link").first.inner_html().count("fp32") == 1
            priced = page.locator("#pipelines g.link text.priced").all_text_contents()  # what the plan priced
            assert len(priced) == 2 and all(re.fullmatch(r"\d+\.\d MB/s · \d+ ms", t) for t in priced), priced
            page.wait_for_function("document.querySelector('#loss-chart polyline.series')")
            first = int(page.locator("#loss-chart polyline.series").first.get_attribute("data-points"))
            page.wait_for_function(  # the curve grows from the job's server-sent events, no reload
                f"Number(document.querySelector('#loss-chart polyline.series').dataset.points) > {first}",
                timeout=60_000)
            page.wait_for_function("Number((document.querySelector('#accuracy-chart polyline.series') || "
                                   "{dataset: {points: 0}}).dataset.points) >= 4", timeout=120_000)
            page.screenshot(path=str(SCREENSHOT if os.environ.get("RAVNEST_SCREENSHOT") else tmp_path / "dashboard.png"),
                            full_page=True)

            page.once("dialog", lambda dialog: dialog.accept())
            page.click(f"#jobs tr[data-job='{job_id}'] button")  # cancel, as an operator may
            page.wait_for_function(f"document.querySelector(\"#jobs tr[data-job='{job_id}']\")"
                                   ".innerText.includes('cancelled')", timeout=60_000)
            assert cluster.job(job_id)["state"] == "cancelled"
            assert page.locator(f"#jobs tr[data-job='{job_id}'] button").inner_text() == "resume"

            reader = cluster.http.post("/v1/keys", json={"role": "reader", "name": "viewer"}).json()["token"]
            page.goto(f"{cluster.url}/logout")
            page.fill("input[name=token]", reader)
            page.click("button")
            page.wait_for_function("document.querySelector('#who').textContent === 'signed in as reader (viewer)'")
            page.wait_for_function(f"document.querySelector(\"#jobs tr[data-job='{job_id}']\")")
            assert page.locator("#submit").is_hidden()  # a reader sees everything and changes nothing
            assert page.locator("#jobs button").count() == 0
        finally:
            browser.close()


def test_a_language_models_dashboard_shows_its_tokens_per_second_and_held_out_perplexity(cluster):
    """For a language model the page adds what its users watch: tokens/s, and the held-out
    perplexity as a figure and as a curve (the exp of the test loss each evaluation reports)."""
    playwright = pytest.importorskip("playwright.sync_api")
    executable = chromium()
    idle(cluster)
    spec = {"model": {"name": "gpt", "config": {"n_layers": 2, "seq_len": 32, "d_model": 64}},
            "dataset": {"name": "text", "source": "argparse", "seq_len": 32, "test_fraction": 0.05},
            "training": {"steps": 400, "batch_size": 16, "eval_every": 40},
            "averaging": {"strategy": "none"}, "placement": {"clusters": 1, "stages_per_cluster": 2}}
    job_id = cluster.submit(spec)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(f"{cluster.url}/login")
            page.fill("input[name=token]", cluster.operator_token)
            page.click("button")
            page.goto(f"{cluster.url}/#{job_id}")
            page.wait_for_function("Number((document.querySelector('#perplexity-chart polyline.series') || "
                                   "{dataset: {points: 0}}).dataset.points) >= 2", timeout=120_000)
            assert page.locator("#perplexity").is_visible()
            figures = page.locator("#job-figures").inner_text()
            perplexity = float(re.search(r"held-out perplexity ([0-9.]+)", figures).group(1))
            tokens = float(re.search(r"tokens/s ([0-9,]+)", figures).group(1).replace(",", ""))
            view = cluster.job(job_id)
            assert tokens > 0 and view["metrics"]["tokens_per_s"] > 0
            assert 1 < perplexity < 256  # below guessing among the text's bytes
            shown = [float(t) for t in page.locator("#perplexity-chart text").all_text_contents()[:2]]
            assert all(1 < value < 256 for value in shown), shown  # the axis is perplexity, not loss
        finally:
            browser.close()
            cluster.http.post(f"/v1/jobs/{job_id}/cancel")
