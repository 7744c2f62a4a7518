"""The default pair at the default context (auto): each model gets what backends/context_size.py
computes from its GGUF header and this machine's memory, mapped onto the libraries' caches."""
from specdec import runtime
from specdec.backends.context_size import kv_shape, machine_memory, plan_context
from specdec.backends.registry import ModelConfig
from specdec.models.pull import verify_cached
from specdec.models.registry import DRAFT, TARGET, default_path

SLOTS = 2  # several slots: ik's shared cache holds n_ctx x slots cells, each sequence its share


def test_the_default_engine_loads_with_the_planned_context(monkeypatch):
    paths = [default_path(TARGET), default_path(DRAFT)]
    for path, spec in zip(paths, (TARGET, DRAFT)):
        verify_cached(path, spec)
    memory = machine_memory()  # one snapshot, for the plan here and the engine's
    monkeypatch.setattr(runtime, "machine_memory", lambda: memory)
    shapes = [kv_shape(path) for path in paths]
    assert [(s.trained, s.bytes_per_token) for s in shapes if s] == [(32768, 28672), (32768, 12288)]
    plan = plan_context(None, slots=SLOTS, shapes=[s for s in shapes if s],
                        weights=sum(path.stat().st_size for path in paths), memory=memory)
    engine = runtime.load_engine(ModelConfig(runtime.backend_config()), n_slots=SLOTS)  # as `make serve`
    try:
        assert plan.per_slot > 4096 or plan.reason == "floor"
        assert engine.model_config is not None and engine.model_config.ctx_size == plan.per_slot
        min_rows = engine.target.describe().get("min_rows", 1)  # a padded call keeps min_rows - 1 cells spare
        assert engine.target.n_ctx == plan.per_slot - (min_rows - 1)
        assert engine.draft is not None and engine.draft.n_ctx == plan.per_slot - (engine.draft.describe()["min_rows"] - 1)
    finally:
        engine.close()
