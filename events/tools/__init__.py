"""The operator tools: the ``kv-events`` CLI, the stream doctor, the listener, captures, golden
hash files and their checks, and the pytest plugin."""
