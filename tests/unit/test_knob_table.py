"""The user guide's table of engine options is the one made from EngineArgs: every knob, with
the default and help declared there (regenerate: python -m shardlm.engine.knob_table docs/USER_GUIDE.md)."""

import dataclasses
import os

from shardlm.engine.arg_utils import EngineArgs
from shardlm.engine.knob_table import knob_table, with_table

GUIDE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "USER_GUIDE.md")


def test_the_user_guide_table_is_the_one_made_from_engine_args():
    text = open(GUIDE).read()
    assert with_table(text) == text, "docs/USER_GUIDE.md's engine options differ from EngineArgs: run " \
                                     "python -m shardlm.engine.knob_table docs/USER_GUIDE.md"


def test_the_table_has_every_knob_with_its_flag():
    table = knob_table()
    for f in dataclasses.fields(EngineArgs):
        if f.name != "model":
            assert f"| {f.name} | " in table and f"{f.name.replace('_', '-')}` |" in table, f.name
