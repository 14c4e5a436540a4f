"""Tests of workbench.io: file plans, safetensors writing and reading, the index, atomic publish."""
