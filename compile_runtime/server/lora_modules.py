"""The LoRA adapters a server answers for, by model name (vLLM's ``--lora-modules`` and its
runtime ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``).

A request's ``model`` names the base model or an adapter; any other name is a 404 in
OpenAI's shape. Adapters are checked when they are named (a bad directory is a 400 naming
the file) and get ids that are never reused, so a worker's slot holding an unloaded
adapter can never be mistaken for a new one.

An adapter loaded at run time must resolve (symlinks followed, its files too) inside the
server's ``--lora-root``, and its files be at most ``MAX_ADAPTER_BYTES``; without a root,
loading by path at run time is refused. A path outside the root, missing, not an adapter or
too large gets one answer ("not available"), so the routes tell nothing about the disk.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from typing import Any

from compile_runtime.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, LoRAAdapterError
from compile_runtime.lora.request import LoRARequest
from compile_runtime.server.api_error import APIError

# vLLM's switch for the runtime routes; COMPILE_RUNTIME_ALLOW_RUNTIME_LORA_UPDATING the same.
RUNTIME_UPDATING_VARIABLES = (
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "COMPILE_RUNTIME_ALLOW_RUNTIME_LORA_UPDATING",
)
MAX_ADAPTER_BYTES = 2 << 30  # an adapter's files, loaded at run time


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


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def runtime_adapter_path(path: str, root: str | None, max_bytes: int = MAX_ADAPTER_BYTES) -> str:
    """The real directory of an adapter named at run time (relative paths are taken inside
    ``root``); one 400 for every way it is not available."""
    if root is None:
        raise APIError(
            400,
            "lora_path: loading adapters by path at run time needs a server started with "
            "--lora-root DIR (the directory they must be inside)",
            "lora_path",
        )
    unavailable = APIError(
        400, f"lora_path: no LoRA adapter is available at {path[:200]!r}", "lora_path"
    )
    real_root = os.path.realpath(root)
    try:
        real = os.path.realpath(os.path.join(real_root, path))
        if not _inside(real, real_root) or not os.path.isdir(real):
            raise unavailable
        size = 0
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            file = os.path.realpath(os.path.join(real, name))
            if not _inside(file, real_root) or not os.path.isfile(file):
                raise unavailable
            size += os.path.getsize(file)
    except (OSError, ValueError):
        raise unavailable from None
    if size > max_bytes:
        raise unavailable
    return real


class ServedAdapters:
    def __init__(
        self,
        base_name: str,
        core: Any,
        runtime_updating: bool = False,
        lora_root: str | None = None,
    ):
        """``core``: the engine core, whose ``adapters`` checks them (None: LoRA is off);
        ``lora_root``: the directory adapters loaded at run time must be inside."""
        self.base_name = base_name
        self.core = core
        self.runtime_updating = runtime_updating
        self.lora_root = lora_root
        self._lock = threading.Lock()  # adapters are added from worker threads
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
                f"The model `{requested[:200]}` does not exist; GET /v1/models lists the "
                "models this server serves",
                "model",
            )
        return adapter

    def add(self, name: str, path: str, trusted: bool = False) -> LoRARequest:
        """Check and register an adapter (a 400 naming what is wrong); ``trusted``: named by
        the operator (``--lora-modules``), else by a client at run time (inside the root)."""
        if not self.enabled:
            raise APIError(
                400, "LoRA adapters need a server started with --enable-lora", "lora_name"
            )
        if name in self.by_name or name == self.base_name:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        given = path
        if not trusted:
            path = runtime_adapter_path(path, self.lora_root)
        try:
            request = LoRARequest(name, next(self._ids), path)
            self.core.adapters.check(request)
        except (LoRAAdapterError, ValueError) as e:  # its files named as the client named them
            raise APIError(400, str(e).replace(path, given), "lora_path") from None
        with self._lock:
            if name in self.by_name:
                raise APIError(
                    400, f"The lora adapter '{name}' has already been loaded.", "lora_name"
                )
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
        for name in self.by_name:
            out.append(
                base_card
                | {
                    "id": name,
                    "root": name,
                    "parent": self.base_name,
                    "permission": [
                        p | {"id": f"modelperm-{name}"} for p in base_card["permission"]
                    ],
                }
            )
        return out
