"""Balancers: which context-parallel rank holds each token of a packed row.

A plan is ``owner``, int64 [L]: the rank of every row position. Every balancer gives each of
the N ranks exactly L/N positions (so the per-layer K/V all-gather is uniform) and is a
function of the row's segment lengths alone: every rank computes the whole plan itself (it
needs all of it to put the gathered rows back in order), and a resumed run, on any number of
ranks, shards a row as any other run would. A rank's tokens stay in row order.

The balancers (``head_tail``, ``rounds``, ``documents``), the head-tail pairs a split document
is cut into and the water-filling of their shares: docs/context-parallel-balance.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from longctx.errors import LongctxError

HEAD_TAIL, ROUNDS, DOCUMENTS = "head_tail", "rounds", "documents"
BALANCERS = (HEAD_TAIL, ROUNDS, DOCUMENTS)
# chosen from benchmarks/results/cp.json (docs/context-parallel-balance.md)
DEFAULT_BALANCE = DOCUMENTS
# How far past the mean work a whole document may lift a rank's projected work before it is
# split instead; the greedy never splits documents lighter than this fraction of the mean.
# The greedy's balance is only a start (even_out finishes it), so this trades its pieces
# against even_out's, set on the benchmark's rows (lognormal, median 600) at 32k / 8 ranks:
# 0.13 gives 3.9 pieces per rank after even_out, 0.3 gives 3.5, 1.0 gives 4.0.
WHOLE_TOLERANCE = 0.3
# even_out's goal: the heaviest rank's work within this fraction of the lightest's (max / min;
# max / mean is then within it too).
EVEN_TOLERANCE = 0.03
# What one more piece costs a trade, as a fraction of the mean work: even_out takes the trade
# whose distance from the midpoint plus this per added piece is least, so a trade that adds a
# piece must land 1% of the mean closer than one that does not.
PIECE_COST = 0.01


def check_balance(balance: str, rounds: int = 1) -> None:
    """A known balancer; ``rounds`` is read by ``rounds`` only (another balancer refuses it,
    rather than ignore it)."""
    if balance not in BALANCERS:
        raise LongctxError(f"context_parallel_balance={balance!r}; expected one of {BALANCERS}")
    if rounds != 1 and balance != ROUNDS:
        raise LongctxError(
            f"context_parallel_rounds={rounds} with context_parallel_balance={balance!r}: rounds "
            f"apply to the {ROUNDS!r} balancer only; set context_parallel_balance={ROUNDS} or "
            "context_parallel_rounds=1"
        )


def rank_unit(size: int, balance: str, rounds: int = 1) -> int:
    """What a row length must be a multiple of: 2N chunks per round, or N ranks."""
    return size if balance == DOCUMENTS else 2 * size * rounds


def row_owner(lens: np.ndarray, size: int, balance: str, rounds: int = 1) -> np.ndarray:
    """int64 [L]: the rank of every position of a row of segments ``lens`` (positive)."""
    lens = np.asarray(lens, dtype=np.int64)
    if balance == DOCUMENTS:
        return document_owner(lens, size)
    return chunk_owner(int(lens.sum()), size, rounds if balance == ROUNDS else 1)


def chunk_owner(length: int, size: int, rounds: int = 1) -> np.ndarray:
    """Head-tail chunks: the row in ``rounds`` segments of 2N chunks, rank r holding chunks r
    and 2N-1-r of each."""
    per_round = 2 * size
    ranks = np.concatenate([np.arange(size), np.arange(size)[::-1]])
    return np.repeat(np.tile(ranks, rounds), length // (per_round * rounds))


def context_chunks(rank: int, size: int, rounds: int = 1) -> list[int]:
    """The row chunks (of 2 * size * rounds) that head-tail ``rank`` holds, in order."""
    per_round = 2 * size
    return [j * per_round + i for j in range(rounds) for i in (rank, per_round - 1 - rank)]


def document_owner(lens: np.ndarray, size: int) -> np.ndarray:
    """The ``documents`` balancer: longest document first, each

    - whole, to the least loaded rank with room for it, if that keeps its load within the
      limit (or the document is light: its pairs under WHOLE_TOLERANCE x the mean);
    - else, if light and no rank has room for it, in contiguous pieces that fill the ranks
      with the most room (a piece is cheap here; each such cut closes a rank, so there are at
      most N - 1 per row);
    - else in head-tail pairs over the fewest least loaded ranks that keep every load within
      the limit, water-filled.

    A rank's load is *projected*: its causal pairs so far plus its room filled at the mean work
    per token of the documents still to come. Without it, the ranks that took a long document
    early would look light to the end, and their room, filled last, would leave them heavy.
    The limit is (1 + WHOLE_TOLERANCE) x the mean, or the current maximum when that is above.
    The greedy bounds the heaviest rank only (a rank left with short documents can end light);
    :func:`even_out` then evens out both ends.
    """
    starts = np.cumsum(lens) - lens
    owner = np.empty(int(lens.sum()), dtype=np.int64)
    load = np.zeros(size)  # causal pairs per rank so far
    room = np.full(size, int(lens.sum()) // size, dtype=np.int64)
    left_pairs, left_tokens = float(pairs(lens).sum()), int(lens.sum())
    mean = left_pairs / size
    for d in np.argsort(-lens, kind="stable"):
        start, n = int(starts[d]), int(lens[d])
        left_pairs, left_tokens = left_pairs - pairs(n), left_tokens - n
        rest_density = left_pairs / left_tokens if left_tokens else 0.0
        projected = load + room * rest_density
        # a token of this document adds (n+1)/2 pairs and displaces one of the rest
        density = max((n + 1) / 2 - rest_density, 1e-9)
        limit = max(mean * (1 + WHOLE_TOLERANCE), projected.max())
        light = pairs(n) <= WHOLE_TOLERANCE * mean
        fits = room >= n
        rank = int(np.argmin(np.where(fits, projected, np.inf)))
        if fits.any() and (light or projected[rank] + n * density <= limit):
            shares, ranks = np.zeros(size, dtype=np.int64), [rank]
            shares[rank] = n
            load += place_in_order(owner, start, shares, ranks)
        elif not fits.any() and light:
            shares, ranks = fill_shares(room, n)
            load += place_in_order(owner, start, shares, ranks)
        else:
            shares = water_fill_fewest(projected, room, n, density, limit)
            load += place_head_tail(owner, start, shares)
        room -= shares
    even_out(owner, lens, size)
    return owner


def pairs(n):
    """Causal pairs of a document of n tokens (query p sees p + 1 keys)."""
    return n * (n + 1) // 2


def span_pairs(offset: int, length: int) -> int:
    """Causal pairs of the queries at in-document positions offset .. offset+length-1."""
    return length * offset + pairs(length)


def fill_shares(room: np.ndarray, n: int) -> tuple[np.ndarray, list[int]]:
    """n tokens into the ranks with the most room, each filled before the next: (shares,
    the ranks in document order)."""
    by_room = np.argsort(-room, kind="stable")
    ranks = by_room[: int(np.searchsorted(np.cumsum(room[by_room]), n)) + 1].tolist()
    shares = np.zeros(len(room), dtype=np.int64)
    left = n
    for rank in ranks:
        shares[rank] = min(left, int(room[rank]))
        left -= shares[rank]
    return shares, ranks


def water_fill_fewest(load, room, n: int, density: float, limit: float) -> np.ndarray:
    """Shares of n tokens water-filled over the fewest least loaded ranks that keep every load
    within ``limit`` (each rank reached costs pieces), else over all ranks."""
    by_load = np.argsort(load, kind="stable")
    for m in range(1, len(load) + 1):
        if room[by_load[:m]].sum() < n:
            continue
        some = np.zeros_like(room)
        some[by_load[:m]] = room[by_load[:m]]  # only the m least loaded ranks take a share
        shares = water_fill(load, some, n, density)
        if (load + shares * density).max() <= limit:
            return shares
    return shares


def water_fill(load: np.ndarray, room: np.ndarray, n: int, density: float) -> np.ndarray:
    """int64 [N] shares of n tokens, adding ``density`` per token, that lift the least loaded
    ranks to one common level, each within its room (sum(room) >= n)."""
    lo, hi = float(load.min()), float(load.max()) + n * density
    for _ in range(60):  # bisect the level: the shares' sum grows with it
        level = (lo + hi) / 2
        if np.minimum(np.clip((level - load) / density, 0, None), room).sum() < n:
            lo = level
        else:
            hi = level
    exact = np.minimum(np.clip((hi - load) / density, 0, None), room)
    shares = np.minimum(np.floor(exact).astype(np.int64), room)
    remainder = exact - shares  # the tokens rounding left over: largest remainders first
    for rank in np.argsort(-remainder, kind="stable"):
        if shares.sum() == n or remainder[rank] <= 0:
            break
        if shares[rank] < room[rank]:
            shares[rank] += 1
    while shares.sum() < n:  # no remainder left to round up: any room (sum(room) >= n)
        rank = int(np.argmax(room - shares))
        shares[rank] += min(n - shares.sum(), room[rank] - shares[rank])
    return shares


def place_in_order(owner: np.ndarray, start: int, shares: np.ndarray, ranks) -> np.ndarray:
    """Contiguous pieces, ``ranks`` in document order; returns each rank's causal pairs."""
    work = np.zeros(len(shares))
    offset = 0
    for rank in ranks:
        a = int(shares[rank])
        owner[start + offset : start + offset + a] = rank
        work[rank] = span_pairs(offset, a)
        offset += a
    return work


