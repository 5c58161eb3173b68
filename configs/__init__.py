"""Hydra configs shipped with torchpass-plugins (installed as ``torchpass_plugins.configs``).

A package so that Hydra's ``pkg://`` search path can reach it once installed; the search-path plugin
in ``hydra_plugins/torchpass_searchpath`` appends it to every Hydra app's search path.
"""
