"""Pipeline-parallel saves: every stage saves with ``save_hf`` and one checkpoint is published (``save.py``)."""
