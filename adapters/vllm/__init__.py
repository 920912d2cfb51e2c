"""The vLLM KV connector. Load it with
`--kv-transfer-config '{"kv_connector":"KvbatonConnector","kv_connector_module_path":"kvbaton.adapters.vllm","kv_role":"kv_producer"}'`
(`kv_consumer` on the decode engine). The connector class is imported lazily, so modules of this
package that do not need vLLM (settings, identity) can be imported without it.
"""


def __getattr__(name):
    if name in ("KvbatonConnector", "KvbatonMetadata"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(name)


__all__ = ["KvbatonConnector"]
