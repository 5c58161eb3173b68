"""The files generated from the configuration classes (``torchpass_plugins/config.py``): the reference
``docs/configuration.md`` and the shipped Hydra strategy and callback YAML (``configs/strategy/``,
``configs/callbacks/``), which instantiate what ``TorchPassConfig.trainer_kwargs()`` builds from the same table.
Tests fail when a committed copy is stale; regenerate them with::

    python -m torchpass_plugins.config > docs/configuration.md
    python -m torchpass_plugins.config --write-hydra-configs
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, fields
from importlib.resources import files
from pathlib import Path

from torchpass_plugins.config import CALLBACK, STRATEGIES, AgentConfig, TorchPassConfig

_GENERATED = "# Generated from torchpass_plugins/config.py: python -m torchpass_plugins.config --write-hydra-configs\n"
_STRATEGY_NOTE = (
    "# For apps that build their Trainer with hydra.utils.instantiate: strategy=torchpass_{mode}, settings taken\n"
    "# from the `torchpass` group (the same arguments as TorchPassConfig.trainer_kwargs()). Unlike\n"
    "# trainer_kwargs(), selecting it ignores torchpass.enabled: leave it out for plain Lightning.\n")
_CALLBACK_NOTE = (
    "# The event log and background snapshots, in the lightning-hydra-template form (one named entry per\n"
    "# callback): add `- torchpass` to the defaults of your callbacks config. Settings from the `torchpass` group;\n"
    "# unlike TorchPassConfig.trainer_kwargs(), it ignores torchpass.enabled: leave it out for plain Lightning.\n")


def hydra_configs() -> dict[str, str]:
    """The strategy and callback YAML, by path under ``configs/``, each argument interpolating its setting."""

    def body(target: str, arguments: dict[str, str], indent: str = "") -> str:
        lines = [f"_target_: {target}", *(f"{arg}: ${{torchpass.{key}}}" for arg, key in arguments.items())]
        return "".join(f"{indent}{line}\n" for line in lines)

    out = {f"strategy/torchpass_{mode}.yaml": _GENERATED + _STRATEGY_NOTE.format(mode=mode) + body(*spec)
           for mode, spec in STRATEGIES.items()}
    out["callbacks/torchpass.yaml"] = _GENERATED + _CALLBACK_NOTE + "torchpass:\n" + body(*CALLBACK, indent="  ")
    return out


def reference() -> str:
    """The configuration reference, generated from the dataclasses and their fields' help."""
    lines = ["# Configuration reference", "",
             "Generated from `torchpass_plugins/config.py` by `python -m torchpass_plugins.config > "
             "docs/configuration.md`; a test fails when it is stale. Keys are under `torchpass.` in Hydra. A "
             "flag, where a key has one, sets it on `torchpass launch` and `python -m torchpass_plugins.run` "
             "(`TorchPassConfig.launch_argv()` writes them).", ""]

    def section(cls: type, prefix: str, title: str) -> None:
        doc = " ".join((cls.__doc__ or "").split())
        lines.extend([f"## {title}", ""] + ([doc, ""] if doc and not doc.startswith(cls.__name__ + "(") else []))
        lines.extend(["| key | flag | default | meaning |", "|---|---|---|---|"])
        nested = []
        for f in fields(cls):
            if f.default_factory is not MISSING:
                nested.append((f.default_factory, f"{prefix}{f.name}."))
                continue
            meaning = f.metadata["doc"]
            if f.metadata["choices"]:
                meaning += ": " + " | ".join("null" if c is None else c for c in f.metadata["choices"])
            if "launch_default" in f.metadata:
                meaning += f" (`torchpass launch` without the flag: {f.metadata['launch_default']!r})"
            flag = f"`{f.metadata['flag']}`" if f.metadata["flag"] else ""
            meaning = meaning.replace("|", "\\|")  # a pipe would end the table cell
            lines.append(f"| `{prefix}{f.name}` | {flag} | `{f.default!r}` | {meaning} |")
        lines.append("")
        for factory, sub in nested:
            section(factory, sub, f"`{sub.rstrip('.')}`")

    section(TorchPassConfig, "", "`torchpass`")
    section(AgentConfig, "", "`torchpass launch` only")
    lines.extend(_presets())
    return "\n".join(lines)


def _presets() -> list[str]:
    """The shipped presets (``configs/torchpass/*.yaml``), each as the settings it changes."""
    import yaml

    lines = ["## Presets", "",
             "`torchpass=NAME` picks one of the YAML files of the config group `torchpass` that ships with the "
             "package (`configs/torchpass/`, found by Hydra through the search-path plugin); each is the schema "
             "above with these settings:", ""]
    for path in sorted(files("torchpass_plugins.configs").joinpath("torchpass").iterdir(), key=lambda p: p.name):
        if path.name.endswith(".yaml"):
            preset = yaml.safe_load(path.read_text())
            changed = ", ".join(f"`{yaml.safe_dump({k: v}).strip()}`" for k, v in preset.items() if k != "defaults")
            lines.append(f"- `torchpass={path.name[:-5]}`: {changed}")
    return [*lines, ""]


def main(argv: list[str]) -> int:
    if argv == ["--write-hydra-configs"]:
        root = Path(str(files("torchpass_plugins.configs")))
        for name, text in hydra_configs().items():
            (root / name).write_text(text)
        return 0
    if argv:
        sys.stderr.write("usage: python -m torchpass_plugins.config [--write-hydra-configs]\n")
        return 2
    sys.stdout.write(reference())
    return 0
