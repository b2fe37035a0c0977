"""What a request asks its output to match, from the fields OpenAI and vLLM clients send:
``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` and its
older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``.

At most one of them may be given; a bad constraint is a ValueError naming the field the
user sent (the caller makes it a 400).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from compile_runtime.core.sampling_params import StructuredOutputsParams
from compile_runtime.core.structured_output import check_constraint

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class ConstraintError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _from_response_format(response_format: dict[str, Any]) -> dict[str, Any] | None:
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise ConstraintError(
                "response_format.json_schema.schema is missing: give the JSON schema the "
                "output must match",
                "response_format",
            )
        return {"json": schema}
    raise ConstraintError(
        f"response_format.type {kind!r} is not supported; use 'text', 'json_object' or "
        "'json_schema'",
        "response_format",
    )


def constraint_of(fields: dict[str, Any]) -> StructuredOutputsParams | None:
    """The request's output constraint (``fields``: its body as a dict), or None."""
    given: list[tuple[str, dict[str, Any]]] = []
    response_format = fields.get("response_format")
    if response_format:
        spec = _from_response_format(response_format)
        if spec is not None:
            given.append(("response_format", spec))
    if fields.get("structured_outputs"):
        given.append(("structured_outputs", dict(fields["structured_outputs"])))
    for name, key in GUIDED.items():
        if fields.get(name) is not None:
            given.append((name, {key: fields[name]}))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise ConstraintError(
            f"{names} each constrain the output; send only one of them", given[1][0]
        )
    param, spec = given[0]
    try:
        constraint = StructuredOutputsParams(**spec)
        check_constraint(constraint)
    except (ValidationError, ValueError) as e:
        reason = e.errors()[0]["msg"] if isinstance(e, ValidationError) else str(e)
        raise ConstraintError(f"{param}: {reason.removeprefix('Value error, ')}", param) from None
    return constraint
