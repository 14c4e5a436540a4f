"""What a load's ``cast=True`` may convert, and the check that a narrowing conversion kept every value.

A cast may change a number's precision (float32 keys into a bfloat16 model), never its kind (floating into integer
or bool, complex into real: ``changes_kind``). A conversion into a dtype of a smaller range (int64 into int32,
float32 into float16, float8 e5m2 into e4m3, uint8 into int8, an integer into bool) is allowed only for values the
target holds: ``narrows_range`` says which conversions can lose a value, and ``check_fits`` finds the first one
that did (torch wraps integers and turns floats into inf or NaN, silently).
"""

from __future__ import annotations

import functools
import math

import torch

from workbench.errors import CheckpointError

__all__ = ["LOAD_ADVICE", "changes_kind", "check_fits", "narrows_range"]


def changes_kind(stored: torch.dtype, target: torch.dtype) -> bool:
    """Whether a cast from ``stored`` into ``target`` changes the kind of number, not its precision: a floating or
    complex key into an integer or bool parameter (truncated), or a complex key into a real one (imaginary dropped)."""
    if stored.is_complex:
        return not target.is_complex
    return stored.is_floating_point and not (target.is_floating_point or target.is_complex)


def _part(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a complex dtype's real and imaginary parts; any other dtype itself."""
    return dtype.to_real() if dtype.is_complex else dtype


def _integer_bounds(dtype: torch.dtype) -> tuple[int, int]:
    """The smallest and largest value of an integer or bool ``dtype``."""
    return (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)


def _largest(dtype: torch.dtype) -> float:
    dtype = _part(dtype)
    return float(torch.finfo(dtype).max if dtype.is_floating_point else _integer_bounds(dtype)[1])


def _smallest(dtype: torch.dtype) -> float:
    dtype = _part(dtype)
    return -float(torch.finfo(dtype).max) if dtype.is_floating_point else float(_integer_bounds(dtype)[0])


@functools.cache
def _first_outside(dtype: torch.dtype) -> tuple[float, bool]:
    """The magnitude where a floating ``dtype``'s rounding leaves its range, and whether that very value leaves it:
    halfway between the largest value and the next one of its top binade (round to nearest even: float16 turns
    65519 into 65504 and 65520 into inf; float8 e4m3fn's 464 rounds to 448, whose last bit is even)."""
    dtype = _part(dtype)
    top = torch.tensor(torch.finfo(dtype).max, dtype=dtype)
    bits = top.view(_BITS[dtype.itemsize])
    largest, below = float(top), float((bits - 1).view(dtype))  # finfo's eps is off for float8 e5m2fnuz
    return largest + (largest - below) / 2, bool(bits.item() & 1)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a float's bits, by its size


@functools.cache
def narrows_range(stored: torch.dtype, target: torch.dtype) -> bool:
    """Whether some value of ``stored`` leaves the range of ``target`` (wraps, or becomes inf or NaN) in a cast
    that keeps the kind of number. An integer or bool target: when it lacks an integer of the stored dtype (int64
    into int32, int8 into uint8, an integer into bool). A floating target: when its largest power of two is smaller
    (float32 into float16 or float8, float8 e5m2 into e4m3, int64 into float16); float32 into bfloat16 and float16
    into float8 e5m2 keep it, so only a value rounding up past the top binade's last number leaves them, as any
    rounding to fewer bits may."""
    if stored == target or changes_kind(stored, target):
        return False
    if target.is_floating_point or target.is_complex:  # by binade: rounding at the very top is precision
        return math.frexp(_largest(target))[1] < math.frexp(_largest(stored))[1]
    return _smallest(target) > _smallest(stored) or _largest(target) < _largest(stored)


# dtypes whose smallest and largest value one ``torch.aminmax`` finds (a NaN makes both NaN)
_MIN_MAX = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
                      torch.int16, torch.int32, torch.int64})


def _inside(values: torch.Tensor, target: torch.dtype) -> bool:
    """Whether every value of ``values`` is known to fit ``target`` from its smallest and largest one (one pass:
    the load of many small tensors paid six); False where that cannot tell (a NaN or inf, another dtype)."""
    if values.dtype not in _MIN_MAX:
        return False
    lo, hi = (x.item() for x in torch.aminmax(values))
    if target.is_floating_point or target.is_complex:
        bound, leaves_at_bound = _first_outside(target)
        return max(-lo, hi) < bound or (max(-lo, hi) == bound and not leaves_at_bound)  # NaN compares False
    low, high = _integer_bounds(target)
    return low <= lo and hi <= high


# what a load says to do about a value its cast=True cannot convert
LOAD_ADVICE = ("cast=True converts only values the model's dtype holds: load into a parameter of the checkpoint's "
               "dtype and convert it yourself")


def check_fits(values: torch.Tensor, target: torch.dtype, what: str, advice: str = LOAD_ADVICE) -> None:
    """Raise ``CheckpointError`` naming ``what`` (the key and the parameter) when a value of ``values`` leaves the
    range of ``target``: an integer outside it (the cast wraps it, or makes it True), or a finite float that does
    not round to a value of the target (the cast makes it inf, NaN, or the largest value: float8 e4m3 saturates;
    65519 into float16 rounds to 65504 and passes). Nothing is checked where the cast cannot narrow
    (``narrows_range``). The error ends with ``advice``, what to do instead."""
    if not narrows_range(values.dtype, target) or values.numel() == 0 or _inside(values, target):
        return
    if target.is_floating_point or target.is_complex:
        parts = torch.view_as_real(values) if values.is_complex() else values
        wide = parts.double() if parts.dtype.itemsize == 8 else parts.float()
        bound, leaves_at_bound = _first_outside(target)  # a value rounding to the largest one fits
        bad = torch.isfinite(wide) & ((wide.abs() >= bound) if leaves_at_bound else (wide.abs() > bound))
        if values.is_complex():
            bad = bad.any(-1)
    else:  # compared as int64 (uint64 values over its range are too big for any other integer)
        lo, hi = _integer_bounds(target)
        wide = values.view(torch.int64) if values.dtype == torch.uint64 else values.long()
        bad = (wide < lo) | (wide > min(hi, torch.iinfo(torch.int64).max))
        if values.dtype == torch.uint64:
            bad |= wide < 0
    if not bool(bad.any()):
        return
    first = values.reshape(-1)[int(torch.nonzero(bad.reshape(-1))[0])]
    count = int(bad.sum())
    kept = ("become inf, NaN or the largest value" if target.is_floating_point or target.is_complex
            else "become True" if target == torch.bool else "wrap around")
    name = str(target).removeprefix("torch.")
    stored = str(values.dtype).removeprefix("torch.")
    raise CheckpointError(
        f"{what}: {count} of {values.numel()} {stored} value(s) do not fit into {name} (the first, {first.item()!r}, "
        f"would {kept}); {advice}"
    )
