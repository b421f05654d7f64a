"""deploy/collector.toml is valid and documents every CollectorConfig key."""

from __future__ import annotations

import dataclasses
import re

from forewarn.collector.config import CollectorConfig
from forewarn.config import load_config

from support.paths import REPO

EXAMPLE = REPO / "deploy" / "collector.toml"


def test_example_loads_and_names_every_key() -> None:
    config = load_config(CollectorConfig, service="collector", path=EXAMPLE, required=True,
                         env={})
    assert config == CollectorConfig(), "the example should show the defaults"
    text = EXAMPLE.read_text()
    for f in dataclasses.fields(CollectorConfig):
        assert re.search(rf"^(# )?{f.name} =|^\[{f.name}\]", text, re.M), f"{f.name} missing"
