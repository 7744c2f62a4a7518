"""schemathesis against /openapi.json on a live loopback server (fake backends, small token
limits): whatever it generates, valid or not, the server never answers 5xx."""
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import SpecConfig

MAX_EXAMPLES = 40


@pytest.fixture(scope="module")
def base_url():
    engine = Engine(FakeBackend(seed=7, n_ctx=128), FakeBackend(seed=7, noise=0.6, n_ctx=128), n_slots=2)
    config = ServerConfig(served_model_name="fake", spec=SpecConfig("draft", 3), max_tokens=8, max_queue=16)
    with serve_in_thread(create_app(engine, config)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def api_schema(base_url):
    return schemathesis.openapi.from_url(base_url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.mark.timeout(300)
@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, base_url):
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = "fake"  # reach the generation path (an unknown model is a 404, tested elsewhere)
    case.call_and_validate(base_url=base_url, checks=[not_a_server_error], timeout=30)

