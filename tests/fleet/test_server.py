"""``shardline serve fleet`` refuses what it cannot reconcile before it serves."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli import main


def test_an_unknown_fleet_or_none_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDLINE_FLEET", raising=False)
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    assert main(["serve", "fleet", "--port", "0", "--registry-url", url]) == 2
    assert "--fleet NAME, --spec FILE" in capsys.readouterr().err
    assert main(["serve", "fleet", "--port", "0", "--registry-url", url, "--fleet", "nope"]) == 2
    assert "no fleet nope in the registry" in capsys.readouterr().err


def test_a_bad_spec_file_or_no_kubectl_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    bad = tmp_path / "bad.yaml"
    bad.write_text("replica_group: {name: BAD}\n")
    assert main(["serve", "fleet", "--port", "0", "--registry-url", url, "--spec", str(bad)]) == 2
    assert "DNS label" in capsys.readouterr().err
    good = tmp_path / "fleet.yaml"
    good.write_text("replica_group: {name: smol, checkpoint: {model_dir: /m}}\n")
    monkeypatch.setenv("PATH", str(tmp_path))  # no kubectl here
    assert main(["serve", "fleet", "--port", "0", "--registry-url", url, "--spec", str(good),
                 "--provisioner", "kubernetes"]) == 2
    assert "kubectl is not on PATH" in capsys.readouterr().err
