"""Arguments the Python layer checks before the native module sees them, with torch present (a CPU build is
enough); skipped without torch."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import moelink  # noqa: E402 - after the skip


@pytest.mark.parametrize("group", ["x", 3, object()])
def test_a_group_that_is_not_a_process_group_is_a_type_error_naming_it(group):
    with pytest.raises(TypeError) as info:
        moelink.Buffer(group)
    assert info.value.argument == "group", str(info.value)
    assert "process group" in str(info.value) and type(group).__name__ in str(info.value), str(info.value)
