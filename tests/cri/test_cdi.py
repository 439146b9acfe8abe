"""The node's CDI specs read from their directories: JSON and YAML, re-read when changed, skipped when unreadable."""

from __future__ import annotations

import json
import os
from pathlib import Path

from shim.cri.cdi import CdiSpecs

U0 = "GPU-00000000-0000-4000-8000-000000000000"
U1 = "GPU-00000000-0000-4000-8000-000000000001"


def spec(name: str, uuid: str, kind: str = "gpu.weft.test/claim") -> dict:
    return {"cdiVersion": "0.5.0", "kind": kind,
            "devices": [{"name": name, "containerEdits": {"env": [f"WEFT_DRA_GPU={uuid}"]}}]}


def test_specs_in_every_directory_json_and_yaml(tmp_path: Path) -> None:
    etc, run = tmp_path / "etc", tmp_path / "run"
    etc.mkdir()
    run.mkdir()
    (etc / "a.json").write_text(json.dumps(spec("a-gpu-0", U0)))
    (run / "b.yaml").write_text(f"cdiVersion: 0.5.0\nkind: gpu.weft.test/claim\ndevices:\n"
                                f"- name: b-gpu-1\n  containerEdits:\n    env: [WEFT_DRA_GPU={U1}]\n")
    (run / "notes.txt").write_text("not a spec")
    got = CdiSpecs([etc, run, tmp_path / "missing"]).gpus()
    assert got == {"gpu.weft.test/claim=a-gpu-0": frozenset({U0}), "gpu.weft.test/claim=b-gpu-1": frozenset({U1})}


def test_a_spec_written_later_is_seen_and_one_removed_is_forgotten(tmp_path: Path) -> None:
    specs = CdiSpecs([tmp_path])
    assert specs.gpus() == {}
    path = tmp_path / "claim.json"
    path.write_text(json.dumps(spec("c-gpu-0", U0)))
    assert specs.gpus() == {"gpu.weft.test/claim=c-gpu-0": frozenset({U0})}
    path.write_text(json.dumps(spec("c-gpu-1", U1)))
    os.utime(path, ns=(1, 1))  # a rewrite within the clock's resolution still differs in size or time
    assert specs.gpus() == {"gpu.weft.test/claim=c-gpu-1": frozenset({U1})}
    path.unlink()
    assert specs.gpus() == {}


def test_an_unparsable_spec_is_skipped_and_the_rest_read(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "bad.yaml").write_text("a: [unclosed")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "good.json").write_text(json.dumps(spec("g-gpu-0", U0)))
    assert CdiSpecs([tmp_path]).gpus() == {"gpu.weft.test/claim=g-gpu-0": frozenset({U0})}
