"""Lightning strategies of torchpass; ``import torchpass_plugins`` registers their names."""

from torchpass_plugins.strategies.ddp import TorchPassDDPStrategy
from torchpass_plugins.strategies.fsdp import TorchPassFSDPStrategy

__all__ = ["TorchPassDDPStrategy", "TorchPassFSDPStrategy"]
