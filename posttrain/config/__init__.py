"""Typed schemas for stage YAML files; every mistake is reported with file, line, key and a fix."""

from posttrain.config.errors import ConfigError, Issue, did_you_mean
from posttrain.config.overrides import Override, apply_overrides, parse_overrides
from posttrain.config.stage_file import GENERIC_KEYS, Resources, StageHeader
from posttrain.config.yaml_source import load_yaml

__all__ = [
    "GENERIC_KEYS",
    "ConfigError",
    "Issue",
    "Override",
    "Resources",
    "StageHeader",
    "apply_overrides",
    "did_you_mean",
    "load_yaml",
    "parse_overrides",
]
