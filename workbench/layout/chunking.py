"""The two cut rules of a shard descriptor, as integer interval math.

* Contiguous (PyTorch's chunk rule): ``chunk = ceil(N / W)``; rank ``r`` holds
  ``[min(r * chunk, N), min((r + 1) * chunk, N))``, so trailing ranks may be short or empty.

  =====  =====  ==================
  N      W      sizes by rank
  =====  =====  ==================
  10     3      4, 4, 2
  10     4      3, 3, 3, 1
  3      4      1, 1, 1, 0
  =====  =====  ==================

* Even interleave (expert TP): ``N % (W * F) == 0``; ``run = N / (W * F)``; rank ``r`` holds runs
  ``j * W + r`` for ``j = 0 .. F-1``, in that order. N=8, W=2, F=2 gives run 2: rank 0 holds
  ``[0, 2) [4, 6)`` and rank 1 holds ``[2, 4) [6, 8)``.
"""

from __future__ import annotations

from workbench.errors import LayoutError

__all__ = ["Interval", "chunk_interval", "chunk_length", "chunk_sizes", "gather_chunk", "interleave_intervals",
           "local_sizes"]

Interval = tuple[int, int]  # [start, stop) in the coordinates of the tensor being cut


def chunk_length(n: int, world: int) -> int:
    """PyTorch's chunk rule: the length of a full chunk when ``n`` elements are cut over ``world`` ranks,
    ``ceil(n / world)`` (the last chunks may be shorter or empty)."""
    return -(-n // world)


def gather_chunk(n: int, world: int, factor: int = 1) -> int:
    """What every rank of a group contributes to the all-gather that undoes a cut of ``n`` elements over
    ``world`` ranks: ``chunk_length(n, world)`` for a contiguous cut (short ranks pad up to it), ``n / world``
    for an even interleave (``factor > 1``, every rank holds exactly that much)."""
    return n // world if factor > 1 else chunk_length(n, world)


def chunk_interval(n: int, world: int, index: int) -> Interval:
    """``[start, stop)`` that chunk ``index`` of ``world`` holds of ``n`` elements (may be empty)."""
    chunk = chunk_length(n, world)
    start = min(chunk * index, n)
    return start, min(start + chunk, n)


def chunk_sizes(n: int, world: int) -> tuple[int, ...]:
    """Sizes of every chunk when ``n`` elements are cut over ``world`` ranks."""
    return tuple(b - a for a, b in (chunk_interval(n, world, i) for i in range(world)))


def interleave_intervals(n: int, world: int, index: int, factor: int, *, what: str = "tensor") -> tuple[Interval, ...]:
    """The ``factor`` runs that group rank ``index`` holds under an even interleave.

    A group of one rank holds the whole dim whatever ``factor`` is (the cut is the identity).

    Raises:
        LayoutError: ``n`` is not a multiple of ``world * factor`` (uneven interleave is not defined).
    """
    if world == 1:
        return ((0, n),)
    if n % (world * factor):
        raise LayoutError(
            f"{what}: an interleaved shard needs its dim length N={n} to be a multiple of "
            f"W*F={world}*{factor}={world * factor} (group size W={world}, interleave factor F={factor}); "
            "pad the tensor or pick num_local_stripes that divides it"
        )
    run = n // (world * factor)
    return tuple(((j * world + index) * run, (j * world + index + 1) * run) for j in range(factor))


def local_sizes(n: int, world: int, factor: int) -> set[int]:
    """Every local length a rank can end up with when ``n`` is cut over ``world`` ranks."""
    if factor > 1 and world > 1:
        return {n // world} if n % (world * factor) == 0 else set()
    if n % world == 0:
        return {n // world}
    chunk = chunk_length(n, world)
    full, rest = divmod(n, chunk)
    sizes = {chunk} | ({rest} if rest else set())
    return sizes | {0} if full + (1 if rest else 0) < world else sizes
