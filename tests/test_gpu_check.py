"""The GPU check (bench/gpu.py): its CPU dry run runs end to end, so it cannot rot."""

from __future__ import annotations

import json
import sys

import pytest

from tests.kit.data import ROOT

BENCH = ROOT / "bench"


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu

    return gpu


def test_the_dry_run_trains_the_llama_part_and_writes_its_json_and_table(gpu_check, tmp_path):
    record = gpu_check.main(["--dry-run", "--parts", "llama", "--out", str(tmp_path)])
    assert record["dry_run"] and record["device"] == "cpu"
    (row,) = record["parts"]["llama"]
    assert row["tokens_per_s"] > 0 and row["shards"] >= 2  # capped at 1/4: it spills
    assert row["peak_MiB"] <= row["budget_MiB"]
    assert row["bf16_peak_pct"] is None  # no GPU, no peak
    saved = json.loads((tmp_path / "gpu.json").read_text())
    assert saved["summary"] == record["summary"] and saved["summary"][0]["met"] is None
    table = (tmp_path / "gpu.md").read_text()
    assert "| check | measured | target | met |" in table and "## llama" in table


def test_known_gpus_have_a_bf16_peak(gpu_check):
    assert gpu_check.bf16_peak_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)
    assert gpu_check.bf16_peak_flops("NVIDIA H100 PCIe") == pytest.approx(756e12)
    assert gpu_check.bf16_peak_flops("NVIDIA H200") == pytest.approx(989.4e12)
    assert gpu_check.bf16_peak_flops("NVIDIA A100-SXM4-80GB") == pytest.approx(312e12)
    assert gpu_check.bf16_peak_flops("Tesla T4") is None
    assert sys.modules["gpu"] is gpu_check
