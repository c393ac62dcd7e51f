"""schemathesis against the server's own OpenAPI schema: no 5xx, no schema violations."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.live import serving


@pytest.fixture(scope="module")
def fuzzed(tiny_model_dir):
    # Short generations: the point is the HTTP surface, not the model.
    with serving(
        str(tiny_model_dir), served_model_name="tiny", default_max_tokens=4, max_tokens_cap=8
    ) as live:
        yield live


@pytest.fixture(scope="module")
def api_schema(fuzzed):
    return schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_operation_conforms(case):
    case.call_and_validate(
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ]
    )
