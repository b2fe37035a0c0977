"""What a verification found, piece by piece, and how it prints (table or JSON)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from compile_runtime.table import format_table

# ---- the report ---------------------------------------------------------------------------


@dataclass
class PieceCheck:
    index: int
    name: str
    kind: str  # "compiled" or "splitting op"
    covers: str  # which layers, e.g. "layer 0 (after attention) .. layer 1 (before attention)"
    shared_with: int | None = None  # the piece whose compiled code this one reuses
    max_abs: float | None = None  # compiled vs eager (None for splitting ops)
    max_rel: float | None = None
    ok: bool | None = None
    note: str = ""
    graph_max_abs: float | None = None  # graph replay vs the same piece without a graph
    graph_ok: bool | None = None

    @property
    def failed(self) -> bool:
        return self.ok is False or self.graph_ok is False


@dataclass
class VerifyReport:
    model: str
    num_tokens: int
    dtype: str
    device: str
    backend: str
    atol: float
    rtol: float
    pieces: list[PieceCheck] = field(default_factory=list)
    graphs: str = "off"  # what the graph comparison did, in words
    end_to_end_max_abs: float | None = None  # compiled model vs every piece eager
    end_to_end_max_rel: float | None = None

    @property
    def first_failure(self) -> PieceCheck | None:
        return next((p for p in self.pieces if p.failed), None)

    @property
    def ok(self) -> bool:
        return self.first_failure is None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        first = self.first_failure
        data["first_failure"] = None if first is None else first.index
        data["ok"] = self.ok
        return data

    def format(self) -> str:
        lines = [
            f"check {self.model}: {self.num_tokens} tokens, {self.dtype} on {self.device}, "
            f"{self.backend} backend; a piece passes when max|compiled - eager| <= "
            f"{self.atol:g} + {self.rtol:g} * max|eager|",
            "",
        ]
        rows = []
        for p in self.pieces:
            kind = p.kind if p.shared_with is None else f"compiled (code of {p.shared_with})"
            if p.ok is None:
                result = "ran as is"
            else:
                result = "ok" if p.ok else "FAIL"
                if p.note:
                    result += f": {p.note}"
            graph = "-"
            if p.graph_max_abs is not None:
                graph = f"{p.graph_max_abs:.3g} " + ("ok" if p.graph_ok else "FAIL")
            rows.append(
                [
                    p.index,
                    kind,
                    p.covers,
                    "-" if p.max_abs is None else f"{p.max_abs:.3g}",
                    "-" if p.max_rel is None else f"{p.max_rel:.3g}",
                    result,
                    graph,
                ]
            )
        headers = [
            "piece",
            "kind",
            "covers",
            "max abs err",
            "max rel err",
            "result",
            "graph replay",
        ]
        lines.append(format_table(headers, rows))
        lines.append("")
        if self.end_to_end_max_abs is not None:
            lines.append(
                f"end to end (compiled model vs every piece eager): max abs "
                f"{self.end_to_end_max_abs:.3g}, max rel {self.end_to_end_max_rel:.3g}"
            )
        lines.append(f"CUDA graphs: {self.graphs}")
        first = self.first_failure
        compiled = sum(p.kind == "compiled" for p in self.pieces)
        if first is None:
            lines.append(f"OK: all {compiled} compiled pieces within tolerance")
        else:
            what = (
                "graph replay differs" if first.ok is not False else "compiled differs from eager"
            )
            lines.append(f"FIRST FAILURE: piece {first.index} ({first.covers}): {what}")
        return "\n".join(lines)
