"""What a request may ask of the chat template (vLLM's rules): its own template (the
``chat_template`` field, or in ``chat_template_kwargs``) only on a server started with
``--trust-request-chat-template``, and ``chat_template_kwargs`` only as variables for the
template: a key naming one of the tokenizer's own arguments (``tokenize``,
``return_tensors``...) is a 400; one the template does not read is dropped with a warning.

The template renders in transformers' jinja2 sandbox (``ImmutableSandboxedEnvironment``:
no attribute of Python internals, ``range`` bounded), in a worker thread with a time bound
at which the rendering is stopped (``worker_pool.py``).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

from compile_runtime.server.api_error import APIError

logger = logging.getLogger(__name__)

# apply_chat_template's own arguments and what the server sets itself: never a variable.
RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "sanitize_control_tokens", "kwargs", "processor_kwargs",
})  # fmt: skip
# Taken as the request's fields of the same name.
FIELDS = ("add_generation_prompt", "continue_final_message")
_GENERATION_TAG = re.compile(r"{%-?\s*(?:end)?generation\s*-?%}")


CACHED_TEMPLATE_CHARS = 64 << 10  # longer templates (a request's own) are parsed each time


def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads from its context (jinja2.meta); a template jinja2
    cannot parse reads none (rendering it reports the error). The last 16 templates of at
    most ``CACHED_TEMPLATE_CHARS`` are remembered: the model's own, and a few small ones
    requests bring."""
    if len(template) <= CACHED_TEMPLATE_CHARS:
        return _cached_variables(template)
    return _variables(template)


def _variables(template: str) -> frozenset[str]:
    import jinja2
    import jinja2.ext
    from jinja2 import meta

    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols])
    try:
        ast = env.parse(_GENERATION_TAG.sub("", template))
    except jinja2.TemplateError:
        return frozenset()
    return frozenset(meta.find_undeclared_variables(ast))


_cached_variables = functools.lru_cache(maxsize=16)(_variables)


def _template(tokenizer: Any, requested: str | None) -> str:
    template = requested if requested is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) else ""


def template_arguments(
    kwargs: dict[str, Any] | None,
    body_template: str | None,
    tokenizer: Any,
    trust: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(variables for the template, and ``chat_template`` when the request brings its own;
    the request's ``add_generation_prompt`` / ``continue_final_message`` overrides)."""
    kwargs = dict(kwargs or {})
    requested = kwargs.pop("chat_template", None)
    if requested is not None and body_template is not None:
        raise APIError(
            400,
            "chat_template_kwargs.chat_template: give the template once (chat_template)",
            "chat_template_kwargs",
        )
    requested = body_template if body_template is not None else requested
    param = "chat_template" if body_template is not None else "chat_template_kwargs"
    if requested is not None:
        if not trust:
            raise APIError(
                400,
                f"{param}: this server renders only the model's own chat template; a request's "
                "template needs a server started with --trust-request-chat-template",
                param,
            )
        if not isinstance(requested, str):
            raise APIError(400, f"{param}: the template must be a string", param)
    overrides = {name: kwargs.pop(name) for name in FIELDS if name in kwargs}
    for name, value in overrides.items():
        if not isinstance(value, bool):
            raise APIError(
                400, f"chat_template_kwargs.{name}: give true or false", "chat_template_kwargs"
            )
    reserved = sorted(k for k in kwargs if k in RESERVED)
    if reserved:
        raise APIError(
            400,
            f"chat_template_kwargs.{reserved[0]}: not a variable of the chat template; the "
            "server sets the tokenizer's own arguments",
            "chat_template_kwargs",
        )
    read = template_variables(_template(tokenizer, requested))
    unread = sorted(k for k in kwargs if k not in read)
    if unread:
        logger.warning("chat_template_kwargs the chat template does not read, ignored: %s", unread)
    out = {k: v for k, v in kwargs.items() if k in read}
    if requested is not None:
        out["chat_template"] = requested
    return out, overrides
