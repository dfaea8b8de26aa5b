"""The docs' tables are the ones made from the code: the user guide's engine options from
EngineArgs, the README's feature combinations from feature_rules.RULES (regenerate both:
python -m shardlm.engine.doc_tables)."""

import dataclasses
import os

import pytest

from shardlm.engine.arg_utils import EngineArgs
from shardlm.engine.doc_tables import TABLES, knob_table, with_table
from shardlm.engine.feature_rules import RULES, combinations_table

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.mark.parametrize("path, name, table", TABLES, ids=[t[0] for t in TABLES])
def test_each_doc_table_is_the_one_made_from_the_code(path, name, table):
    text = open(os.path.join(ROOT, path)).read()
    assert with_table(text, name, table) == text, f"{path}'s {name} differ from the code: run " \
                                                  "python -m shardlm.engine.doc_tables"


def test_the_options_table_has_every_knob_with_its_flag():
    table = knob_table()
    for f in dataclasses.fields(EngineArgs):
        if f.name != "model":
            assert f"| {f.name} | " in table and f"{f.name.replace('_', '-')}` |" in table, f.name


def test_the_combinations_table_has_every_rule():
    table = combinations_table()
    assert len(table.splitlines()) == len(RULES) + 2
    for rule in RULES:
        assert rule.combination in table and rule.instead in table
