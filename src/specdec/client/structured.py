"""Whether a structured output is what its `response_format` asked for (client side, jsonschema).

The schema comes from a request line, so checking it reaches nothing outside it: a `$ref` resolves
inside the schema (and the JSON Schema metaschemas jsonschema ships), never from the network or a
file. A `pattern` is read with the `regex` package where it is installed (it reads `\\p{L}` and the
like, which the server's grammar engine takes and Python's `re` does not), each search bounded in
time. A schema that cannot be checked (a ref outside it, a pattern that cannot be read, any other
failure of the validator) makes the output invalid, with the reason; it never raises.
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any, Optional

try:
    import regex as _regex
except ImportError:  # not a dependency: `re` then reads the patterns it can
    _regex = None

_PATTERN_ERRORS = (re.error,) if _regex is None else (re.error, _regex.error)
PATTERN_TIMEOUT = 1.0  # seconds per pattern search (regex only: `re` has no limit)
MAX_REASON = 200  # characters of a reason


def schema_valid(text: Optional[str], response_format: Optional[dict]) -> Optional[bool]:
    """True/False for a json_object or json_schema request (the text parses and, with a schema,
    validates); None when the request asked for no structure."""
    return check_output(text, response_format)[0]


def check_output(text: Optional[str], response_format: Optional[dict]) -> tuple[Optional[bool], Optional[str]]:
    """(`schema_valid`, why the schema could not be checked, else None). Example: a schema of
    {"$ref": "https://example.com/s.json"} gives (False, "$ref 'https://example.com/s.json' is not
    in the schema (remote and file references are not followed)")."""
    if not isinstance(response_format, dict) or response_format.get("type") not in ("json_object", "json_schema"):
        return None, None
    try:
        value = json.loads(text or "")
    except (ValueError, RecursionError):
        return False, None
    schema = (response_format.get("json_schema") or {}).get("schema")
    if response_format["type"] == "json_object" or schema is None:
        return isinstance(value, dict), None
    from referencing.exceptions import Unresolvable

    try:
        return _validator_class()(schema, registry=_local_registry()).is_valid(value), None
    except _PATTERN_ERRORS as exc:
        return False, _one_line(f"a pattern in the schema cannot be read ({exc})")
    except Unresolvable as exc:
        return False, _one_line(f"$ref {getattr(exc, 'ref', '?')!r} is not in the schema "
                                "(remote and file references are not followed)")
    except Exception as exc:  # a bad pattern, a bad schema, deep recursion: this line's verdict, not the run's
        return False, _one_line(f"the schema cannot be checked ({exc.__class__.__name__}: {exc})")


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_REASON else text[:MAX_REASON - 3] + "..."


def _refuse(uri: str) -> Any:
    from referencing.exceptions import NoSuchResource

    raise NoSuchResource(ref=uri)


@functools.lru_cache(maxsize=1)
def _local_registry() -> Any:
    """A registry that retrieves nothing: only the schema's own resources resolve."""
    import referencing

    return referencing.Registry(retrieve=_refuse)  # type: ignore[call-arg]


def _search(pattern: str, text: str) -> bool:
    if _regex is None:
        return re.search(pattern, text) is not None
    return _regex.search(pattern, text, timeout=PATTERN_TIMEOUT) is not None


@functools.lru_cache(maxsize=1)
def _validator_class() -> Any:
    """Draft 2020-12 with the keywords that read patterns reading them through `_search`."""
    import jsonschema
    from jsonschema.exceptions import ValidationError

    def pattern(validator, patrn, instance, schema):
        if validator.is_type(instance, "string") and not _search(patrn, instance):
            yield ValidationError(f"{instance!r} does not match {patrn!r}")

    def pattern_properties(validator, patterns, instance, schema):
        if validator.is_type(instance, "object"):
            for patrn, subschema in patterns.items():
                for key, item in instance.items():
                    if _search(patrn, key):
                        yield from validator.descend(item, subschema, path=key, schema_path=patrn)

    def additional_properties(validator, additional, instance, schema):
        if not validator.is_type(instance, "object"):
            return
        known, patterns = schema.get("properties", {}), list(schema.get("patternProperties", {}))
        extras = [k for k in instance if k not in known and not any(_search(p, k) for p in patterns)]
        if validator.is_type(additional, "object"):
            for extra in extras:
                yield from validator.descend(instance[extra], additional, path=extra)
        elif not additional and extras:
            yield ValidationError(f"additional properties are not allowed ({', '.join(map(repr, sorted(extras)))})")

    return jsonschema.validators.extend(jsonschema.Draft202012Validator, {
        "pattern": pattern, "patternProperties": pattern_properties, "additionalProperties": additional_properties})
