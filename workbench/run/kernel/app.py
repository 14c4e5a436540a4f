"""``python -m workbench.run.kernel.app``: what kernelspecs installed before the move to ``workbench.kernel`` run.

Reinstall (``workbench kernel install ...``) to point a kernelspec at ``workbench.kernel.app`` directly.
"""

if __name__ == "__main__":
    from workbench.kernel.app import main

    main()
