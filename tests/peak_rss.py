"""This process's peak resident memory, read from ``/proc`` (Linux): the tests' own measure of what a gather holds,
independent of the memory model under test."""

from __future__ import annotations


def reset_peak() -> bool:
    """Reset the peak (VmHWM) to the current RSS; False where the kernel does not allow it (the test then skips)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_bytes() -> int:
    """The peak resident memory (VmHWM) since the last ``reset_peak``, in bytes."""
    with open("/proc/self/status") as f:
        return int(f.read().split("VmHWM:")[1].split()[0]) * 1024
