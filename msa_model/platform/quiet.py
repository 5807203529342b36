"""Library notices this project has already dealt with, silenced where they are raised.

megatron-core announces at import that Transformer Engine and Apex are missing (five warnings with
their source lines) and, at every model build, that GPTModel is deprecated; DeepSpeed says it
falls back to the CPU; torch.distributed comments on how megatron calls it. None of it asks
anything of the user: the model is built from megatron's local (torch) modules on purpose
(msa_model/model/gpt.py), the optimizer's multi-tensor kernels are torch foreach ops
(msa_model/platform/compat.py). Each filter names the exact message and the module that raises it, so a
new warning, and every warning of this project, still shows. `backend_note` is the one line a
run prints instead.

Installed when msa_model is imported (msa_model/__init__.py), before any entry point imports
megatron.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings

# (message prefix, category, module regex) of warnings.warn calls
_WARNINGS = (
    # megatron.core.optimizer, .optimizer.optimizer, .optimizer.clip_grads, megatron_fsdp: the
    # torch fallbacks they choose are what we use (foreach ops: msa_model/platform/compat.py)
    ("Transformer Engine and Apex are not installed", UserWarning, r"megatron\..*"),
    # megatron.core.models.backends and gpt_layer_specs: torch's RMSNorm is what we build
    ("Apex is not installed. Falling back to Torch Norm", UserWarning, r"megatron\..*"),
    # TransformerConfig's cuda-graph scope default; no CUDA graphs are captured here
    ("full scope is deprecated", UserWarning, r"megatron\..*"),
    # an import-time notice of a multimodal model class this project does not use
    ("MimoModelConfig is experimental", UserWarning, r"megatron\..*"),
    # megatron's indexed dataset logs through its rank helper; the prepared datasets are checked
    # before the process group exists, on the one process that checks them
    ("Could not determine rank from torch.distributed", UserWarning, r"megatron\..*"),
    # megatron reads .grad of non-leaf tensors while collecting params
    ("The .grad attribute of a Tensor that is not a leaf", UserWarning, r".*"),
    # torch.distributed.checkpoint on megatron's calls: metadata read outside a process group, its
    # own API changes, ShardedTensor deprecation
    ("torch.distributed is disabled, unavailable or uninitialized", UserWarning, r"torch\..*"),
    ("The argument order of load has been changed", UserWarning, r"torch\..*"),
    ("Please use DTensor instead and we are deprecating ShardedTensor", UserWarning, r"torch\..*"),
)
# deprecation notices about torch.distributed names megatron still calls
_FUTURE_WARNING_MODULES = (r"torch\.distributed\..*",)

# (logger, message prefix) of log records
_LOG_RECORDS = (
    # printed at every model build: the class is what megatron-core 0.19 offers for this model
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    # DeepSpeed (imported by transformers when present) on a machine without a GPU
    ("DeepSpeed", "Setting accelerator to CPU"),
)


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def install() -> None:
    """Add the filters (idempotent: a filter already present is not added twice)."""
    for message, category, module in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for module in _FUTURE_WARNING_MODULES:
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
    by_logger: dict[str, tuple[str, ...]] = {}
    for name, prefix in _LOG_RECORDS:
        by_logger[name] = by_logger.get(name, ()) + (prefix,)
    for name, prefixes in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(prefixes))


def backend_note() -> str | None:
    """The line that stands for the silenced notices: what runs instead of Transformer Engine and
    Apex (None when either is installed: megatron then says what it uses)."""
    if any(importlib.util.find_spec(name) is not None for name in ("transformer_engine", "apex")):
        return None
    return ("Transformer Engine and Apex are not installed (not needed): megatron-core runs on torch's layers, "
            "RMSNorm and Adam, with torch foreach ops for its multi-tensor kernels")
