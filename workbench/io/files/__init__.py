"""Checkpoint files on one process: file plans, safetensors writing (streamed and in place) and sliced reading,
index and headers, atomic publish and owner markers, and the host memory writes are copied into. Nothing here
talks to another rank."""
