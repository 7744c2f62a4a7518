"""Whether a structured output is what its `response_format` asked for (client side, jsonschema)."""
from __future__ import annotations

import json
from typing import Optional


def schema_valid(text: Optional[str], response_format: Optional[dict]) -> Optional[bool]:
    """True/False for a json_object or json_schema request (the text parses and, with a schema,
    validates); None when the request asked for no structure."""
    if not isinstance(response_format, dict) or response_format.get("type") not in ("json_object", "json_schema"):
        return None
    try:
        value = json.loads(text or "")
    except (ValueError, RecursionError):
        return False
    schema = (response_format.get("json_schema") or {}).get("schema")
    if response_format["type"] == "json_object" or schema is None:
        return isinstance(value, dict)
    import jsonschema

    try:
        return jsonschema.Draft202012Validator(schema).is_valid(value)
    except jsonschema.SchemaError:
        return False
