"""A TOML policy's errors name the line of the field, also inside the sub-table of an array-of-tables element."""

from __future__ import annotations

import pytest

from omni_accum.errors import PolicyError
from omni_accum.policy import load_policy
from omni_accum.policy.parsing import toml_line


def test_toml_lines_in_the_sub_table_of_an_array_element(tmp_path):
    """`[rules.params]` after `[[rules]]` is the params of the latest rule: the error named the `[[rules]]` line."""
    text = (
        'default = "cat"\n\n[[rules]]\nmatch = "x"\nstrategy = "prealloc"\n\n[rules.params]\ngrowth_factor = "big"\n'
        '[[rules]]\nmatch = "y"\nstrategy = "prealloc"\n[rules.params]\ngrowth_factor = 99\n'
    )
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(PolicyError) as e:
        load_policy(path)
    errs = e.value.errors
    assert any("p.toml, line 8: rules[0].params.growth_factor:" in m for m in errs), errs
    assert any("p.toml, line 13: rules[1].params.growth_factor:" in m for m in errs), errs
    assert toml_line(text, ("rules", 1, "params")) == 12


def test_toml_lines_in_nested_arrays_of_tables():
    nested = "[[a]]\nx = 1\n[[a.b]]\ny = 1\n[[a]]\n[[a.b]]\n[a.b.c]\nz = 1\n"
    assert toml_line(nested, ("a", 1, "b", 0, "c", "z")) == 8
    assert toml_line(nested, ("a", 0, "b", 0, "y")) == 4
    assert toml_line(nested, ("a", 1)) == 5
