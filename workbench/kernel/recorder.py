"""torch's flight recorder as the kernel shows it: each rank's last collectives (group, op, sequence number, state).

A rank reads its own recorder (``_compat.dump_nccl_trace`` on NCCL, ``dump_fr_trace`` on gloo) in a helper thread
and sends ``last_entries``; the kernel groups ranks whose last collectives read the same (``recorder_lines``), so
a hang report says which call each rank reached::

    flight recorder (torch's; each rank's last collectives, newest first):
      rank 0: all_reduce #4 on group 0 (default_pg, ranks 0,1) scheduled 6.1 s ago; before it all_reduce #3 completed
      rank 1: all_reduce #3 on group 0 (default_pg, ranks 0,1) completed 6.2 s ago; before it broadcast #2 completed

The recorder's states: ``scheduled`` (queued on the rank), ``started`` (the GPU began it; only with
``TORCH_NCCL_ENABLE_TIMING``), ``completed``. Gloo entries stay ``scheduled``. A call still setting up its group's
communicator reads ``completed`` on torch 2.11 (its end event is not recorded yet); the ledger line above it in a
hang report says where the rank really waits.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from workbench.kernel.fold import format_ranks

__all__ = ["last_entries", "recorder_lines"]


def last_entries(trace: Mapping[str, Any] | None, count: int, since: float | None = None) -> list[dict[str, Any]]:
    """The newest ``count`` collectives of a recorder dump, newest first, as plain dicts: ``group``, ``desc``,
    ``ranks`` (the group's global ranks, "" where the dump does not say), ``op``, ``seq``, ``state``, ``created``
    (wall-clock seconds). ``since``: leave out entries made before then (wall clock), e.g. those of process groups
    the kernel has since destroyed and made again (their names and numbers start over)."""
    if not trace:
        return []
    config = trace.get("pg_config") or {}
    entries = [e for e in trace.get("entries") or []
               if since is None or not isinstance(e.get("time_created_ns"), int) or e["time_created_ns"] >= since * 1e9]
    out = []
    for entry in entries[-count:][::-1]:
        name, desc = [*(entry.get("process_group") or ("?", "")), "", ""][:2]
        op = str(entry.get("profiling_name") or "?").split(":", 1)[-1]  # "nccl:all_reduce" -> "all_reduce"
        seq = entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")
        ranks = (config.get(str(name)) or {}).get("ranks", "")
        created = entry.get("time_created_ns")
        out.append({"group": str(name), "desc": str(desc), "ranks": str(ranks).strip("[]").replace(" ", ""),
                    "op": op, "seq": seq, "state": str(entry.get("state") or "?"),
                    "created": created / 1e9 if isinstance(created, int | float) else None})
    return out


def _entry_text(entry: Mapping[str, Any], now: float | None, group: str | None = None) -> str:
    """One entry in words; the group is left out when it is ``group`` (that of the entry shown before it)."""
    about = ", ".join(x for x in (entry.get("desc"), f"ranks {entry['ranks']}" if entry.get("ranks") else "") if x)
    where = "" if entry.get("group") == group else f" on group {entry.get('group')}" + (f" ({about})" if about else "")
    ago = f" {now - entry['created']:.1f} s ago" if now is not None and entry.get("created") else ""
    return f"{entry.get('op')} #{entry.get('seq')}{where} {entry.get('state')}{ago}"


def _entries_text(entries: list[Mapping[str, Any]], now: float | None) -> str:
    """The newest entry in full (with its age), the earlier ones short: "all_reduce #2 scheduled"."""
    newest = _entry_text(entries[0], now)
    earlier = [_entry_text(e, None, entries[0].get("group")) for e in entries[1:]]
    return newest + (f"; before it {', '.join(earlier)}" if earlier else "")


def recorder_lines(answers: Mapping[int, Mapping[str, Any]], ranks: list[int], now: float | None = None) -> list[str]:
    """Hang-report lines: per rank (ranks with the same last collectives together) its recorder's newest entries.

    ``answers``: rank -> the rank's ``recorder`` message (``entries`` from ``last_entries``, or ``error``);
    ranks without an answer are named as such.
    """
    now = time.time() if now is None else now
    lines = ["flight recorder (torch's; each rank's last collectives, newest first):"]
    by_text: dict[str, list[int]] = {}
    for rank in ranks:
        answer = answers.get(rank)
        if answer is None:
            text = "no answer within the time allowed (its I/O thread is blocked)"
        elif answer.get("error"):
            text = f"could not read it: {answer['error']}"
        elif not answer.get("entries"):
            text = ("empty: no collective recorded (torch keeps none when TORCH_FR_BUFFER_SIZE / "
                    "TORCH_NCCL_TRACE_BUFFER_SIZE was 0 when the rank started, and CPU builds have no NCCL recorder)")
        else:
            text = _entries_text(answer["entries"], None)  # ranks that reached the same calls share a line
        by_text.setdefault(text, []).append(rank)
    for text, owners in by_text.items():
        first = answers.get(owners[0]) or {}
        if first.get("entries"):
            text = _entries_text(first["entries"], now)  # with the ages the lowest of them saw
        lines.append(f"  rank{'s' if len(owners) > 1 else ''} {format_ranks(owners)}: {text}")
    return lines
