"""JSON schemas closed the way vLLM's default backend (xgrammar's strict mode) reads them: JSON
Schema allows properties an object does not list, and a small model fills them with invented
keys until max_tokens.

- `closed` adds `additionalProperties: false` to each object schema that lists `properties` and
  says nothing else about others; it is idempotent.
- Pure Python, no llguidance: the vLLM worker and the frontend close schemas the same way.
"""

from __future__ import annotations

from typing import Any

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SUBSCHEMAS = (
    "additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "items",
    "prefixItems", "additionalItems", "unevaluatedItems",
)  # fmt: skip
CONJUNCTIVE = ("allOf", "then", "else")  # each holds together with the schema it sits in
ALTERNATIVES = ("anyOf", "oneOf")  # so do these, beside properties of the schema's own
# Where one of these is present, the object's properties come from more than its own list.
OPEN_BY = (
    "additionalProperties", "unevaluatedProperties", "patternProperties", "dependentSchemas",
    "allOf", "anyOf", "oneOf", "$ref", "if",
)  # fmt: skip


def closed(schema: Any, merged: bool = False) -> Any:
    """`schema` (parsed JSON, left as it is) with `additionalProperties: false` on each object
    schema that lists `properties` and says nothing else about others.

    - An object whose properties may come from elsewhere (`OPEN_BY`: allOf, anyOf, $ref, ...)
      stays open, and so does a schema that must hold together with another one (`merged`:
      a branch of allOf, then, else or dependentSchemas; of anyOf or oneOf where the schema
      they sit in has properties of its own or is merged itself): closed, they could not be
      merged.
    - Only schema keywords are walked, and not `not` or `if` (closing those would loosen what
      they check): data (enum, const, default, examples) is left alone."""
    if isinstance(schema, list):
        return [closed(item, merged) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = dict(schema)  # the walked keys get new values; the rest is shared, not changed
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            schema[key] = {name: closed(sub) for name, sub in schema[key].items()}
    if isinstance(schema.get("dependentSchemas"), dict):
        schema["dependentSchemas"] = {
            name: closed(sub, merged=True) for name, sub in schema["dependentSchemas"].items()
        }
    own = isinstance(schema.get("properties"), dict)
    for keys, merge in ((SUBSCHEMAS, False), (CONJUNCTIVE, True), (ALTERNATIVES, own or merged)):
        for key in keys:
            if isinstance(schema.get(key), (dict, list)):
                schema[key] = closed(schema[key], merge)
    if own and not merged and not any(key in schema for key in OPEN_BY):
        schema["additionalProperties"] = False
    return schema