def place_head_tail(owner: np.ndarray, start: int, shares: np.ndarray) -> np.ndarray:
    """Head-tail pairs (rank i: its share // 2 next tokens from the head, the rest from the
    tail; the last rank's two meet in the middle); returns each rank's causal pairs."""
    n = int(shares.sum())
    work = np.zeros(len(shares))
    head, tail = 0, n  # the next head position, one past the next tail position
    for rank in np.flatnonzero(shares):
        a = int(shares[rank]) // 2
        b = int(shares[rank]) - a
        owner[start + head : start + head + a] = rank
        owner[start + tail - b : start + tail] = rank
        work[rank] = span_pairs(head, a) + span_pairs(tail - b, b)
        head, tail = head + a, tail - b
    return work


@dataclasses.dataclass(frozen=True)
class Run:
    """Consecutive row positions [start, stop) of one rank inside one segment, whose first
    token is at in-document position ``offset``; ``whole`` when it is the entire segment."""

    start: int
    stop: int
    offset: int
    whole: bool

    @property
    def length(self) -> int:
        return self.stop - self.start

    @property
    def top(self) -> int:
        """In-document position one past its last token: what its densest tokens see."""
        return self.offset + self.length


@dataclasses.dataclass(frozen=True)
class Trade:
    """The heavy rank's ``window`` (row positions) for the light rank's ``given`` spans
    (row start, length), as many tokens each way; ``error`` is how far the work it moves is
    from the midpoint, ``pieces`` how many pieces it adds."""

    window: tuple[int, int]
    given: tuple[tuple[int, int], ...]
    error: float
    pieces: int


