"""The LoRA adapters a server answers for, by model name (vLLM's ``--lora-modules`` and its
runtime ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``).

A request's ``model`` names the base model or an adapter; any other name is a 404 in
OpenAI's shape. Adapters are checked when they are named (a bad directory is a 400 naming
the file) and get ids that are never reused, so a worker's slot holding an unloaded
adapter can never be mistaken for a new one.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

from compile_runtime.lora.adapter import LoRAAdapterError
from compile_runtime.lora.request import LoRARequest
from compile_runtime.server.api_error import APIError

# vLLM's switch for the runtime routes; COMPILE_RUNTIME_ALLOW_RUNTIME_LORA_UPDATING the same.
RUNTIME_UPDATING_VARIABLES = (
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "COMPILE_RUNTIME_ALLOW_RUNTIME_LORA_UPDATING",
)


def runtime_updating_from_env() -> bool:
    return any(
        os.environ.get(name, "").strip().lower() in ("1", "true", "yes")
        for name in RUNTIME_UPDATING_VARIABLES
    )


def parse_lora_module(text: str) -> tuple[str, str]:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ...}``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
            return str(spec["name"]), str(spec["path"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(
                f"--lora-modules {text!r}: give name=path or JSON with name and path"
            ) from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: give name=path (e.g. sql=/adapters/sql)")
    return name, path


class ServedAdapters:
    def __init__(self, base_name: str, core: Any, runtime_updating: bool = False):
        """``core``: the engine core, whose ``adapters`` checks them (None: LoRA is off)."""
        self.base_name = base_name
        self.core = core
        self.runtime_updating = runtime_updating
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.core.adapters is not None

    def names(self) -> list[str]:
        return [self.base_name, *self.by_name]

    def resolve(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); 404 otherwise."""
        if requested is None or requested == self.base_name:
            return None
        adapter = self.by_name.get(requested)
        if adapter is None:
            raise APIError(
                404,
                f"The model `{requested}` does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.names())}",
                "model",
            )
        return adapter

    def add(self, name: str, path: str) -> LoRARequest:
        """Check and register an adapter (a 400 naming what is wrong)."""
        if not self.enabled:
            raise APIError(
                400, "LoRA adapters need a server started with --enable-lora", "lora_name"
            )
        if name in self.by_name or name == self.base_name:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        try:
            request = LoRARequest(name, next(self._ids), path)
            self.core.adapters.check(request)
        except (LoRAAdapterError, ValueError) as e:
            raise APIError(400, str(e), "lora_path") from None
        self.by_name[name] = request
        return request

    def remove(self, name: str) -> None:
        request = self.by_name.pop(name, None)
        if request is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        self.core.adapters.forget(request)

    def check_updating(self) -> None:
        if not self.runtime_updating:
            raise APIError(
                404,
                "runtime LoRA updating is off; start the server with "
                "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
            )

    def cards(self, base_card: dict[str, Any]) -> list[dict[str, Any]]:
        """``/v1/models``: the base model's card, then one per adapter (its parent the base)."""
        out = [base_card]
        for name, request in self.by_name.items():
            out.append(
                base_card
                | {
                    "id": name,
                    "root": request.lora_path,
                    "parent": self.base_name,
                    "permission": [
                        p | {"id": f"modelperm-{name}"} for p in base_card["permission"]
                    ],
                }
            )
        return out
