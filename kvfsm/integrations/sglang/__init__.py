"""kvfsm as SGLang 0.5.23's decode KV offload manager (a drop-in for upstream's, on CPU and CUDA pools).

In SGLang's scheduler, replace
`from sglang.srt.disaggregation.decode_kvcache_offload_manager import DecodeKVCacheOffloadManager` by
`from kvfsm.integrations.sglang import DecodeKVCacheOffloadManager`. Importing this package does not import
sglang; constructing the manager does (it reads SGLang's published server config).
"""

from kvfsm.integrations.sglang.manager import DecodeKVCacheOffloadManager, RetractionRefusedError
from kvfsm.integrations.sglang.objects import AllocatorView, RequestView, RequestViews, TableView
from kvfsm.integrations.sglang.pool import SGLangDeviceKVPool
from kvfsm.integrations.sglang.settings import Settings, read_settings

__all__ = [
    "AllocatorView",
    "DecodeKVCacheOffloadManager",
    "RequestView",
    "RequestViews",
    "RetractionRefusedError",
    "SGLangDeviceKVPool",
    "Settings",
    "TableView",
    "read_settings",
]