def even_out(owner: np.ndarray, lens: np.ndarray, size: int) -> None:
    """Trade tokens (in place) between the heaviest and the lightest rank until the heaviest
    is within EVEN_TOLERANCE of the lightest, at most 4N trades.

    A trade moves a window of the heavy rank's tokens (dense: late in a long document) to the
    light rank and as many of the light rank's tokens (its shortest whole documents, or the
    start of one of its runs) back, so every rank keeps L/N tokens. It moves half the gap,
    as near as the tokens allow; one that cannot narrow the gap is not made, and when no
    rank heavier than the lightest by the tolerance has one, the plan stays as it is."""
    offset = np.arange(len(owner)) - np.repeat(np.cumsum(lens) - lens, lens)
    for _ in range(4 * size):
        work = np.bincount(owner, weights=offset + 1.0, minlength=size)
        light = int(np.argmin(work))
        light_runs = rank_runs(owner, lens, light)
        for heavy in np.argsort(-work, kind="stable"):
            if work[heavy] <= work[light] * (1 + EVEN_TOLERANCE):
                return
            heavy_runs = rank_runs(owner, lens, heavy)
            gap = work[heavy] - work[light]
            trade = best_trade(heavy_runs, light_runs, gap / 2, PIECE_COST * work.mean())
            if trade is not None:
                owner[trade.window[0] : trade.window[1]] = light
                for start, n in trade.given:
                    owner[start : start + n] = heavy
                break
        else:
            return


