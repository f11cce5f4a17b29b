"""NATS, the queue's engine: owned nats-server processes (`server`), client connections
(`endpoint`), per-role users (`roles`), deliveries off the wire (`wire`), publishes inside a
cancellable loop (`publish`), the one pipelined-ack batch publisher (`publisher`) and the one
JetStream-KV lease (`lease`)."""
