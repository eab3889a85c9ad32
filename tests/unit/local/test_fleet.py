"""The local fleet (kvdisagg/local/fleet.py): the command lines it gives its instances (nothing
is started here)."""

from __future__ import annotations

import json
from pathlib import Path

from kvdisagg.local.fleet import Fleet


def kv_config(args: list[str]) -> dict:
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def test_each_prefill_may_get_connector_settings_of_its_own(tmp_path: Path) -> None:
    fleet = Fleet(Path("model"), tmp_path, prefills=3, prefill_extra={"lease_seconds": 8.0},
                  prefill_extras=[None, {"protocol_version_override": 6, "lease_seconds": 2.0}])
    extras = [kv_config(p.extra_args)["kv_connector_extra_config"] for p in fleet.prefills]
    assert extras == [{"lease_seconds": 8.0},
                      {"lease_seconds": 2.0, "protocol_version_override": 6},
                      {"lease_seconds": 8.0}]
    assert all(kv_config(p.extra_args)["kv_role"] == "kv_producer" for p in fleet.prefills)
    assert kv_config(fleet.decode.extra_args)["kv_connector_extra_config"] == {}
