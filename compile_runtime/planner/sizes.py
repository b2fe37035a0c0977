"""Choose CUDA graph capture sizes from a workload: an exact dynamic program.

The problem. A step of ``n`` tokens runs in the graph of the smallest
capture size ``s >= n`` and computes ``s - n`` padding tokens for nothing. A
step larger than every capture size runs without a graph (no padding, but
no graph either). Given a histogram ``{n: steps}`` and a budget of ``K``
sizes, pick the sizes that minimise the expected padded tokens per step.

Coverage rule (what keeps the problem honest). Every step of at most
``max_size`` tokens must get a graph: the largest chosen size is the largest
token count seen that is <= ``max_size``. Without that rule the cheapest
plan would capture nothing (no graph, no padding). Steps above ``max_size``
are not planned for; they are reported as *uncovered*: they run without a
graph whatever the plan.

Why only token counts that occur are candidates: lowering a size to the
largest count it serves keeps every step in the same graph and pads less, so
some optimal plan uses observed counts only.

The program. Sort the distinct counts ``x_1 < ... < x_M`` (weights
``w_i``). A size at ``x_i`` that serves ``x_{j+1} .. x_i`` costs
``sum w_t (x_i - x_t) = x_i (W_i - W_j) - (S_i - S_j)`` with prefix sums
``W`` (steps) and ``S`` (tokens). With ``D_k(i)`` the least waste serving
``x_1 .. x_i`` with ``k`` sizes, ``x_i`` the largest::

    D_k(i) = x_i W_i - S_i + min_{j < i} (D_{k-1}(j) + S_j - x_i W_j)

The inner minimum is the lower envelope of lines with slopes ``-W_j``
(strictly falling in ``j``) queried at rising ``x_i``, so a monotone convex
hull makes each layer O(M): O(K M) in all, in exact integer arithmetic. With
``K >= M`` every count gets its own size and nothing is padded.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

# The default ladder: dense where decode batches are, coarser above.
DEFAULT_MAX_CAPTURE_SIZE = 512


def default_capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, then 8..248 step 8, then 256.. step 16, up to ``max_size``."""
    ladder = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_size + 1, 16))
    return [s for s in ladder if s <= max_size]


def _points(histogram: Mapping[int, int], max_size: int | None) -> tuple[list[int], list[int]]:
    items = sorted(
        (int(n), int(c))
        for n, c in histogram.items()
        if c > 0 and n >= 1 and (max_size is None or n <= max_size)
    )
    return [n for n, _ in items], [c for _, c in items]


def plan_sizes(
    histogram: Mapping[int, int], max_graphs: int, max_size: int | None = None
) -> list[int]:
    """The at most ``max_graphs`` capture sizes with the least padding over ``histogram``.

    Every token count up to ``max_size`` (None: no bound) that occurs gets a
    graph; counts above ``max_size`` are left out (they run without one).
    Fewer than ``max_graphs`` sizes come back only when fewer distinct counts
    occur. An empty histogram gives no sizes.
    """
    if max_graphs < 1:
        raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
    if max_size is not None and max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    xs, ws = _points(histogram, max_size)
    m = len(xs)
    if m <= max_graphs:
        return xs
    # Prefix sums over the first i points (index 0 = none).
    W, S = [0] * (m + 1), [0] * (m + 1)
    for i, (x, w) in enumerate(zip(xs, ws, strict=True), start=1):
        W[i], S[i] = W[i - 1] + w, S[i - 1] + w * x

    # One size: it is the largest point, serving everything.
    dp = [0] + [xs[i - 1] * W[i] - S[i] for i in range(1, m + 1)]
    back: list[list[int]] = [[0] * (m + 1)]
    for k in range(2, max_graphs + 1):
        new = [0] * (m + 1)
        choice = [0] * (m + 1)
        hull: list[tuple[int, int, int]] = []  # (slope, intercept, j); slopes strictly falling
        head = 0
        for i in range(k, m + 1):
            j = i - 1  # the line of j = i - 1 joins before the query at x_i
            line = (-W[j], dp[j] + S[j], j)
            while len(hull) - head >= 2 and _redundant(hull[-2], hull[-1], line):
                hull.pop()
            hull.append(line)
            x = xs[i - 1]
            while head + 1 < len(hull) and _at(hull[head + 1], x) <= _at(hull[head], x):
                head += 1
            slope, intercept, best = hull[head]
            new[i] = x * W[i] - S[i] + intercept + slope * x
            choice[i] = best
        # D_k(i) exists for i >= k only; the next layer's lines start at j = k.
        dp = new
        back.append(choice)
    sizes = []
    i = m
    for k in range(max_graphs, 0, -1):
        sizes.append(xs[i - 1])
        i = back[k - 1][i]
    return sorted(sizes)


def _at(line: tuple[int, int, int], x: int) -> int:
    return line[0] * x + line[1]


def _redundant(a: tuple[int, int, int], b: tuple[int, int, int], c: tuple[int, int, int]) -> bool:
    """Whether ``b`` is nowhere strictly below both ``a`` and ``c`` (slopes a > b > c)."""
    # b is useless when c overtakes a no later than b does:
    # (c.b - a.b) / (a.m - c.m) <= (b.b - a.b) / (a.m - b.m), cross-multiplied (denominators > 0).
    return (c[1] - a[1]) * (a[0] - b[0]) <= (b[1] - a[1]) * (a[0] - c[0])


# ---- what a ladder costs -------------------------------------------------------


