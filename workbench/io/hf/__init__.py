"""HuggingFace checkpoints from sharded models: ``save_hf`` (``save.py``, one rank's part in ``save_session.py``,
stage by stage) and ``load_hf`` (``load.py``), built on ``workbench.io.files`` and ``workbench.run``."""
