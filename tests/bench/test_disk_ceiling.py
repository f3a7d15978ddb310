"""bench.disk_ceiling: both directions measured on the directory asked for, and the file gone afterwards."""

from __future__ import annotations

import json
import os

import pytest

from bench.disk_ceiling import main, measure_stream


def test_both_directions_are_measured_in_the_directory_asked_for(tmp_path, capsys) -> None:
    assert main(["--dir", str(tmp_path), "--gib", "0.0078125", "--chunk-mib", "1", "--depth", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["directory"] == str(tmp_path) and result["nbytes"] == 8 << 20 and result["depth"] == 2
    assert result["write_gbps"] > 0 and result["read_gbps"] > 0
    assert os.listdir(tmp_path) == []


def test_the_streamed_update_is_timed_against_the_ceiling(tmp_path, capsys) -> None:
    args = ["--dir", str(tmp_path), "--gib", "0.015625", "--chunk-mib", "1", "--depth", "2", "--stream", "--json"]
    assert main(args) == 0
    stream = json.loads(capsys.readouterr().out)["stream"]
    # 16 units of 1024-element multiples: master and two moments (12 B/param) read once and written once
    assert stream["read_bytes"] == stream["written_bytes"] > 0 and stream["units"] == 16
    assert stream["seconds"] > 0 and 0 < stream["of_ceiling"] and stream["gparam_s"] > 0
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("optimizer_state", ["fp32", "int8"])
def test_every_record_of_every_unit_is_streamed_once(tmp_path, optimizer_state) -> None:
    """Units larger than a record (several pieces each): every byte of the state file is read once and written once,
    for FP32 moments and for the 8-bit codes with their block scales (about 6 B/param)."""
    stream = measure_stream(str(tmp_path), 4 << 20, units=4, optimizer_state=optimizer_state, piece_bytes=256 << 10)
    assert stream["records"] > stream["units"] == 4
    assert stream["read_bytes"] == stream["written_bytes"] == stream["state_bytes"] > 0
    params = stream["gparam_s"] * stream["seconds"] * 1e9
    assert stream["state_bytes"] / params == pytest.approx(12 if optimizer_state == "fp32" else 6, rel=0.1)
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="optimizer_state"):
        measure_stream(str(tmp_path), 4 << 20, optimizer_state="fp16")
