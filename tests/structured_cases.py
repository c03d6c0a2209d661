"""Cases for constrained decoding, shared by the engine and server tests: 50 generated schemas
(nested objects, arrays, enums, bounded numbers, required and optional fields) and two tools."""

from __future__ import annotations

import random
from typing import Any

WORDS = ["name", "city", "title", "count", "price", "tags", "owner", "color", "size", "score", "active",
         "kind", "items", "level", "note", "year"]  # fmt: skip


def gen_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random object schema: nested objects, arrays, enums, bounded numbers, required/optional."""
    props: dict[str, Any] = {}
    for key in rng.sample(WORDS, rng.randint(1, 4)):
        kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array", "object"]
                          if depth < 2 else ["string", "integer", "boolean", "enum"])  # fmt: skip
        if kind == "string":
            props[key] = {"type": "string", "maxLength": rng.choice([8, 16, 24])}
        elif kind == "integer":
            lo = rng.randint(-100, 50)
            props[key] = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 1000)}
        elif kind == "number":
            props[key] = {"type": "number", "minimum": 0, "maximum": 100}
        elif kind == "boolean":
            props[key] = {"type": "boolean"}
        elif kind == "enum":
            props[key] = {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no"], 3)}
        elif kind == "array":
            item = rng.choice([{"type": "string", "maxLength": 10}, {"type": "integer", "minimum": 0, "maximum": 99},
                               {"enum": ["a", "b", "c"]}])  # fmt: skip
            props[key] = {"type": "array", "items": item, "minItems": 1, "maxItems": 3}
        else:
            props[key] = gen_schema(rng, depth + 1)
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


SCHEMAS = [gen_schema(random.Random(seed)) for seed in range(50)]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                       "required": ["city"]}}}  # fmt: skip