def position_runs(q: np.ndarray, lens: np.ndarray):
    """The runs of row positions ``q`` (sorted) that are consecutive and inside one segment of
    ``lens``: int arrays (first position, length, in-segment offset, segment length)."""
    seg = np.repeat(np.arange(len(lens)), lens)[q]
    new = np.ones(len(q), dtype=bool)
    new[1:] = (np.diff(q) != 1) | (seg[1:] != seg[:-1])
    starts = np.flatnonzero(new)
    first = q[starts]
    offset = first - (np.cumsum(lens) - lens)[seg[starts]]
    return first, np.diff(np.append(starts, len(q))), offset, lens[seg[starts]]


def rank_runs(owner: np.ndarray, lens: np.ndarray, rank: int) -> list[Run]:
    """The runs of ``rank``'s tokens, in row order."""
    runs = position_runs(np.flatnonzero(owner == rank), lens)
    return [
        Run(int(first), int(first + n), int(offset), bool(n == segment))
        for first, n, offset, segment in zip(*runs, strict=True)
    ]


# how many of a rank's runs a trade considers (the densest heavy runs, the light rank's
# shortest whole documents), so that a row of thousands of short documents plans in
# milliseconds
TRADE_CANDIDATES = 16


def best_trade(heavy: list[Run], light: list[Run], want: float, piece_cost: float):
    """The trade that moves nearest ``want`` pairs from the heavy rank to the light one,
    each added piece counted as ``piece_cost`` of error; None when none moves between 0 and
    2 x ``want`` (which would not narrow the gap)."""
    heavy = sorted(heavy, key=lambda r: -r.top)[:TRADE_CANDIDATES]
    whole = sorted((r for r in light if r.whole), key=lambda r: r.length)
    starts = [r for r in light if not r.whole] + whole[-2:]  # a run's start is light
    whole = whole[:TRADE_CANDIDATES]
    options = []
    for run in heavy:
        options += trades_for_documents(run, whole, want)
        options += [trade_for_start(run, s, want) for s in starts]
    options = [t for t in options if t is not None]
    return min(options, key=lambda t: t.error + t.pieces * piece_cost, default=None)


def trades_for_documents(run: Run, whole: list[Run], want: float) -> list[Trade]:
    """The light rank's k shortest whole documents (k = 1, 2, ...) for a window of as many of
    the run's tokens, placed where it moves ``want`` (or at either end: no piece for the
    heavy rank)."""
    trades, given, tokens, pairs_given = [], [], 0, 0.0
    for doc in whole:
        tokens, pairs_given = tokens + doc.length, pairs_given + pairs(doc.length)
        given.append((doc.start, doc.length))
        if tokens > run.length:
            break
        ideal = (want + pairs_given - pairs(tokens)) / tokens - run.offset
        last = run.length - tokens
        for t in sorted({int(round(min(max(ideal, 0), last))), 0, last}):
            moved = span_pairs(run.offset + t, tokens) - pairs_given
            inside = 0 < t < last
            trades.append(trade(run, t, tokens, tuple(given), moved, want, 1 + run.whole + inside))
    return [t for t in trades if t is not None]


