"""What megatron does at import that this project does not use, left out: seconds of every start.

- On a machine without CUDA, megatron's torch.compile decorations. `megatron.core.jit` sets
  `jit_fuser = torch.compile`, megatron's fusion modules decorate about forty functions with it
  when they are imported, and its MoE router module decorates an inference-only routing function
  with torch.compile directly. Each decoration goes through torch.compile (the first imports dynamo
  and inductor: about 1.5 s of every process start on CPU), and a call of a decorated function
  compiles it for the CPU for tens of seconds. CPU runs (the tests, the embedded default) want
  neither: right after `megatron.core.jit` runs, megatron's own `disable_jit_fuser()` (before any
  fusion module reads `jit_fuser`), and while the router module runs, torch.compile returns the
  function as it is. The functions stay plain eager PyTorch, the same math. With CUDA nothing
  changes.
- Everywhere, wandb for megatron's `Timers` (`megatron.core.timers` imports it when installed, about
  0.7 s): the project does not use megatron's timers, and imports wandb itself where a run logs to
  it (msa_model/training/metrics.py). While that module runs, `import wandb` finds nothing.

`install()` hooks the first import of those modules. It runs when msa_model is imported
(msa_model/__init__.py; the data package imports msa_model first), before any entry point imports
megatron.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_JIT = "megatron.core.jit"
_ROUTER = "megatron.core.transformer.moe.router"
_TIMERS = "megatron.core.timers"


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def _eager(model=None, **_options):
    """torch.compile's signature, compiling nothing: `@torch.compile` and `@torch.compile(...)`."""
    return model if model is not None else (lambda fn: fn)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, name: str):
        self.inner, self.name = inner, name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        if self.name == _TIMERS and "wandb" not in sys.modules:
            sys.modules["wandb"] = None  # its `import wandb` raises ImportError: no wandb writer
            try:
                self.inner.exec_module(module)
            finally:
                del sys.modules["wandb"]
            return
        if self.name == _ROUTER and _on_cpu():
            import torch

            compile_ = torch.compile
            torch.compile = _eager
            try:
                self.inner.exec_module(module)
            finally:
                torch.compile = compile_
            return
        self.inner.exec_module(module)
        if self.name == _JIT and _on_cpu():
            module.disable_jit_fuser()


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.pending = {_JIT, _ROUTER, _TIMERS}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, fullname)
        return spec


def install() -> None:
    """Hook the first import of those modules (nothing to do once megatron is imported)."""
    if _JIT not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
