"""bench.disk_ceiling: both directions measured on the directory asked for, and the file gone afterwards."""

from __future__ import annotations

import json
import os

from bench.disk_ceiling import main


def test_both_directions_are_measured_in_the_directory_asked_for(tmp_path, capsys) -> None:
    assert main(["--dir", str(tmp_path), "--gib", "0.0078125", "--chunk-mib", "1", "--depth", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["directory"] == str(tmp_path) and result["nbytes"] == 8 << 20 and result["depth"] == 2
    assert result["write_gbps"] > 0 and result["read_gbps"] > 0
    assert os.listdir(tmp_path) == []
