"""Where a training step's time goes: attention, MoE (the MLP block) and the rest.

`logging.time_modules=true` adds a callback that brackets every layer's self-attention and MLP
block with timers, forward (module hooks) and backward (backward hooks: from the gradient
reaching the block's output to the gradient leaving its input), and reports per step the
milliseconds of each, plus the step's wall time. CUDA events on the GPU (one device
synchronisation per step, at its end, so the numbers are only collected when asked for);
wall clocks on CPU.

What falls outside the brackets counts as "rest": embeddings, norms, output layer and loss,
the optimizer step and gradient reduction, and host time. Work that autograd schedules apart
from a block's input gradient (the index projections' weight gradients of MSA) also lands in
the rest. Under `model.recompute=full` a layer's forward reruns inside the backward of the
next layer's bracket; read the split without full recompute.
"""

from __future__ import annotations

import time

import torch

from msa_model.training.callbacks import Callback


class _Clock:
    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


class ModuleTimer(Callback):
    """Adds `attention_ms`, `moe_ms` (MLP blocks, dense or MoE) and `step_ms` to each step's metrics."""

    name = "module_timer"
    CATEGORIES = {"self_attention": "attention_ms", "mlp": "moe_ms"}

    def __init__(self, device: torch.device):
        self.clock = _Clock(device.type == "cuda")
        self.spans: dict[str, list] = {key: [] for key in self.CATEGORIES.values()}
        self.handles = []
        self.step_start = None

    def on_train_start(self, trainer) -> None:
        for chunk in trainer.model_chunks:
            model = chunk.module if hasattr(chunk, "module") else chunk
            for layer in getattr(model.decoder, "layers", []):
                for attr, key in self.CATEGORIES.items():
                    self._bracket(getattr(layer, attr), key)

    def _bracket(self, module: torch.nn.Module, key: str) -> None:
        open_marks = {}

        def start(name):
            def hook(*_):
                open_marks[name] = self.clock.mark()
            return hook

        def stop(name):
            def hook(*_):
                if name in open_marks:
                    self.spans[key].append((open_marks.pop(name), self.clock.mark()))
            return hook

        self.handles += [module.register_forward_pre_hook(start("fwd")), module.register_forward_hook(stop("fwd")),
                         module.register_full_backward_pre_hook(start("bwd")),
                         module.register_full_backward_hook(stop("bwd"))]

    def on_step_start(self, trainer) -> None:
        for spans in self.spans.values():
            spans.clear()
        self.step_start = self.clock.mark()

    def on_step_end(self, trainer, metrics: dict) -> None:
        end = self.clock.mark()
        if self.clock.cuda:
            torch.cuda.synchronize()
        metrics["step_ms"] = self.clock.ms(self.step_start, end)
        for key, spans in self.spans.items():
            metrics[key] = sum(self.clock.ms(a, b) for a, b in spans)

    def on_train_end(self, trainer) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
