"""Explain why one tensor differs from its reference: find the transform that reproduces it exactly.

Order of questions: dtype (a cast?), then shape (replicated, one shard, padding, transposed), then
values (a permutation from the layout or small factors, one shard in every slot, a precision round trip:
``precision_lost``, never ``dtype_mismatch``, since both dtypes are the same). The first
hypothesis that the data matches bit for bit becomes the finding; if none does, the finding says
what differs (shapes, max abs diff, how many elements) so a person can look further.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from workbench.debug.findings import Finding
from workbench.debug.signatures import Signatures, signatures
from workbench.debug.transforms import (
    Candidate,
    Hint,
    joined_on,
    joined_words,
    on_dim,
    resized_candidates,
    same_length_candidates,
    signature_holds,
    verify_map,
    verify_transpose,
)
from workbench.debug.views import TensorView, bits

__all__ = ["analyze_pair"]

EXACT_TRANSPOSE_BYTES = 256 << 20  # above this a transpose is proven by signatures of both dims only
_ROUND_TRIPS = {
    torch.float64: (torch.float32, torch.bfloat16, torch.float16),
    torch.float32: (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2),
    torch.bfloat16: (torch.float8_e4m3fn, torch.float8_e5m2),
    torch.float16: (torch.float8_e4m3fn, torch.float8_e5m2),
}


def _name(dtype: torch.dtype | None) -> str:
    return "?" if dtype is None else str(dtype).removeprefix("torch.")


def analyze_pair(ref: TensorView, act: TensorView, hints: Sequence[Hint], block_bytes: int) -> Finding:
    """The finding that explains ``act`` (known to differ from ``ref``), with the transform when one holds.

    ``key`` of the finding is ``act.name``; evidence always has both shapes and dtypes.
    """
    evidence: dict[str, Any] = {
        "expected_shape": list(ref.stored_shape), "actual_shape": list(act.stored_shape),
        "expected_dtype": _name(ref.dtype), "actual_dtype": _name(act.dtype),
    }
    if len(act.keys) > 1:
        evidence["hf_keys"] = list(act.keys)
    key = act.name
    if ref.dtype is None or act.dtype is None:
        kind = "shape_mismatch" if ref.shape != act.shape else "value_mismatch"
        return Finding(kind, key, evidence, "this dtype is compared as bytes only: the bytes differ")
    if ref.dtype != act.dtype:
        return _dtype(ref, act, key, evidence, block_bytes)
    if ref.numel() == 0 or act.numel() == 0:
        return Finding("shape_mismatch", key, evidence, "one side is empty: the tensor was never written")
    if ref.stored_shape != act.stored_shape and _same_bytes(ref, act, block_bytes):
        return _reshaped(ref, act, key, evidence)
    sig_ref, sig_act = signatures(ref, block_bytes), signatures(act, block_bytes)
    if ref.shape != act.shape:
        found = _resized(ref, act, sig_ref, sig_act, hints, key, evidence, block_bytes)
        if found is None:
            found = _joined_on_another_dim(ref, act, hints, key, evidence, block_bytes)
        if found is not None:
            return found
        return Finding("shape_mismatch", key, evidence,
                       "no replication, shard, padding or transpose explains the shapes: is it another "
                       "parameter's tensor, or saved from a different model config?")
    found = _permuted(ref, act, sig_ref, sig_act, hints, key, evidence, block_bytes)
    if found is not None:
        return found
    found = _round_trip(ref, act, key, evidence, block_bytes)
    if found is not None:
        return found
    return _value_mismatch(ref, act, key, evidence, block_bytes)


def _same_bytes(ref: TensorView, act: TensorView, block_bytes: int) -> bool:
    """Whether both views hold the same bytes (read ``block_bytes`` at a time)."""
    if ref.nbytes != act.nbytes:
        return False
    return all(ref.read_raw(a, a + block_bytes) == act.read_raw(a, a + block_bytes)
               for a in range(0, ref.nbytes, block_bytes))


def _reshaped(ref: TensorView, act: TensorView, key: str, evidence: dict[str, Any]) -> Finding:
    want, got = list(ref.stored_shape), list(act.stored_shape)
    return Finding("shape_mismatch", key, {**evidence, "transform": "same bytes, stored with another shape",
                                           "verified": "bit for bit"},
                   f"the values are right but stored as {got} where {want} is expected (a reshape, view, squeeze or "
                   f"flatten before saving): save it with shape {want}; nothing was reordered")


_MAX_ORDER = 64  # block orders longer than this are not put into the evidence


def _joined_on_another_dim(ref: TensorView, act: TensorView, hints: Sequence[Hint], key: str,
                           evidence: dict[str, Any], block_bytes: int) -> Finding | None:
    """A tensor whose shards under a layout cut were concatenated on another dim (``joined_on``), checked bit for bit
    (both tensors read whole, so only where each fits in four blocks); None when no cut explains it."""
    if max(ref.nbytes, act.nbytes) > 4 * block_bytes:
        return None
    for h in hints:
        e = joined_on(ref.shape, act.shape, h.dim, h.world) if h.factor == 1 else None
        if e is None:
            continue
        rebuilt = torch.cat(act.read_rows(0, act.shape[0]).chunk(h.world, dim=e), dim=h.dim)
        if torch.equal(bits(rebuilt), bits(ref.read_rows(0, ref.shape[0]))):
            cut = f"S({h.dim})@{h.mesh_dim}" if h.mesh_dim else f"a cut on dim {h.dim}"
            transform, hint = joined_words(h.world, cut, h.dim, e)
            return Finding("shape_mismatch", key, {**evidence, "transform": transform, "verified": "bit for bit"}, hint)
    return None


def block_order(src: torch.Tensor) -> tuple[int, list[int]] | None:
    """``(block length, order)`` of a slice map made of equal blocks (``order[q]``: the reference block that actual
    block ``q`` holds); None for maps with padding or more than ``_MAX_ORDER`` blocks."""
    n = len(src)
    if n == 0 or bool((src < 0).any()):
        return None
    breaks = torch.nonzero(src[1:] != src[:-1] + 1).flatten() + 1
    block = math.gcd(n, *breaks.tolist(), *src[torch.cat([torch.zeros(1, dtype=torch.int64), breaks])].tolist())
    if n // block > _MAX_ORDER:
        return None
    return block, (src[::block] // block).tolist()


def _finding(c: Candidate, key: str, evidence: dict[str, Any], extra: dict[str, Any] | None = None) -> Finding:
    ev = {**evidence, "transform": c.transform, **{k: v for k, v in c.details if v is not None}, **(extra or {})}
    if "dim" not in ev and c.kind in ("permuted", "partial_shard") and len(c.src) == _length(evidence, c.dim):
        found = block_order(c.src)
        if found is not None and found[1] != sorted(found[1]):
            ev.update(dim=c.dim, block_rows=found[0], order=found[1])
    return Finding(c.kind, key, ev, c.hint)


def _length(evidence: dict[str, Any], dim: int) -> int:
    shape = evidence.get("expected_shape") or []
    if dim == 0:
        return shape[0] if shape else 1
    return math.prod(shape[1:]) if len(shape) > 1 else -1


def _try(candidates, ref, act, sig_ref, sig_act, key, evidence, block_bytes) -> Finding | None:
    for c in candidates:
        if signature_holds(c, sig_ref, sig_act):
            exact, nonzero = verify_map(ref, act, c, block_bytes)
            if exact:
                extra = {"verified": "bit for bit"}
                if c.kind == "padding_not_trimmed":
                    extra["padding_nonzero_elements"] = nonzero
                return _finding(c, key, evidence, extra)
    return None


def _transposed(ref, act, sig_ref: Signatures, sig_act: Signatures, key, evidence, block_bytes) -> Finding | None:
    if len(ref.shape) != 2 or act.shape != ref.shape[::-1] or sig_ref.s1 is None or sig_act.s1 is None:
        return None
    if not (torch.equal(sig_act.s0, sig_ref.s1) and torch.equal(sig_act.s1, sig_ref.s0)):
        return None
    if ref.nbytes <= EXACT_TRANSPOSE_BYTES:
        if not verify_transpose(ref, act, block_bytes):
            return None
        how = "bit for bit"
    else:
        how = "64-bit signatures of every row and every column"
    return Finding("permuted", key, {**evidence, "transform": "transposed", "verified": how},
                   "the tensor is stored transposed ([in, out] instead of [out, in]): transpose it when saving, "
                   "or fix the adapter (Conv1D-style weights are stored [in, out])")


def _stacked_transposed(ref, act, key, evidence, block_bytes) -> Finding | None:
    """``act`` is ``ref`` with its last two dims swapped, dim 0 kept (stacked experts ``[E, in, out]`` saved where
    ``[E, out, in]`` is expected), bit for bit: read in blocks of dim 0, up to ``EXACT_TRANSPOSE_BYTES``."""
    if len(ref.shape) < 3 or act.shape != (*ref.shape[:-2], ref.shape[-1], ref.shape[-2]):
        return None
    if ref.nbytes > EXACT_TRANSPOSE_BYTES:
        return None
    step = act.rows_per_block(block_bytes, 2)
    for a in range(0, act.shape[0], step):
        b = min(act.shape[0], a + step)
        if not torch.equal(bits(ref.read_rows(a, b).transpose(-1, -2).contiguous()), bits(act.read_rows(a, b))):
            return None
    return Finding("permuted", key, {**evidence, "transform": "last two dims transposed", "verified": "bit for bit"},
                   "each slice along dim 0 is stored transposed (stacked experts as [E, in, out] instead of "
                   "[E, out, in]?): transpose the last two dims when saving, or fix the conversion")


def _resized(ref, act, sig_ref, sig_act, hints, key, evidence, block_bytes) -> Finding | None:
    found = _transposed(ref, act, sig_ref, sig_act, key, evidence, block_bytes)
    if found is not None:
        return found
    found = _stacked_transposed(ref, act, key, evidence, block_bytes)
    if found is not None:
        return found
    differing = [d for d in range(len(ref.shape)) if len(ref.shape) == len(act.shape) and ref.shape[d] != act.shape[d]]
    if len(differing) != 1 or differing[0] > 1:
        return None
    dim = differing[0]
    s_ref = sig_ref.s0 if dim == 0 else sig_ref.s1
    s_act = sig_act.s0 if dim == 0 else sig_act.s1
    if s_ref is None or s_act is None:
        return None
    return _try(resized_candidates(ref.shape[dim], act.shape[dim], dim, hints, s_ref, s_act),
                ref, act, sig_ref, sig_act, key, evidence, block_bytes)


def _permuted(ref, act, sig_ref, sig_act, hints, key, evidence, block_bytes) -> Finding | None:
    dims = [0] + ([*range(1, len(ref.shape))] if sig_ref.s1 is not None else [])
    dims.sort(key=lambda d: 0 if any(h.dim == d for h in hints) else 1)
    for dim in dims:
        found = _try(_candidates(ref.shape, dim, hints, key, sig_ref, sig_act),
                     ref, act, sig_ref, sig_act, key, evidence, block_bytes)
        if found is not None:
            return found
    if len(ref.shape) == 2 and ref.shape[0] == ref.shape[1]:
        found = _transposed(ref, act, sig_ref, sig_act, key, evidence, block_bytes)
        if found is not None:
            return found
    if len(ref.shape) >= 3 and ref.shape[-1] == ref.shape[-2]:
        found = _stacked_transposed(ref, act, key, evidence, block_bytes)
        if found is not None:
            return found
    for dim in dims:
        found = _any_permutation(ref, act, sig_ref, sig_act, dim, key, evidence, block_bytes)
        if found is not None:
            return found
    return None


def _candidates(shape: Sequence[int], dim: int, hints: Sequence[Hint], key: str, sig_ref: Signatures,
                sig_act: Signatures) -> Iterator[Candidate]:
    """The same-length maps along ``dim``; past dim 1 of a >= 3-d tensor, as maps along its trailing dims flattened
    (the signatures' dim 1), the evidence naming ``dim`` and its block order."""
    if dim == 0 or len(shape) == 2:
        s_ref, s_act = (sig_ref.s0, sig_act.s0) if dim == 0 else (sig_ref.s1, sig_act.s1)
        yield from same_length_candidates(shape[dim], dim, hints, key, s_ref, s_act)
        return
    n, outer, inner = shape[dim], math.prod(shape[1:dim]), math.prod(shape[dim + 1:])
    by_dim = [None if s is None or s.numel() != outer * n * inner else s.reshape(outer, n, inner)
              for s in (sig_ref.s1, sig_act.s1)]
    for c in same_length_candidates(n, dim, hints, key):
        if by_dim[0] is not None and by_dim[1] is not None:  # the signature check first, before the map is built:
            valid = c.src >= 0  # one line along the dim (cheap), then every line
            line = (by_dim[1][0, valid, 0], by_dim[0][0, c.src[valid], 0])
            if not torch.equal(*line) or not torch.equal(by_dim[1][:, valid, :], by_dim[0][:, c.src[valid], :]):
                continue
        found = block_order(c.src)
        named = (("block_rows", found[0]), ("order", found[1])) if found and found[1] != sorted(found[1]) else ()
        yield on_dim(c, shape, (("dim", dim), *named))


def _any_permutation(ref, act, sig_ref, sig_act, dim, key, evidence, block_bytes) -> Finding | None:
    """A reordering of slices no named transform explains: recover it from signatures, name its blocks."""
    s_ref = sig_ref.s0 if dim == 0 else sig_ref.s1
    s_act = sig_act.s0 if dim == 0 else sig_act.s1
    if s_ref is None or s_act is None or not torch.equal(torch.sort(s_ref).values, torch.sort(s_act).values):
        return None
    where: dict[int, list[int]] = {}
    for i, s in enumerate(s_ref.tolist()):
        where.setdefault(s, []).append(i)
    src = torch.tensor([where[s].pop(0) for s in s_act.tolist()], dtype=torch.int64)
    n = len(src)
    if torch.equal(src, torch.arange(n)):
        return None  # nothing moved: the difference is elsewhere
    starts = [0] + [i for i in range(1, n) if int(src[i]) != int(src[i - 1]) + 1]
    block = math.gcd(*starts, n) if len(starts) > 1 else n
    order = (src[::block] // block).tolist()
    on = f"dim {dim}" if dim == 0 or len(ref.shape) == 2 else f"dims 1-{len(ref.shape) - 1} flattened"
    c = Candidate("permuted", dim, src, f"slices reordered on {on} in blocks of {block}: block order {order[:16]}"
                  + (" ..." if len(order) > 16 else ""),
                  "the shards were reassembled in another order than they were cut: compare the block order with "
                  "the mesh's rank order for this parameter (a wrong mesh dim order, or a wrong interleave)",
                  (("block", block),))
    exact, _ = verify_map(ref, act, c, block_bytes)
    return _finding(c, key, evidence, {"verified": "bit for bit"}) if exact else None


def _blockwise_equal(ref: TensorView, act: TensorView, fn, block_bytes: int) -> bool:
    step = act.rows_per_block(block_bytes, 4)
    for a in range(0, act.shape[0], step):
        b = min(act.shape[0], a + step)
        if not torch.equal(bits(fn(ref.read_rows(a, b))), bits(act.read_rows(a, b))):
            return False
    return True


def _dtype(ref, act, key, evidence, block_bytes) -> Finding:
    saved, expected = _name(act.dtype), _name(ref.dtype)
    if ref.shape != act.shape:  # the values cannot be compared: say both, claim nothing about them
        return Finding("dtype_mismatch", key, evidence,
                       f"stored as {saved}, expected {expected}, and shaped {list(act.stored_shape)} where "
                       f"{list(ref.stored_shape)} is expected: a cast does not explain the shape (one shard, a "
                       "transposed or another parameter's tensor, or another model config?); the values were not "
                       "compared")
    if _blockwise_equal(ref, act, lambda t: t.to(act.dtype), block_bytes):
        return Finding("dtype_mismatch", key, {**evidence, "transform": f"cast to {saved}", "verified": "bit for bit"},
                       f"saved as {saved}, expected {expected}; the values are exactly the cast: "
                       "save this key in the expected dtype (check fp32_keys_pattern and the save dtype)")
    if _blockwise_equal(act, ref, lambda t: t.to(ref.dtype), block_bytes):
        return Finding("dtype_mismatch", key, {**evidence, "transform": f"the reference is this cast to {expected}",
                                               "verified": "bit for bit"},
                       f"saved as {saved}, expected {expected}; cast to {expected} it is the reference bit for bit: "
                       f"the higher-precision source of the reference (master weights) was saved; cast it to "
                       f"{expected} when saving if that is what its loaders expect")
    return Finding("dtype_mismatch", key, {**evidence, **_stats(ref, act, block_bytes)},
                   f"stored as {saved}, expected {expected}, and the values differ beyond a cast")


def _round_trip(ref, act, key, evidence, block_bytes) -> Finding | None:
    for low in _ROUND_TRIPS.get(ref.dtype, ()):
        if _blockwise_equal(ref, act, lambda t, low=low: t.to(low).to(ref.dtype), block_bytes):
            return Finding("precision_lost", key, {**evidence, "transform": f"round trip through {_name(low)}",
                                                   "verified": "bit for bit"},
                           f"the dtype is right ({_name(ref.dtype)}) but the values are the reference rounded to "
                           f"{_name(low)} and back: a {_name(low)} copy (compute weights, a cast before saving) was "
                           f"written as {_name(ref.dtype)}; save from the full-precision weights")
    return None


def _wide(t: torch.Tensor) -> torch.Tensor:
    """A float64 (complex128 for complex) copy: the NaN/inf tests torch lacks for fp8 work on it, NaN kept."""
    return t.to(torch.complex128) if t.is_complex() else t.double()


def _stats(ref: TensorView, act: TensorView, block_bytes: int) -> dict[str, Any]:
    """Elements that differ, max abs diff (finite values), first differing flat index, all-zero actual, and the NaN
    and infinite values of the actual where the reference is finite (``actual_nan``, ``actual_inf``: when any)."""
    differ, max_abs, first, nonzero, nan, inf = 0, 0.0, None, 0, 0, 0
    step = act.rows_per_block(block_bytes, 8)
    row = math.prod(act.shape[1:])
    for a in range(0, act.shape[0], step):
        b = min(act.shape[0], a + step)
        x, y = ref.read_rows(a, b), act.read_rows(a, b)
        mask = bits(x.to(y.dtype)) != bits(y) if x.dtype != y.dtype else bits(x) != bits(y)
        count = int(mask.sum())
        if count and first is None:
            first = a * row + int(torch.nonzero(mask.reshape(-1))[0])
        differ += count
        nonzero += int(torch.count_nonzero(bits(y)))
        if y.dtype.is_floating_point or y.dtype.is_complex or x.dtype.is_floating_point:
            x, y = _wide(x), _wide(y)
            finite_ref = torch.isfinite(x)
            nan += int((torch.isnan(y) & finite_ref).sum())
            inf += int((torch.isinf(y) & finite_ref).sum())
            diff = (x - y).abs()
            diff = diff[torch.isfinite(diff)]
            if diff.numel():
                max_abs = max(max_abs, float(diff.max()))
        else:
            diff = (x.long() - y.long()).abs()
            if diff.numel():
                max_abs = max(max_abs, float(diff.max()))
    out: dict[str, Any] = {"differing_elements": differ, "of": act.numel(), "max_abs_diff": max_abs,
                           "first_differing_index": first}
    if nonzero == 0:
        out["actual_all_zero"] = True
    if nan:
        out["actual_nan"] = nan
    if inf:
        out["actual_inf"] = inf
    return out


def _value_mismatch(ref, act, key, evidence, block_bytes) -> Finding:
    stats = _stats(ref, act, block_bytes)
    if stats.get("actual_all_zero"):
        hint = "the tensor is all zeros: it was never written (or never loaded before saving)"
    elif stats.get("actual_nan") or stats.get("actual_inf"):
        hint = (f"the checkpoint holds {stats.get('actual_nan', 0)} NaN and {stats.get('actual_inf', 0)} infinite "
                "values where the reference is finite (max_abs_diff counts finite values only): the weights "
                "diverged or overflowed before the save (a step with a NaN loss, or a cast beyond the dtype's "
                "range); find the first step whose weights hold them")
    else:
        hint = ("no layout transform (interleave, rank order, gate/up swap, transpose) or precision round trip "
                "reproduces these values: the weights themselves differ (another step, another run, or a bug "
                "upstream of the save)")
    return Finding("value_mismatch", key, {**evidence, **stats}, hint)
