"""A JSON-schema subset compiled to a regular expression (for `minillm.structured.regex`).

Supported: `type` "object" (with `properties` and `required`), "array" (with `items`,
`minItems`, `maxItems`), "string" (with `minLength`, `maxLength`), "integer", "number",
"boolean", "null", or a list of these; `enum` and `const` of JSON values; `anyOf` of
supported schemas. Annotations (`title`, `description`, `$schema`, `default`, `examples`) are
ignored. Every other keyword changes which values are valid, and is rejected (a
`SchemaError`) rather than silently not enforced.

The text is one fixed layout, the one `json.dumps(value)` writes with its default separators:
`", "` between items and members, `": "` after a key, no other whitespace. Object members come
in the order of `properties`; a property not in `required` may be left out, and no other key is
allowed (as if `additionalProperties` were false). Fixing the layout gives each value one
spelling, which keeps the automaton small and turns the punctuation between values into forced
runs that jump-forward decoding skips.
"""

from __future__ import annotations

import json

from minillm.structured.regex import MAX_PATTERN_LENGTH, CompileLimitError, escape

ANNOTATIONS = {"title", "description", "$schema", "$id", "default", "examples", "$comment"}
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
# a string character: anything but a quote, a backslash or a control character, or an escape
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+\-]?[0-9]+)?"
TYPE_KEYWORDS = {
    "object": {"type", "properties", "required", "additionalProperties"},
    "array": {"type", "items", "minItems", "maxItems"},
    "string": {"type", "minLength", "maxLength"},
    **{kind: {"type"} for kind in ("integer", "number", "boolean", "null")},
}
MAX_OPTIONAL_PROPERTIES = 8  # each optional property doubles the pattern of those after it


class SchemaError(ValueError):
    """A JSON schema outside the supported subset."""


