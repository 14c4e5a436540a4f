"""Tied weights whose tie was broken at save: the reference holds two keys with equal values (``lm_head.weight``
tied to ``model.embed_tokens.weight``), the checkpoint holds them with different values."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Protocol

from workbench.debug.findings import Finding
from workbench.debug.source import KeyMeta

__all__ = ["broken_tie"]

# a tie is between an input embedding and another key (the output head, or the embedding of another stack)
_EMBEDDING = re.compile(r"embed|(^|\.)wte\.|(^|\.)shared\.|word_embeddings")


class _Fingerprints(Protocol):
    metas: Mapping[str, KeyMeta]

    def of(self, key: str) -> bytes: ...

    def keys_with(self, meta: KeyMeta, fingerprint: bytes) -> list[str]: ...


def broken_tie(finding: Finding, rk: str, ak: str, ref_fp: _Fingerprints, act_fp: _Fingerprints,
               act_of: Mapping[str, str], all_zero: Callable[[str], bool]) -> Finding:
    """``finding`` (a value mismatch of reference key ``rk`` stored as ``ak``) said as a broken tie when the
    reference holds ``rk``'s values in a tied key too (an embedding and its head, equal and not all zero) and the
    checkpoint holds the two with different values; ``finding`` unchanged otherwise."""
    meta = ref_fp.metas[rk]
    if finding.kind != "value_mismatch" or len(meta.shape) < 2:
        return finding
    tied = [k for k in ref_fp.keys_with(meta, ref_fp.of(rk)) if k != rk and k in act_of
            and (_EMBEDDING.search(k) or _EMBEDDING.search(rk))]
    if not tied or all_zero(rk):
        return finding
    other = tied[0]
    mine, theirs = act_of[other], ak
    if act_fp.metas[mine] == act_fp.metas[theirs] and act_fp.of(mine) == act_fp.of(theirs):
        return finding  # still tied: both moved together (another step), not a broken tie
    partner_right = act_fp.metas[mine] == meta and act_fp.of(mine) == ref_fp.of(other)
    if partner_right:
        tie = f"broken: {other} equals the reference"
        said = (f"{other} still equals the reference and {rk} holds other values (a stale copy, or one from "
                "another step)")
    else:
        tie = "broken: neither key equals the reference"
        said = f"neither {rk} nor {other} equals the reference, and they no longer equal each other"
    hint = (f"the reference ties {rk} to {other} (equal values) but the checkpoint holds them apart: {said}. The tie "
            "was broken at save (the two saved from separate copies, one not updated, or the tie not re-applied "
            f"after a load): re-tie them before saving (model.tie_weights(), or write {rk} from {other}), or save "
            "only one and let the loader tie them")
    return Finding(finding.kind, finding.key, {**finding.evidence, "tied_to": other, "tie": tie}, hint)