def trade_for_start(run: Run, start: Run, want: float):
    """The first x tokens of a light run for the run's last x, x chosen to move ``want``: the
    pairs moved are x * c - x^2 with c = run.top - start.offset."""
    c = run.top - start.offset
    disc = c * c - 4 * want
    x = (c - disc**0.5) / 2 if disc > 0 else c / 2
    x = max(1, min(int(round(x)), run.length, start.length))
    moved = span_pairs(run.top - x, x) - span_pairs(start.offset, x)
    # a piece for the light rank's window and one for the heavy rank's start piece, plus one
    # for each whole segment that becomes a piece
    pieces = 2 + run.whole + (start.whole and x < start.length)
    return trade(run, run.length - x, x, ((start.start, x),), moved, want, pieces)


def trade(run: Run, t: int, tokens: int, given, moved: float, want: float, pieces: int):
    """The trade of the run's tokens [t, t + tokens), if it narrows the gap."""
    if not 0 < moved < 2 * want:
        return None
    window = (run.start + t, run.start + t + tokens)
    return Trade(window, given, abs(moved - want), int(pieces))


@dataclasses.dataclass(frozen=True)
class PlanStats:
    """Per rank, summed over the rows of a batch: causal pairs of its queries (``work``) and
    pieces of split documents it holds (``pieces``: runs of its tokens inside one segment that
    are not the whole segment; each needs keys from, or gives keys to, other ranks)."""

    work: tuple[int, ...]
    pieces: tuple[int, ...]
    rows: int

    @property
    def work_imbalance(self) -> float:
        """max / mean over ranks of the work: how long the slowest rank's attention takes
        relative to a perfect split."""
        mean = sum(self.work) / len(self.work)
        return max(self.work) / mean if mean else 1.0

    @property
    def pieces_per_rank(self) -> float:
        """Pieces per rank and row."""
        return sum(self.pieces) / len(self.pieces) / max(self.rows, 1)


def plan_stats(lens_rows: list[np.ndarray], owners: list[np.ndarray], size: int) -> PlanStats:
    """The work and pieces of every rank under ``owners`` (one per row of segments)."""
    work = np.zeros(size, dtype=np.int64)
    pieces = np.zeros(size, dtype=np.int64)
    for lens, owner in zip(lens_rows, owners, strict=True):
        seg = np.repeat(np.arange(len(lens)), lens)
        in_doc = np.arange(len(owner)) - np.repeat(np.cumsum(lens) - lens, lens)
        work += np.bincount(owner, weights=in_doc + 1, minlength=size).astype(np.int64)
        new_run = np.ones(len(owner), dtype=bool)
        new_run[1:] = (owner[1:] != owner[:-1]) | (seg[1:] != seg[:-1])
        run_start = np.flatnonzero(new_run)
        run_len = np.diff(np.append(run_start, len(owner)))
        split = run_len < lens[seg[run_start]]
        pieces += np.bincount(owner[run_start[split]], minlength=size)
    return PlanStats(tuple(work.tolist()), tuple(pieces.tolist()), len(owners))


def context_parallel_metrics(plans: list[PlanStats]) -> dict[str, float]:
    """The training log's view of an optimizer step's plans (one per micro-batch; every rank
    computes every plan, so these cost no communication): ``train/cp_work_imbalance``, the
    max / mean over ranks of causal pairs, averaged over the micro-batches (each layer's
    gather waits for the slowest rank of its micro-batch), and ``train/cp_pieces_per_rank``,
    pieces of split documents per rank and row. Empty without context parallelism."""
    if not plans:
        return {}
    return {
        "train/cp_work_imbalance": sum(p.work_imbalance for p in plans) / len(plans),
        "train/cp_pieces_per_rank": sum(p.pieces_per_rank for p in plans) / len(plans),
    }
