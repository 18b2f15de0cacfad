"""The embedded PyTorch engine: a Llama-family model served from the scheduler's plans.

``TorchEngine`` implements :class:`sluicegate.engine.base.Engine`.  Importing this package
imports torch; the scheduler and API layers must not.
"""

from __future__ import annotations

from sluicegate.engine.torch.loader import default_model_path, load_tokenizer
from sluicegate.engine.torch.runner import TorchEngine

__all__ = ["TorchEngine", "default_model_path", "load_tokenizer"]
