"""How long a node waits, in one place, each with why it is that long. (The coordinator's rules on
silence, slowness and retries are its settings: coordinator/config.py, coordinator/failure_policy.py.)

    PEER_SILENCE_S = 300       a stage waits this long for a neighbour's next message, and an
                               averaging round for a peer's next chunk: the first micro-batch of a
                               large model over a slow link, or a neighbour's evaluation pass, can
                               take minutes. A dead peer is noticed far sooner, by the keepalive.
    KEEPALIVE_S = 20           gRPC pings between peers, answered within KEEPALIVE_TIMEOUT_S = 10:
                               a peer that stops answering (a pulled cable, a frozen machine) is
                               dropped within 30 s, also between calls.
    FAILED_FLUSH_S = 5         a failed averaging round waits this long for its queued sends, then
                               drops them: the round is lost anyway.
    COORDINATOR_RETRY_S = 300  a node retries an unreachable coordinator with backoff this long, so
                               a coordinator restart mid-job loses nothing.
    LINK_PROBE_S = 10          one link measurement to a peer, asked for while the node is idle.
    LINK_RESUME_S = 10         a pipeline stream whose connection broke is dialled again this long
                               (what was sent and may be lost goes again on the new stream) before
                               the neighbour counts as lost: a Wi-Fi hiccup or a restarted router
                               costs the job those seconds, not a re-plan.
"""
PEER_SILENCE_S = 300.0
KEEPALIVE_S = 20.0
KEEPALIVE_TIMEOUT_S = 10.0
FAILED_FLUSH_S = 5.0
COORDINATOR_RETRY_S = 300.0
LINK_PROBE_S = 10.0
LINK_RESUME_S = 10.0
