"""Lightning strategies of torchpass; ``import torchpass_plugins`` registers their names."""

from torchpass_plugins.strategies.ddp import TorchPassDDPStrategy

__all__ = ["TorchPassDDPStrategy"]
