"""Reading a Prometheus exposition in tests: parsed with prometheus_client's own parser, so that
a malformed text fails the test."""
from prometheus_client.parser import text_string_to_metric_families

from specdec.deploy.metrics import REPLICA_LABEL


def families_of(text: str) -> dict:
    """Family name -> family; fails if a family is written twice (Prometheus rejects that)."""
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), "a family written twice"
    return {f.name: f for f in families}


def by_replica(families: dict, family: str, sample: str, **labels) -> dict:
    """Replica id -> the value of `sample` (with `labels`, among others) in `family`."""
    if family not in families:
        return {}
    return {s.labels[REPLICA_LABEL]: s.value for s in families[family].samples
            if s.name == sample and labels.items() <= s.labels.items()}


def replicas_of(families: dict) -> set:
    """Every replica id with a sample in the exposition."""
    return {s.labels[REPLICA_LABEL] for f in families.values() for s in f.samples}
