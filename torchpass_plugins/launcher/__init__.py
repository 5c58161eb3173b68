"""``torchpass launch``: the per-node agent and the coordinator it hosts on node 0."""

from torchpass_plugins.launcher.agent import Agent, LaunchConfig, launch

__all__ = ["Agent", "LaunchConfig", "launch"]
