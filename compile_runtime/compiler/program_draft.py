"""What the graph compiler keeps of a cold start for the saved program: the trace's code,
then the piece table once the pieces are compiled (``program.py`` saves it)."""

from __future__ import annotations

import dataclasses
import logging

import torch

from compile_runtime.cache.entry import CacheEntry
from compile_runtime.cache.key import source_digests
from compile_runtime.compiler import saved_program
from compile_runtime.compiler.piece_store import PieceRecord
from compile_runtime.compiler.piecewise import PiecewiseRuntime
from compile_runtime.compiler.split import Piece

logger = logging.getLogger(__name__)


class DraftBuilder:
    """What the graph compiler keeps of a cold start for the program: its code (taken before
    the pieces are replaced), then the piece table once they are compiled."""

    def __init__(self, model_tag: str):
        self.model_tag = model_tag
        self.started: tuple[saved_program.ProgramCode, list[str], int] | None = None
        self.draft: saved_program.ProgramDraft | None = None

    def start(
        self, gm: torch.fx.GraphModule, split_gm: torch.fx.GraphModule, pieces: list[Piece]
    ) -> None:
        try:
            inputs = saved_program.draft_inputs(gm)
            (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
            num_outputs = len(outputs) if isinstance(outputs, (tuple, list)) else 1
            self.started = saved_program.program_code(split_gm, pieces), inputs, num_outputs
        except Exception as e:  # noqa: BLE001 - any reason only means: trace at every start
            logger.info("%s: the trace is not saved as a program (%s)", self.model_tag, e)

    def finish(
        self,
        runtimes: dict[str, PiecewiseRuntime],
        records: list[PieceRecord],
        cache: CacheEntry,
        traced_files: list[str],
    ) -> None:
        if self.started is None:
            return
        code, inputs, num_outputs = self.started
        table = [
            {
                "name": name,
                "hash": runtime.piece_hash,
                "locator": list(runtime.locator) if runtime.locator else None,
                "sizes": [None, *sorted(runtime.exact)],
            }
            for name, runtime in runtimes.items()
        ]
        self.draft = saved_program.ProgramDraft(
            code=code,
            inputs=inputs,
            num_outputs=num_outputs,
            pieces=table,
            records=[dataclasses.asdict(r) for r in records],
            entry_dir=cache.dir,
            entry_factors=cache.factors,
            sources={
                path: digest for path in traced_files for digest in source_digests([path]).values()
            },
        )
