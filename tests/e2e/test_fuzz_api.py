"""schemathesis against the server's own OpenAPI schema: no 5xx, no schema violations.

Driven through schemathesis's Python API (one hypothesis run per operation, each a pytest
subtest) rather than its pytest plugin, which breaks with pytest releases it does not yet know.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.live import serving

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def fuzzed(tiny_model_dir):
    # Short generations: the point is the HTTP surface, not the model.
    with serving(
        str(tiny_model_dir), served_model_name="tiny", default_max_tokens=4, max_tokens_cap=8
    ) as live:
        yield live


def fuzz(operation) -> None:
    @given(case=operation.as_strategy())
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        case.call_and_validate(checks=CHECKS)

    run()


def test_every_operation_conforms(fuzzed, subtests):
    schema = schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    # Every route the server has, so a schema that lost its operations cannot pass by fuzzing none.
    assert len(operations) >= 8, [op.label for op in operations]
    for operation in operations:
        with subtests.test(operation.label):
            fuzz(operation)
