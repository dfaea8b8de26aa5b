"""Attention backends: how each step's attention metadata is built and how layers attend
(backend.py: the interface; torch_paged.py, cpu_kernel.py, cuda.py: implementations;
selector.py: the choice, made once per engine)."""
