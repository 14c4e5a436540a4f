"""The launcher kernel moved to ``workbench.kernel``; this name stays so that kernelspecs installed before the move
(``python -m workbench.run.kernel.app``) keep starting."""
