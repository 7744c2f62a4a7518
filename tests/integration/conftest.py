"""The real-pair tier: the default GGUF pair, loaded once per backend for the whole tier.

The default configuration (SPECDEC_TEST_BACKEND, else what the machine profile chooses where
scripts/install.sh's patched ik_llama.cpp is installed: its weights repacked, else the first
installed backend of the registry's DEFAULT_ORDER) runs every test; the other installed
llama.cpp-family configurations run a sample (tests that take `each_engine` or `sampled_engine`),
each loaded once for the session.
"""
import os

import pytest

from specdec.backends.registry import BackendConfig, ModelConfig, backend_entry

# Backend configurations by label: ik_llama.cpp with its weights as stored and repacked, mainline.
LLAMA_FAMILY = ("ik_llama.cpp", "ik_llama.cpp:repacked", "llama.cpp")


def default_label() -> str:
    """The configuration `make serve` uses without a measured profile (runtime.default_config)."""
    from specdec.runtime import default_config

    return default_config().label


DEFAULT_BACKEND = os.environ.get("SPECDEC_TEST_BACKEND") or default_label()
SAMPLED_BACKENDS = [label for label in LLAMA_FAMILY
                    if label != DEFAULT_BACKEND and backend_entry(BackendConfig.parse(label).backend).installed()]


def load_real_engine(backend: str):
    """The default pair on `backend`, exact, with four slots (the server tests run concurrent sequences)."""
    from specdec.models.pull import verify_cached
    from specdec.models.registry import DRAFT, TARGET, default_path
    from specdec.runtime import load_engine

    for spec in (TARGET, DRAFT):
        verify_cached(default_path(spec), spec)
    return load_engine(ModelConfig(BackendConfig.parse(backend), ctx_size=4096), n_slots=4)


@pytest.fixture(scope="session")
def engines():
    """Engines by backend name, each loaded on first use and kept for the session."""
    loaded = {}

    def get(backend: str):
        if backend not in loaded:
            loaded[backend] = load_real_engine(backend)
        return loaded[backend]

    yield get
    for engine in loaded.values():
        engine.close()


@pytest.fixture(scope="session")
def real_engine(engines):
    return engines(DEFAULT_BACKEND)


@pytest.fixture(params=SAMPLED_BACKENDS)
def sampled_engine(request, engines):
    return engines(request.param)


@pytest.fixture(params=[DEFAULT_BACKEND, *SAMPLED_BACKENDS])
def each_backend(request):
    """The default backend's name, then each sampled backend's (for tests that load their own)."""
    return request.param


@pytest.fixture(params=[DEFAULT_BACKEND, *SAMPLED_BACKENDS])
def each_engine(request, engines):
    """The default backend's engine, then each sampled backend's."""
    engine = engines(request.param)
    config = BackendConfig.parse(request.param)
    assert (engine.target.name, engine.target.describe().get("repacked", False)) == (config.backend, config.repacked)
    return engine


def pytest_collection_modifyitems(items):
    for item in items:
        if "integration" in str(item.fspath):
            item.add_marker(pytest.mark.real_models)


@pytest.fixture
def provisional_engine():
    """The default pair on ik_llama.cpp with its weights as stored, as a server on PyPI's wheel runs
    it: an engine of the test's own (a build switch closes it); skipped where that configuration is
    the default or is not installed."""
    if "ik_llama.cpp" == DEFAULT_BACKEND or "ik_llama.cpp" not in SAMPLED_BACKENDS:
        pytest.skip("needs ik_llama.cpp, weights as stored, installed beside the default configuration")
    engine = load_real_engine("ik_llama.cpp")
    yield engine
    engine.close()  # closing twice does nothing
