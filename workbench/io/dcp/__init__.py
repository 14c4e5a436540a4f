"""torch DCP checkpoints: save and load planners that shard like the HF path (``planners.py``) and the conversion of
a DCP checkpoint into an HF one (``convert.py``)."""
