"""``python -m workbench``: the same command line as the ``workbench`` script (``workbench.cli``)."""

from workbench.cli import main

raise SystemExit(main())
