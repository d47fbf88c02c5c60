"""router_sim: a KV-aware router rebuilt from KV events, routing policies and a simulator."""
