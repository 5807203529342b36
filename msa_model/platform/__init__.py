"""What torch, megatron-core and the host give, in one place: every private API (`compat`),
megatron-core on CPU/gloo (`cpu_shim`), megatron's import-time work left out (`megatron_imports`),
library notices already dealt with (`quiet`), and the lock files' primitives (`lock_files`).

msa_model/__init__.py installs `quiet` and `megatron_imports` (standard library only) before any
entry point imports megatron; this package imports nothing itself."""