def schema_to_regex(schema: dict | str | bool) -> str:
    """The regex whose matches are the JSON texts (in the layout above) valid for `schema`.

    `schema` is a dict or its JSON text.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise SchemaError(f"json schema is not valid JSON: {err}") from None
    return _value(schema, "schema")


def _check_keys(schema: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(schema) - allowed - ANNOTATIONS)
    if unknown:
        raise SchemaError(
            f"json schema {where}: unsupported keyword(s) {unknown}; supported here: "
            f"{sorted(allowed)}"
        )


def _count(schema: dict, key: str, where: str) -> int | None:
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchemaError(f"json schema {where}: {key} must be an int >= 0, got {value!r}")
    return value


def _repeat(item: str, low: int, high: int | None, separator: str) -> str:
    """`low` to `high` copies of item with `separator` between them."""
    if high is not None and high < low:
        raise SchemaError(f"json schema: a maximum ({high}) below the minimum ({low})")
    if high == 0:
        return ""
    rest_low = max(low - 1, 0)
    rest_high = "" if high is None else str(high - 1)
    rest = f"(?:{separator}{item}){{{rest_low},{rest_high}}}"
    if rest_low == 0 and high == 1:
        rest = ""
    body = f"{item}{rest}"
    return body if low >= 1 else f"(?:{body})?"


def _value(schema: object, where: str) -> str:
    """The pattern of one (sub)schema, refused as soon as it outgrows MAX_PATTERN_LENGTH:
    nesting repeats a pattern (an array writes its item twice), so a deep schema would grow
    past any memory before the regex compiler could refuse it."""
    pattern = _value_pattern(schema, where)
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise CompileLimitError(
            f"json schema {where}: its pattern is longer than MAX_PATTERN_LENGTH="
            f"{MAX_PATTERN_LENGTH} characters (nested too deep, or too many alternatives)"
        )
    return pattern


def _json_text(value: object, where: str) -> str:
    """A JSON value of an enum or const as the text it must be; NaN and infinities are no
    JSON."""
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise SchemaError(
            f"json schema {where}: {value!r:.60} is not a JSON value ({err})"
        ) from None


def _value_pattern(schema: object, where: str) -> str:
    if schema is True or schema == {}:
        raise SchemaError(
            f"json schema {where}: an unconstrained value (true or {{}}) is not supported; "
            "give it a type"
        )
    if not isinstance(schema, dict):
        raise SchemaError(f"json schema {where}: expected an object, got {schema!r:.60}")
    if "enum" in schema or "const" in schema:
        _check_keys(schema, {"enum", "const", "type"}, where)
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(values, list) or not values:
            raise SchemaError(f"json schema {where}: enum must be a non-empty list")
        return "(?:" + "|".join(escape(_json_text(v, where)) for v in values) + ")"
    if "anyOf" in schema:
        _check_keys(schema, {"anyOf"}, where)
        options = schema["anyOf"]
        if not isinstance(options, list) or not options:
            raise SchemaError(f"json schema {where}: anyOf must be a non-empty list")
        alternatives = [_value(o, f"{where}.anyOf[{i}]") for i, o in enumerate(options)]
        return "(?:" + "|".join(alternatives) + ")"
    kind = schema.get("type")
    if isinstance(kind, list):
        if not kind or not all(k in TYPES for k in kind):
            raise SchemaError(
                f"json schema {where}: type must be one of {list(TYPES)} or a non-empty list "
                f"of them, got {kind!r}"
            )
        _check_keys(schema, set().union(*(TYPE_KEYWORDS[k] for k in kind)), where)
        # each keyword applies to its own type only (maxLength to the string, ...)
        options = [
            _value(
                {**{key: v for key, v in schema.items() if key in TYPE_KEYWORDS[k]}, "type": k},
                where,
            )
            for k in kind
        ]
        return "(?:" + "|".join(options) + ")"
    if kind not in TYPES:
        raise SchemaError(f"json schema {where}: type must be one of {list(TYPES)}, got {kind!r}")
    if kind == "object":
        return _object(schema, where)
    if kind == "array":
        _check_keys(schema, {"type", "items", "minItems", "maxItems"}, where)
        if "items" not in schema:
            raise SchemaError(f"json schema {where}: an array needs an items schema")
        item = _value(schema["items"], f"{where}.items")
        low = _count(schema, "minItems", where) or 0
        high = _count(schema, "maxItems", where)
        return r"\[" + _repeat(item, low, high, ", ") + r"\]"
    if kind == "string":
        _check_keys(schema, {"type", "minLength", "maxLength"}, where)
        low = _count(schema, "minLength", where) or 0
        high = _count(schema, "maxLength", where)
        if high is not None and high < low:
            raise SchemaError(f"json schema {where}: maxLength {high} < minLength {low}")
        return '"' + f"{STRING_CHAR}{{{low},{'' if high is None else high}}}" + '"'
    _check_keys(schema, {"type"}, where)
    return {"integer": INTEGER, "number": NUMBER, "boolean": "(?:true|false)", "null": "null"}[kind]


def _object(schema: dict, where: str) -> str:
    _check_keys(schema, {"type", "properties", "required", "additionalProperties"}, where)
    if schema.get("additionalProperties", False) is not False:
        raise SchemaError(
            f"json schema {where}: only additionalProperties false is supported (members "
            "are the listed properties, in their order)"
        )
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise SchemaError(f"json schema {where}: properties must be an object")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise SchemaError(f"json schema {where}: required must be a list of property names")
    missing = sorted(set(required) - set(properties))
    if missing:
        raise SchemaError(f"json schema {where}: required names unknown properties {missing}")
    members = [
        (escape(json.dumps(key)) + ": " + _value(sub, f"{where}.properties.{key}"), key in required)
        for key, sub in properties.items()
    ]
    if sum(not is_required for _, is_required in members) > MAX_OPTIONAL_PROPERTIES:
        raise SchemaError(
            f"json schema {where}: at most {MAX_OPTIONAL_PROPERTIES} optional properties "
            "per object are supported"
        )

    def rest(i: int, after_member: bool) -> str:
        """The members from i on; after_member: one came before, so a comma leads."""
        if i == len(members):
            return ""
        member, is_required = members[i]
        present = (", " if after_member else "") + member + rest(i + 1, True)
        if is_required:
            return present
        return f"(?:{present}|{rest(i + 1, after_member)})"

    return r"\{" + rest(0, False) + r"\}"
