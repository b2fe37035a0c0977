"""A pytest plugin (``-p optional_deps_blocker``) that makes the optional dependencies of the
server unimportable, as on a machine that installed the package without its ``serve`` extra
(the GPU check's machines: torch, triton and nothing of ours)."""

from __future__ import annotations

import importlib.abc
import sys

BLOCKED = ("fastapi", "starlette", "uvicorn", "openai", "prometheus_client")


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


for _name in [m for m in sys.modules if m.partition(".")[0] in BLOCKED]:
    del sys.modules[_name]
sys.meta_path.insert(0, _Blocker())