@dataclass(frozen=True)
class LadderCost:
    """How a list of capture sizes serves a histogram."""

    name: str
    sizes: tuple[int, ...]
    num_steps: int  # every step in the histogram
    num_tokens: int  # real tokens of every step
    covered_steps: int  # steps that run in a graph (token count <= the largest size)
    padded_tokens: int  # padding computed by covered steps

    @property
    def num_sizes(self) -> int:
        return len(self.sizes)

    @property
    def uncovered_steps(self) -> int:
        return self.num_steps - self.covered_steps

    @property
    def padded_per_step(self) -> float:
        """Expected padded tokens per step (uncovered steps count as 0)."""
        return self.padded_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def waste_fraction(self) -> float:
        """Padded tokens over real tokens: the extra work padding adds."""
        return self.padded_tokens / self.num_tokens if self.num_tokens else 0.0

    @property
    def coverage(self) -> float:
        return self.covered_steps / self.num_steps if self.num_steps else 1.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["sizes"] = list(self.sizes)
        data.update(
            num_sizes=self.num_sizes,
            uncovered_steps=self.uncovered_steps,
            padded_per_step=self.padded_per_step,
            waste_fraction=self.waste_fraction,
        )
        return data


def ladder_cost(histogram: Mapping[int, int], sizes: Iterable[int], name: str = "") -> LadderCost:
    """Padding of ``sizes`` over ``histogram`` (steps above the largest size run unpadded)."""
    ladder = sorted(set(sizes))
    steps = tokens = covered = padded = 0
    for n, count in histogram.items():
        if count <= 0:
            continue
        steps += count
        tokens += n * count
        i = bisect.bisect_left(ladder, n)
        if i < len(ladder):
            covered += count
            padded += (ladder[i] - n) * count
    return LadderCost(name, tuple(ladder), steps, tokens, covered, padded)


def padded_tokens(histogram: Mapping[int, int], sizes: Sequence[int]) -> int:
    return ladder_cost(histogram, sizes).padded_tokens


# ---- the default ladder, for comparison ------------------------------------------


def default_ladder_covering(top: int) -> list[int]:
    """The default ladder up to its first size >= ``top`` (it continues in steps of 16)."""
    ladder = default_capture_sizes(max(top, 1) + 16)
    end = next(i for i, s in enumerate(ladder) if s >= top)
    return ladder[: end + 1]


def thin_ladder(ladder: Sequence[int], k: int) -> list[int]:
    """``k`` sizes of ``ladder``, evenly spaced by position, always keeping the largest."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n = len(ladder)
    if k >= n:
        return list(ladder)
    if k == 1:
        return [ladder[-1]]
    return [ladder[round(i * (n - 1) / (k - 1))] for i in range(k)]


def default_ladder_with_k(histogram: Mapping[int, int], k: int, max_size: int | None) -> list[int]:
    """The fair default-ladder baseline with ``k`` sizes.

    "Fair" means the same coverage as the plan: the default ladder is taken
    up to its first size >= the largest planned-for token count (so it serves
    every step the plan serves), then thinned to ``k`` sizes evenly by
    position (keeping the largest). Taking the *first* ``k`` sizes instead
    would cover only small steps and make the default look cheap by running
    everything else without a graph.
    """
    xs, _ = _points(histogram, max_size)
    if not xs:
        return []
    return thin_ladder(default_ladder_covering(xs[-1]), k)


def default_num_graphs(histogram: Mapping[int, int], max_size: int | None) -> int:
    """How many sizes the default ladder spends to cover the largest planned-for count."""
    xs, _ = _points(histogram, max_size)
    return len(default_ladder_covering(xs[-1])) if xs else 0


@dataclass(frozen=True)
class PlanReport:
    """A plan and its baselines over one histogram."""

    sizes: list[int]
    max_graphs: int
    max_size: int | None
    plan: LadderCost
    default_same_k: LadderCost  # the default ladder thinned to as many sizes as the plan
    default: LadderCost  # the default ladder as a config without sizes gets it

    def rows(self) -> list[LadderCost]:
        return [self.plan, self.default_same_k, self.default]

    def to_dict(self) -> dict:
        return {
            "sizes": self.sizes,
            "max_graphs": self.max_graphs,
            "max_size": self.max_size,
            "plan": self.plan.to_dict(),
            "default_same_k": self.default_same_k.to_dict(),
            "default": self.default.to_dict(),
        }


def plan_report(
    histogram: Mapping[int, int], max_graphs: int, max_size: int | None = DEFAULT_MAX_CAPTURE_SIZE
) -> PlanReport:
    """Plan ``max_graphs`` sizes and price them against the default ladder.

    The plan's costs are over the whole histogram; with ``max_size`` below
    the largest count, the steps above it show up as uncovered in every row.
    "Default as is" is ``default_capture_sizes(max_size or 512)``: what
    ``CompilationConfig(max_cudagraph_capture_size=max_size)`` captures.
    """
    sizes = plan_sizes(histogram, max_graphs, max_size)
    k = len(sizes)
    plan = ladder_cost(histogram, sizes, "plan (exact DP)")
    same_k = ladder_cost(
        histogram,
        default_ladder_with_k(histogram, k, max_size) if k else [],
        f"default, thinned to {k}",
    )
    default = ladder_cost(
        histogram, default_capture_sizes(max_size or DEFAULT_MAX_CAPTURE_SIZE), "default as is"
    )
    return PlanReport(sizes, max_graphs, max_size, plan, same_k, default)
