"""vLLM's NixlConnector with the one process setting kvbaton gives its own engines: the GIL
switch interval (`GIL_SWITCH_INTERVAL_S`). kvbaton sets it in every reading D and every P that
keeps history; this class gives native the same, so a comparison can show which share of a
difference is that setting (`native-gil` against `native-xlayer` in `pd_compare`)."""

from __future__ import annotations

import sys

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

from kvbaton.adapters.vllm.settings import GIL_SWITCH_INTERVAL_S


class GilNixlConnector(NixlConnector):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if 0 < GIL_SWITCH_INTERVAL_S < sys.getswitchinterval():
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
