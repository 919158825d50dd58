"""agentjet-server[structured] alone: response_format json_schema constrains the answer (xgrammar)."""

import json

from _smoke import Server

SCHEMA = {
    "type": "object",
    "properties": {"digit": {"type": "integer", "minimum": 0, "maximum": 9}, "sure": {"type": "boolean"}},
    "required": ["digit", "sure"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "digit", "schema": SCHEMA, "strict": True}}

with Server() as server:
    choice = server.chat(response_format=FORMAT, max_tokens=48, seed=0)["choices"][0]
answer = json.loads(choice["message"]["content"])
assert set(answer) == {"digit", "sure"} and 0 <= answer["digit"] <= 9, answer
assert choice["agentjet"]["sampled_from"] == "processed", choice["agentjet"]  # the masked distribution is recorded
print(f"structured: a json_schema answer parsed and validated: {answer}")
