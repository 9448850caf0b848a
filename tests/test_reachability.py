"""Reachability is measured, not assumed (coordinator/service/reachability.py): a real coordinator dials
each joining node back, a real node's link probes report the peers they could not dial, and `ravnest
nodes` and the node's log say so."""
import os
import re
import socket
import subprocess
import sys

from coordinator.dial_rules import DialRules, networks
from ravnest.relay.dial import dial
from scripts.local_cluster import LocalCluster
from tests.test_lying_volunteers import Liar


def test_dial_says_what_happened() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        assert dial(address) == (True, f"connected to {address}")
    assert dial(address, timeout=1) == (False, f"could not connect to {address}: connection refused")
    assert dial("[::1]:notaport")[0] is False


def test_a_coordinator_that_others_reach_dials_no_loopback_unless_allowed() -> None:
    public, alone = DialRules(None, "0.0.0.0", lambda: 0.0), DialRules(None, "127.0.0.1", lambda: 0.0)
    for address in ("127.0.0.1:22", "localhost:22", "[::1]:22", "127.9.9.9:1"):
        assert public.target(address).at is None and "loopback, which from here is the coordinator's own machine" \
            in public.target(address).refused, address
        assert alone.target(address).at is not None, address  # (a cluster on one machine)
    for address in ("0.0.0.0:80", "169.254.169.254:80", "[fe80::1]:80", "224.0.0.1:5"):
        assert public.target(address).at is None and "not an address a peer can dial" in public.target(address).refused
    assert public.target("10.1.2.3:8471").at == ("10.1.2.3", 8471)  # (a private network: as volunteers use)
    assert public.target("no-such-host.invalid:1").refused.startswith("could not resolve no-such-host.invalid:1")
    allowed = DialRules(networks("10.0.0.0/8, 2001:db8::/32"), "127.0.0.1", lambda: 0.0)
    assert allowed.target("10.0.0.7:1").at and allowed.target("[2001:db8::1]:1").at
    assert allowed.target("127.0.0.1:1").refused.endswith("127.0.0.1 is outside --dial-allow 10.0.0.0/8,2001:db8::/32")


def test_a_node_that_cannot_be_dialled_is_found_out_by_the_coordinator_and_by_its_peers(tmp_path) -> None:
    with LocalCluster(tmp_path, nodes=1) as cluster:
        silent = Liar(cluster, "behind-nat", reachable=False)  # nobody listens at its port, as behind a NAT
        [honest] = [n for n in cluster.alive_nodes() if n["id"] != silent.id]

        def views() -> dict[str, dict]:
            return {n["name"]: n for n in cluster.http.get("/v1/nodes").json()}
        cluster.wait_for(lambda: views()["behind-nat"]["reachable"] is False, 30, "the dial-back to fail")
        coordinator_log = tmp_path / "logs" / cluster.coordinator_log
        cluster.wait_for(lambda: f"node {silent.id} is not reachable: the coordinator could not connect to 127.0.0.1:"
                         in coordinator_log.read_text(), 30, "the coordinator to log it")

        def beat_and_answer() -> dict:
            """It answers the probes it is asked for (made-up figures), else its peers would wait to probe
            it in turn, and a claim about a peer it was asked for and never answered would be an answer."""
            reply = silent.beat()
            for asked in reply["probe"]:
                silent.post(f"/v1/nodes/{silent.id}/heartbeat", {
                    "links": [{"peer_id": asked["node_id"], "bandwidth_bytes_per_s": 1e8, "latency_s": 0.001}]})
            return reply
        assert beat_and_answer()["reachable"] is False
        # the real node probes its idle peer's link and reports that it could not dial it
        cluster.wait_for(lambda: beat_and_answer() and views()["behind-nat"]["reachability"].startswith(
            f"node {honest['name']}"), 60, "the peer's probe to report it")  # (it beats: alive, so probed)
        assert views()["behind-nat"]["reachability"].endswith(f"could not dial {views()['behind-nat']['address']}")
        assert views()[honest["name"]]["reachable"] is True
        # what a node says of a peer it was not asked to probe is not believed
        assert silent.post(f"/v1/nodes/{silent.id}/heartbeat", {"unreached": [honest["id"]]}).status_code == 200
        assert views()[honest["name"]]["reachable"] is True
        assert "reachable at" in (tmp_path / "logs" / "node-0.log").read_text()

        env = {**os.environ, "RAVNEST_COORDINATOR": cluster.url, "RAVNEST_KEY": cluster.operator_token,
               "COLUMNS": "100"}
        listed = subprocess.run([sys.executable, "-m", "ravnest.client.cli", "nodes"], capture_output=True,
                                text=True, env=env, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert "behind-nat cannot be dialled by its peers: node" in listed.stdout.replace("\n", " ")
        table = [line for line in listed.stdout.splitlines() if re.match(r"id |[0-9a-f]{16} ", line)]  # (not notes)
        assert max(len(line) for line in table) <= 100
        assert "shown" not in listed.stdout  # the whole list
        # a list cut says so, and how to see the others
        cut = subprocess.run([sys.executable, "-m", "ravnest.client.cli", "nodes", "--limit", "1"],
                             capture_output=True, text=True, env=env, timeout=60)
        assert "1 of 2 shown; --limit, --state, --name" in cut.stdout, cut.stdout + cut.stderr
        named = subprocess.run([sys.executable, "-m", "ravnest.client.cli", "nodes", "--name", "BEHIND"],
                               capture_output=True, text=True, env=env, timeout=60)
        rows = [line for line in named.stdout.splitlines() if re.match(r"[0-9a-f]{16} ", line)]
        assert len(rows) == 1 and "behind-nat" in rows[0] and "shown" not in named.stdout, named.stdout
