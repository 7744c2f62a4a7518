"""The real-pair tier: the default GGUF pair, loaded once for the whole tier."""
import pytest


@pytest.fixture(scope="session")
def real_engine():
    from specdec.backends.llama_cpp import LlamaCppBackend
    from specdec.engine.engine import Engine
    from specdec.models.pull import verify_cached
    from specdec.models.registry import DRAFT, TARGET, default_path

    for spec in (TARGET, DRAFT):
        verify_cached(default_path(spec), spec)
    # Four slots, so that the server test can run concurrent sequences on the same models.
    target = LlamaCppBackend(default_path(TARGET), n_ctx=4096, max_sequences=4)
    draft = LlamaCppBackend(default_path(DRAFT), n_ctx=4096, max_sequences=4)
    engine = Engine(target, draft, n_slots=4)
    yield engine
    engine.close()


def pytest_collection_modifyitems(items):
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.real_models)
