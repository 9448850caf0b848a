"""The REST API fuzzed from its own OpenAPI document (schemathesis, every check): whatever a client
sends that the document allows, or almost allows, gets no 5xx and an answer the document describes.
Bounded: a fixed number of generated cases per operation."""
from __future__ import annotations

import tempfile

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig
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
