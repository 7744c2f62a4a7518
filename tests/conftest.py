import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# Every real-pair test gets a time limit, so that a hang fails CI in minutes, with the traceback of
# every thread, rather than at CI's own limit. "thread": pytest-timeout's method that works even
# while the main thread is stuck inside a C call (llama.cpp); it ends the run. A test may set its
# own limit with @pytest.mark.timeout.
INTEGRATION_TIMEOUT_SECONDS = 600


def pytest_collection_modifyitems(items):
    for item in items:
        if "integration" in item.path.parts and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(INTEGRATION_TIMEOUT_SECONDS, method="thread"))
