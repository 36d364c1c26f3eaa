"""20+ JSON schemas for structured-output tests and the bench: nested objects, arrays with bounds, enums,
patterns, numbers with ranges, optional fields, anyOf. Strings are bounded so that a base model's output
closes within the token budget; so are most integers (a base model asked for an unbounded integer tends to
write zeros until max_tokens: finish reason ``length``, which the bench counts)."""

S = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": S, "country": S}, "required": ["city", "country"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -999, "maximum": 999},
                                                                             "y": {"type": "integer", "minimum": -999, "maximum": 999}},
                                                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}},
     "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"],
     "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "integer"}, "note": S}, "required": ["id"],
     "additionalProperties": False},  # optional note
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999}, {"type": "boolean"}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": S, "roles": {"type": "array", "items": {"enum": ["admin", "user"]}, "maxItems": 2}},
        "required": ["name", "roles"], "additionalProperties": False}}, "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"], "additionalProperties": False},
    {"type": "object", "properties": {"temp": {"type": "integer", "minimum": -40, "maximum": 50},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["temp", "unit"],
     "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"], "additionalProperties": False}, "minItems": 1, "maxItems": 2}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}},
     "required": ["answer"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
     "required": ["a", "b", "c"], "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
     "required": ["email"], "additionalProperties": False},
    {"type": "object", "properties": {"ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
     "required": ["ratio"], "additionalProperties": False},
    {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1,
                                                "maxItems": 4}}, "required": ["flags"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "event"}, "at": {"type": "integer", "minimum": 0, "maximum": 99999}},
     "required": ["kind", "at"], "additionalProperties": False},
]

PROMPTS = ["A person as JSON: ", "Here is the data: ", "Output: ", "JSON record: "]
