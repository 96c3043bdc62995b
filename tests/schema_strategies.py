"""Hypothesis strategies from JSON schemas: the part of JSON Schema that ``/openapi.json`` uses (chapter 8).

hypothesis-jsonschema would do this, but its last release calls internals that
current hypothesis no longer has; the server's schemas use a small subset,
so it is written out here. Covered: ``$ref`` into the document's components,
``anyOf`` (keywords beside it bind the branch of their type, as in JSON
Schema), ``enum``, ``const``, ``not`` with a ``const``, the numeric bounds
(inclusive and exclusive), string length and ``pattern``, array length and
``items``, object ``properties``/``required``/``additionalProperties``/
``propertyNames``. Anything else raises, so a new keyword in the schema is
noticed instead of silently drawn too widely. Sizes are kept small on purpose:
a body is one HTTP request to a tiny model, not a stress test.

vLLM 0.32 counterpart: none (vLLM's test runs schemathesis).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

Json = Any
# Keywords that document and constrain nothing to draw.
NOTES = frozenset({"title", "description", "default", "examples", "deprecated", "readOnly", "format"})
KNOWN = NOTES | {"$ref", "anyOf", "enum", "const", "not", "type", "minimum", "maximum", "exclusiveMinimum",
                 "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems", "items",
                 "properties", "required", "additionalProperties", "propertyNames", "components"}
MAX_SIZE = 3  # list items, extra object keys
MAX_TEXT = 12
TEXT = st.characters(exclude_categories=("Cs",))
ANY_JSON: st.SearchStrategy[Json] = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(TEXT, max_size=MAX_TEXT),
    lambda inner: st.lists(inner, max_size=MAX_SIZE) | st.dictionaries(st.text(TEXT, max_size=6), inner,
                                                                        max_size=MAX_SIZE),
    max_leaves=4)


def from_schema(schema: Json, document: Json) -> st.SearchStrategy[Json]:
    """Values valid against ``schema``; ``document`` holds what its ``$ref`` values point to."""
    if schema is True or schema == {}:
        return ANY_JSON
    unknown = set(schema) - KNOWN
    if unknown:
        raise ValueError(f"schema keywords this generator does not know: {sorted(unknown)}")
    if "$ref" in schema:
        return from_schema({**_resolve(schema["$ref"], document), **_without(schema, "$ref")}, document)
    if "anyOf" in schema:
        rest = _without(schema, "anyOf")
        return st.one_of([from_schema(_merged(branch, rest, document), document) for branch in schema["anyOf"]])
    drawn = _drawn(schema, document)
    if "not" in schema:
        excluded = schema["not"]["const"]
        drawn = drawn.filter(lambda value: value != excluded or type(value) is not type(excluded))
    return drawn


def _drawn(schema: Json, document: Json) -> st.SearchStrategy[Json]:
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    makers = {"null": lambda: st.none(), "boolean": st.booleans, "integer": lambda: _integers(schema),
              "number": lambda: _numbers(schema), "string": lambda: _strings(schema),
              "array": lambda: _arrays(schema, document), "object": lambda: _objects(schema, document)}
    if kind is None:
        return ANY_JSON
    return makers[kind]()


def _resolve(ref: str, document: Json) -> Json:
    node = document
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def _without(schema: Json, key: str) -> Json:
    return {name: value for name, value in schema.items() if name != key and name not in NOTES}


def _merged(branch: Json, rest: Json, document: Json) -> Json:
    """A branch with the keywords beside its ``anyOf`` (a ``$ref`` branch resolved first); a
    subschema both give (``items``) must hold for both, so the two are merged too."""
    if "$ref" in branch:
        branch = {**_resolve(branch["$ref"], document), **_without(branch, "$ref")}
    merged = {**rest, **branch}
    for key in ("items", "additionalProperties"):
        if isinstance(rest.get(key), dict) and isinstance(branch.get(key), dict):
            merged[key] = _merged(branch[key], rest[key], document)
    return merged


def _integers(schema: Json) -> st.SearchStrategy[int]:
    low = schema.get("minimum", schema.get("exclusiveMinimum", None))
    high = schema.get("maximum", schema.get("exclusiveMaximum", None))
    if "exclusiveMinimum" in schema and "minimum" not in schema:
        low = int(low) + 1
    if "exclusiveMaximum" in schema and "maximum" not in schema:
        high = int(high) - 1
    return st.integers(None if low is None else int(low), None if high is None else int(high))


def _numbers(schema: Json) -> st.SearchStrategy[float]:
    return st.floats(schema.get("minimum", schema.get("exclusiveMinimum")),
                     schema.get("maximum", schema.get("exclusiveMaximum")),
                     exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema,
                     allow_nan=False, allow_infinity=False) | st.integers(
        int(schema.get("minimum", 0)) if "minimum" in schema else None,
        int(schema["maximum"]) if "maximum" in schema else None).filter(lambda value: _within(value, schema))


def _within(value: float, schema: Json) -> bool:
    return (value > schema.get("exclusiveMinimum", float("-inf"))
            and value < schema.get("exclusiveMaximum", float("inf"))
            and schema.get("minimum", float("-inf")) <= value <= schema.get("maximum", float("inf")))


def _strings(schema: Json) -> st.SearchStrategy[str]:
    if "pattern" in schema:
        return st.from_regex(schema["pattern"], fullmatch=True)
    return st.text(TEXT, min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", MAX_TEXT))


def _arrays(schema: Json, document: Json) -> st.SearchStrategy[list[Json]]:
    low = schema.get("minItems", 0)
    return st.lists(from_schema(schema.get("items", {}), document), min_size=low,
                    max_size=schema.get("maxItems", low + MAX_SIZE))


def _objects(schema: Json, document: Json) -> st.SearchStrategy[dict[str, Json]]:
    properties = schema.get("properties", {})
    required = set(schema.get("required", ()))
    fixed = st.fixed_dictionaries(
        {name: from_schema(sub, document) for name, sub in properties.items() if name in required},
        optional={name: from_schema(sub, document) for name, sub in properties.items() if name not in required})
    extra = schema.get("additionalProperties", True)
    if extra is False:
        return fixed
    keys = from_schema({"type": "string", **schema.get("propertyNames", {})}, document).filter(
        lambda key: key not in properties)
    values = from_schema({} if extra is True else extra, document)
    return st.tuples(fixed, st.dictionaries(keys, values, max_size=MAX_SIZE)).map(lambda pair: {**pair[1], **pair[0]})
