"""Volunteers behind NAT (scripts/testbed.py with NAT routers): each natted node sits behind a router
of its own that masquerades it and forwards no new inbound connection, and the node itself drops any.
The coordinator finds them unreachable by dialling back, they listen on its relay, and the README's
digits CNN (2 clusters x 2 stages) trains across direct and relayed links to the accuracy it reaches
anywhere. Runs as root, like the shaped testbed; the namespaces (and so every rule) go at the end."""
from __future__ import annotations

import json
import subprocess
from urllib.parse import urlparse

import pytest

from scripts.testbed import ShapedTestbed, unavailable
from tests.test_faults import CNN_JOB
from tests.test_relay import direct_where_one_side_can_be_dialled

pytestmark = [pytest.mark.slow, pytest.mark.skipif(unavailable(nat=True) is not None,
                                                   reason=str(unavailable(nat=True)))]
RATE = 100  # Mbit/s, every host alike: what differs is who can be dialled


def namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith("rvn-")]


@pytest.mark.parametrize("natted", [(1, 3), (1, 2, 3)], ids=["2-of-4-natted", "all-but-one-natted"])
def test_natted_volunteers_train_through_the_coordinators_relay(tmp_path, natted):
    with ShapedTestbed(tmp_path, [RATE] * 4, natted=natted) as testbed:
        relay_host = urlparse(testbed.url).hostname

        def relayed_nodes() -> dict[str, str]:
            """name -> address of the nodes peers reach through the relay, once every node is reachable"""
            nodes = testbed.alive_nodes()
            if len(nodes) < 4 or not all(n["reachable"] for n in nodes):
                return {}
            return {n["name"]: n["address"] for n in nodes if n["address"].startswith(f"{relay_host}:")}
        testbed.wait_for(lambda: len(relayed_nodes()) == len(natted), 60, "natted nodes reachable through the relay")
        relayed = relayed_nodes()
        assert sorted(relayed) == [f"node-{i}" for i in natted]
        for node in testbed.alive_nodes():
            if node["name"] in relayed:
                # dialled through the relay: by the coordinator, or by a peer's probe
                assert node["address"] in node["reachability"] and "could not" not in node["reachability"], node
        log = (tmp_path / "logs" / "node-1.log").read_text()
        assert "peers cannot dial this node at 192.168.1.2:" in log and "peers reach this node at" in log, log

        spec = json.loads(CNN_JOB.read_text())
        spec["training"]["eval_every"] = 0
        job = testbed.wait_job(testbed.submit(spec), timeout=900)
        assert job["state"] == "completed", job["reason"]
        placed = {s["node_id"] for c in job["plan"]["clusters"] for s in c["stages"]}
        assert len(job["plan"]["clusters"]) == 2 and len(placed) == 4  # natted nodes trained too
        assert job["metrics"]["test_accuracy"] >= 0.95, job["metrics"]
        nodes = testbed.alive_nodes()
        # who is hidden was settled before the job: a re-probe running now must not empty the set
        hidden = {n["id"] for n in nodes if n["name"] in relayed}
        # a natted node's link to a peer that can be dialled runs over the connection it opened, no relay hop
        assert direct_where_one_side_can_be_dialled(job, hidden, tmp_path / "logs", nodes) >= 1
    assert namespaces() == []  # the routers, their NAT rules and the hosts are gone
