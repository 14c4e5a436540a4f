"""Start the launcher kernel for Jupyter: ``python -m workbench.kernel.app -f CONNECTION_FILE``."""

from __future__ import annotations

__all__ = ["main"]


def main() -> None:
    """Run ``SPMDKernel`` under ipykernel's kernel application (what the kernelspec's argv calls)."""
    from ipykernel.kernelapp import IPKernelApp

    from workbench.kernel.kernel import SPMDKernel

    IPKernelApp.launch_instance(kernel_class=SPMDKernel)


if __name__ == "__main__":
    main()
