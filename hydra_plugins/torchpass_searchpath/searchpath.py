"""Makes torchpass's shipped configs (groups ``torchpass``, ``trainer``, ``strategy``, ``callbacks``) visible
to every Hydra app, so that a defaults list can say ``torchpass: ddp`` without copying any YAML."""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class TorchPassSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        # The YAML presets extend the typed schema, which must be in the ConfigStore before composition.
        # Imported here rather than at module level: Hydra imports every plugin module when it scans them.
        from torchpass_plugins.config import register_configs

        register_configs()
        search_path.append(provider="torchpass", path="pkg://torchpass_plugins.configs")
