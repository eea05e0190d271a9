"""What every configuration section shares: ``extra="forbid"`` validation and the error type."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration problem, with the dotted path, the value and the fix in the message."""


class _Section(BaseModel):
    # a field's docstring (the string below it) is its description: docs/configuration.md is generated
    # from them (plainrl.config.docgen)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
