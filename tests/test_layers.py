"""The layer rules of tests/check_layers.py hold for the package, and the check finds a
break where there is one (make lint runs the same check)."""

from __future__ import annotations

from tests.check_layers import REPO, breaks, heavy_imports_at_import_time, unexplained_lazy_imports


def test_the_package_keeps_its_layer_rules():
    assert breaks() == []


def test_a_lazy_import_without_its_reason_is_found(tmp_path):
    module = REPO / "rlray" / "core" / "_probe_for_test_layers.py"
    module.write_text(
        "def explained():\n    import json  # a reason\n\n\ndef unexplained():\n    import torch\n"
    )
    try:
        assert unexplained_lazy_imports(module) == [
            "rlray/core/_probe_for_test_layers.py:6: import torch"
        ]
        # A module that loads torch at import time puts its package over the line.
        module.write_text("import torch\n")
        assert heavy_imports_at_import_time("core") == ["torch"]
    finally:
        module.unlink()
