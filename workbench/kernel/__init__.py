"""The launcher kernel: a Jupyter kernel whose cells run on every rank of a torch.distributed job.

``workbench kernel install --nprocs 4`` installs it; ``SPMDKernel`` is the kernel, ``worker`` the rank side,
``fold`` the output folding, ``magics`` the kernel's own magics, ``spec`` the kernelspec management.
"""

from workbench.kernel.spec import KernelSpecInfo, install_kernel, list_kernels, remove_kernel

__all__ = ["KernelSpecInfo", "install_kernel", "list_kernels", "remove_kernel"]
