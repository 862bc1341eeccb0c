"""Schemathesis against the served OpenAPI schema: generated good and bad input never yields a 5xx.

The app runs in-process (ASGI) over a real single-rank CPU ParameterServer, so every route's
handler, validation and error mapping is exercised. Generated input registers nothing (random
paths do not exist), but may load metas and look checkpoints up by any name. Hypothesis drives
schemathesis's strategies directly (its pytest plugin does not load under pytest 9).
"""

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

from support.ports import free_port  # noqa: E402
from ckpt_core import ParameterServer  # noqa: E402
from ckpt_core.service import create_app  # noqa: E402

OPERATIONS = [("POST", "/v1/checkpoints/{name}/files"), ("DELETE", "/v1/checkpoints/{name}"),
              ("POST", "/v1/checkpoints/{name}/gather-metas"), ("POST", "/v1/checkpoints/{name}/update"),
              ("GET", "/v1/healthz"), ("GET", "/v1/metas"), ("POST", "/v1/metas"), ("GET", "/v1/status"),
              ("POST", "/v1/commit"),
              ("GET", "/metrics")]


@pytest.fixture(scope="module")
def schema():
    ps = ParameterServer(0, 1, device="cpu", master_addr="127.0.0.1", master_port=free_port())
    app = create_app(ps)
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    app.state.service.close()
    ps.close()


def test_the_schema_has_exactly_the_documented_operations(schema):
    ops = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert ops == set(OPERATIONS)


# Negative input exists only where there are typed fields (a path string accepts anything).
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS
    if (m, p) in {("POST", "/v1/checkpoints/{name}/files"), ("DELETE", "/v1/checkpoints/{name}"),
                  ("POST", "/v1/checkpoints/{name}/update"), ("POST", "/v1/metas")}]


@pytest.mark.slow
@pytest.mark.parametrize("method, path, mode", CASES)
def test_generated_requests_never_get_a_server_error(schema, method, path, mode):
    seen = []

    @settings(max_examples=30, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=schema[path][method].as_strategy(generation_mode=mode))
    def run(case):
        resp = case.call()
        seen.append(resp.status_code)
        assert resp.status_code < 500, (case.path_parameters, case.query, case.body, resp.status_code, resp.text[:500])

    run()
    assert seen, "hypothesis generated no request"
