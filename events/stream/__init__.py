"""The event stream: the ZeroMQ publisher and subscriber, the sans-I/O sequencer both sides
share, snapshots, CURVE security and the endpoint rule. Importing this package imports no ZeroMQ;
the publisher and subscriber modules do."""
