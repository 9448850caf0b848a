"""The REST API fuzzed from its own OpenAPI document (schemathesis, every check): whatever a client
sends that the document allows, or almost allows, gets no 5xx and an answer the document describes.
Bounded: a fixed number of generated cases per operation."""
from __future__ import annotations

import tempfile

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from coordinator.app import create_app
from coordinator.config import Settings

OPERATOR = "rvn_fuzz-operator"
CASES_PER_OPERATION = 30

app = create_app(Settings(data_dir=tempfile.mkdtemp(prefix="ravnest-fuzz-"), background=False,
                          operator_token=OPERATOR))
# A request the document allows may still be refused for what a schema cannot say (a model that needs
# text data, a node-only call made with the operator's key, a job in the wrong state): any 4xx the
# document lists for it, never a 5xx.
CONFIG = SchemathesisConfig.from_str("""
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "403", "404", "409", "422"]
""")
schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=CONFIG)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=CASES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_every_answer_as_documented(case) -> None:
    case.call_and_validate(headers={"Authorization": f"Bearer {OPERATOR}"})


def _a_node_holding_a_stage() -> tuple[str, str, str]:
    """(node id, its token, the job it holds a stage of): what a volunteer's calls are made with."""
    from fastapi.testclient import TestClient

    with TestClient(app, headers={"Authorization": f"Bearer {OPERATOR}"}) as client:
        joined = client.post("/v1/nodes", json={"name": "fuzzed", "address": "127.0.0.1:9", "profile": {
            "flops": 1e10, "memory_bytes": 2**30, "bandwidth_bytes_per_s": 1e8, "latency_s": 0.001}}).json()
        job_id = client.post("/v1/jobs", json={"model": {"name": "mlp"}, "dataset": {"name": "digits"},
                                               "placement": {"clusters": 1, "min_nodes": 1}}).json()["id"]
        client.post(f"/v1/nodes/{joined['node_id']}/heartbeat", json={},
                    headers={"Authorization": f"Bearer {joined['node_token']}"})
    return joined["node_id"], joined["node_token"], job_id


NODE_ID, NODE_TOKEN, JOB_ID = _a_node_holding_a_stage()
NODE_CALLS = schema.include(path_regex=r"^/v1/(nodes/\{node_id\}/heartbeat|jobs/\{job_id\}/(metrics|fail|state))$")


@pytest.mark.slow
@NODE_CALLS.parametrize()
@settings(max_examples=CASES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
def test_a_volunteers_own_calls_with_its_credential_get_no_5xx(case) -> None:
    """The calls a node makes, with a real node credential, on its own id and the job it is in: the
    bodies are the fuzzer's (hostile metrics, failure reports, proofs), the identity is real."""
    for name, value in (("node_id", NODE_ID), ("job_id", JOB_ID)):
        if name in (case.path_parameters or {}):
            case.path_parameters[name] = value
    case.call_and_validate(headers={"Authorization": f"Bearer {NODE_TOKEN}"})
