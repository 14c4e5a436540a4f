"""Can this machine read files into GPU memory with GPUDirect Storage (cuFile)? Prints each probe and its output.

GDS needs the ``nvidia-fs`` kernel module (``/proc/driver/nvidia-fs``, device nodes ``/dev/nvidia-fs*``), the user
library ``libcufile``, and a filesystem and device it supports (local NVMe, or certain network filesystems; not a
virtio disk). The probes: the module, its nodes, the library, NVIDIA's ``gdscheck`` where installed, torch's cuFile
bindings (``torch.cuda.gds``) and fastsafetensors' own checks, then a fastsafetensors load with ``nogds=False``.

    python bench/gds_check.py [--dir /tmp]
"""

from __future__ import annotations

import argparse
import glob
import subprocess
import tempfile
import traceback
import warnings
from pathlib import Path

SHELL = [
    "uname -r",
    "nvidia-smi --query-gpu=name,driver_version --format=csv,noheader",
    "grep -E '^nvidia' /proc/modules | cut -d' ' -f1-3; lsmod 2>&1 | grep -E 'nvidia_fs|^Module' ",
    "ls -la /proc/driver/nvidia-fs/ 2>&1; cat /proc/driver/nvidia-fs/version 2>&1",
    "ls -la /dev/nvidia-fs* 2>&1 | head -4",
    "ldconfig -p | grep -i cufile",
    "ls /etc/cufile.json /usr/local/cuda/gds/cufile.json 2>&1",
    "ls /usr/local/cuda*/gds/tools/gdscheck* 2>&1 | head -2",
    "lsblk -d -o NAME,TYPE,ROTA,TRAN,MODEL,SIZE 2>&1 | head -8",
]


def sh(cmd: str) -> None:
    done = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    text = (done.stdout + done.stderr).strip() or "(no output)"
    print(f"$ {cmd}\n{text}\n[exit {done.returncode}]\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    for cmd in SHELL:
        sh(cmd)
    sh(f"df -T {args.dir or tempfile.gettempdir()}")
    libs = sorted({p for pattern in ("/usr/local/cuda*/lib64/libcufile.so*", "/usr/lib/x86_64-linux-gnu/libcufile*",
                                     "/usr/local/lib/python3*/*-packages/nvidia/cufile/lib/*",
                                     "/usr/lib/python3*/*-packages/nvidia/cufile/lib/*")
                   for p in glob.glob(pattern)})
    print(f"libcufile files found: {libs or 'none'}\n")
    for tool in glob.glob("/usr/local/cuda*/gds/tools/gdscheck.py") + glob.glob("/usr/local/cuda*/gds/tools/gdscheck"):
        sh(f"{'python3 ' if tool.endswith('.py') else ''}{tool} -p 2>&1 | tail -30")
        break

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: the GPU probes are skipped")
        return
    root = Path(tempfile.mkdtemp(prefix="wb-gds-", dir=args.dir))
    path = root / "model.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.randn(1024, 1024)}, str(path))
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
    try:
        from torch.cuda import gds

        t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        gds.gds_register_buffer(t.untyped_storage())
        print("torch.cuda.gds.gds_register_buffer: ok")
        f = gds.GdsFile(str(path), 0)  # O_RDONLY
        f.load_storage(t.untyped_storage(), 0)
        print("torch.cuda.gds.GdsFile.load_storage: ok")
    except Exception as exc:
        print(f"torch.cuda.gds: {type(exc).__name__}: {exc}")
    try:
        from fastsafetensors import cpp as fstcpp
        from fastsafetensors import fastsafe_open
        from fastsafetensors.copier.nogds import load_library_func

        load_library_func(None)
        print(f"fastsafetensors: is_cufile_found() = {fstcpp.is_cufile_found()}, "
              f"is_gds_supported(0) = {fstcpp.is_gds_supported(0)}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fastsafe_open([str(path)], device="cuda:0", nogds=False) as f:
                f.get_tensor("w")
        print("fastsafetensors fastsafe_open(nogds=False): loaded; warnings: "
              + ("; ".join(str(w.message) for w in caught) or "none"))
    except Exception as exc:
        print(f"fastsafetensors: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=2)}")
    path.unlink()
    root.rmdir()


if __name__ == "__main__":
    main()
